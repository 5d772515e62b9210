"""Stage-constant frontier (planning/stage_constant.py) against every stage-constant plan
enumerated, on small pipelines cut from the published profiles."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from perseus_ext.errors import SolverError
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.profile import Profile, load_profile
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.planning.stage_constant import StageConstantModel, is_stage_constant, solve_stage_constant
from perseus_ext.planning.wait_aware import plan_ending_at, waiting_energy

PROFILES = "examples/profiles"


def _cut(name: str, stages: list[int], clocks: set[int]) -> Profile:
    """The published profile's `stages` (renumbered 0..) at `clocks` only."""
    full = load_profile(f"{PROFILES}/{name}.csv")
    rows = [row for row in full.rows()
            if row["stage"] in stages and row["frequency"] in clocks]
    for row in rows:
        row["stage"] = stages.index(row["stage"])
    return Profile.from_rows(rows, source=f"{name} cut")


def _enumerate(schedule, profile, blocking_power):
    """Time and energy of every stage-constant plan (the oracle: no search at all)."""
    space = StageConstantModel(CostModel(schedule, profile, blocking_power))
    levels = np.array(list(itertools.product(*[range(k) for k in space.num_clocks]))).T
    return space.replay(levels)


CASES = [
    ("gpt3-175b-a100_sxm", [0, 3, 7], {1410, 1305, 1200, 1095, 990, 885}, 83.64, "1f1b", 4),
    ("bloom-a40", [0, 1, 6, 7], {1740, 1560, 1380, 1200, 1020}, 70.38, "1f1b", 6),
    ("bloom-a100_sxm", [0, 7], {1410, 1260, 1110, 960, 855}, 83.64, "interleaved", 4),
]


@pytest.mark.parametrize("name,stages,clocks,power,kind,microbatches", CASES, ids=[c[0] for c in CASES])
def test_stage_constant_frontier_matches_every_plan_enumerated(name, stages, clocks, power, kind, microbatches):
    profile = _cut(name, stages, clocks)
    extra = {"num_chunks": 2} if kind == "interleaved" else {}  # a per-GPU profile, shared by the chunks
    schedule = build_schedule(kind, len(stages), microbatches, **extra)
    frontier = solve_stage_constant(schedule, profile, power, wait_aware=True)
    assert all(is_stage_constant(plan) for plan in frontier.plans)
    times, energies = _enumerate(schedule, profile, power)
    # The frontier starts at the all-max-clock time (a noisy mix of clocks can be faster, at more energy).
    keep = times >= frontier.baseline.time * (1 - 1e-12)
    times, energies = times[keep], energies[keep]
    slope = schedule.num_stages * power
    for deadline in np.linspace(times.min(), times.max(), 60):
        fits = times <= deadline + 1e-12
        best = energies[fits].min()
        assert frontier.plan_for_deadline(deadline).energy <= best * (1 + 1e-9) or \
            frontier.plan_for_deadline(deadline).energy == pytest.approx(best, rel=1e-9)
        held = (energies[fits] + slope * (deadline - times[fits])).min()
        chosen = plan_ending_at(frontier, deadline)
        assert waiting_energy(frontier, chosen, deadline) == pytest.approx(held, rel=1e-9)


def test_straggler_lookup_and_wait_aware_plans_on_a_stage_constant_frontier():
    profile = _cut("gpt3-175b-a100_sxm", [0, 2, 5, 7], set(range(855, 1411, 15)))
    schedule = build_schedule("1f1b", 4, 8)
    frontier = solve_stage_constant(schedule, profile, 83.64, wait_aware=True)
    assert frontier.baseline.time == pytest.approx(frontier.fastest.time)
    slower = frontier.plan_for_deadline(1.2 * frontier.fastest.time)
    assert is_stage_constant(slower) and frontier.fastest.time < slower.time <= 1.2 * frontier.fastest.time
    assert slower.energy < frontier.fastest.energy
    assert frontier.extension_start is not None  # wait-aware plans past the minimum-energy plan


def test_a_stage_without_a_common_clock_is_a_clear_error():
    rows = [{"stage": s, "instruction": kind, "frequency": f, "time": 1.0 + (f < 1400), "energy": 2.0}
            for s in (0, 1) for kind in ("forward", "backward") for f in (1410, 1395)]
    profile = Profile.from_rows(rows)
    # A stage whose forward and backward share no measured clock (as a profile merged from two
    # runs with different candidate clocks can be) cannot run one clock for its iteration.
    profile.points[(0, "backward")] = type(profile.points[(0, "backward")])(
        np.array([1200]), np.array([2.0]), np.array([4.0]))
    with pytest.raises(SolverError, match="stage 0 has no clock measured"):
        solve_stage_constant(build_schedule("1f1b", 2, 2), profile, 0.0)


def test_a_clock_one_computation_drops_can_still_be_the_stages_best():
    """Usefulness per computation (Profile.useful_clocks) must not shrink a stage's choice: the
    stage-constant frontier is never worse than every GPU at one clock."""
    profile = load_profile(f"{PROFILES}/gpt3-175b-a40.csv")
    schedule = build_schedule("1f1b", 8, 8)
    frontier = solve_stage_constant(schedule, profile, 70.38, wait_aware=True)
    model = CostModel(schedule, profile, 70.38)
    common = set.intersection(*(set(model.frequencies[i, : model.num_options[i]].tolist()) for i in range(model.num_nodes)))
    choices = np.stack([np.argmax(model.frequencies == clock, axis=1) for clock in sorted(common)], axis=1)
    times, energies = model.replay(choices)
    for time, energy in zip(times, energies):
        assert frontier.plan_for_deadline(time).energy <= energy * (1 + 1e-9)
