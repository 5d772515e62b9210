"""Wait-aware planning: the frontier's extension past T*, checked against the exact MILP with
the wait-aware objective, and the lookups the policies use."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.exact import exact_wait_aware
from perseus_ext.planning.frontier import Frontier
from perseus_ext.planning.profile import Profile, load_profile, pareto_indices, useful_indices
from perseus_ext.planning.schedule import one_f_one_b
from perseus_ext.planning.solver import SolverOptions, solve_frontier
from perseus_ext.planning.wait_aware import plan_ending_at, waiting_energy

# The per-computation solver on its own: no clock-change budget (tests/test_clock_budget.py has it).
UNBUDGETED = SolverOptions(max_clock_changes_per_s=0)

A100 = Path(__file__).resolve().parents[1] / "examples" / "profiles" / "gpt3-175b-a100_sxm.csv"
P_BLOCK_A100 = 83.64


@pytest.fixture(scope="module")
def raw_a100() -> Profile:
    return load_profile(A100)


def raw_sub_profile(raw: Profile, stages: int, clocks: tuple[int, ...]) -> Profile:
    """The first `stages` stages at `clocks` only, unfiltered (dominated clocks kept)."""
    rows = [r for r in raw.rows() if r["stage"] < stages and r["frequency"] in clocks]
    return Profile.from_rows(rows, source=f"{A100.name}[{stages} stages, {clocks}]")


def test_useful_clocks_keep_what_an_energy_filter_drops(raw_a100: Profile) -> None:
    """A clock is dropped only if another is no slower and no costlier in energy - P_block x
    time: slower clocks that cost a little more energy are kept (they are cheaper once the
    blocking they replace is paid); on computations that can never wait, energy decides too."""
    useful = raw_a100.useful_clocks(P_BLOCK_A100)
    extra = 0
    for key, op in useful.points.items():
        raw = raw_a100.points[key]
        energy_only = set(raw.frequencies[pareto_indices(raw.times, raw.energies)])
        assert energy_only <= set(op.frequencies)
        extra += len(op) - len(energy_only)
        waiting = op.energies - P_BLOCK_A100 * op.times
        assert np.all(np.diff(op.times) > 0) and np.all(np.diff(waiting) < 0)
        never_slack = useful_indices(raw.times, raw.energies, P_BLOCK_A100, never_slack=True)
        assert set(raw.frequencies[never_slack]) == energy_only
    assert extra > 0  # clocks slower than each computation's min-energy clock are back


# (stages, microbatches, clocks): the lowest clocks lie below most computations' min-energy
# clock, where only waiting makes them worth running.
SMALL_CASES = [
    (2, 3, (1410, 1200, 1050, 900)),
    (2, 4, (1410, 1140, 975, 855)),
    (3, 3, (1410, 1230, 1020, 870)),
    (3, 4, (1410, 1275, 1035, 885)),
]


@pytest.mark.parametrize("stages, microbatches, clocks", SMALL_CASES)
def test_extension_within_half_a_percent_of_the_exact_wait_aware_optimum(
    raw_a100: Profile, stages: int, microbatches: int, clocks: tuple[int, ...]
) -> None:
    raw = raw_sub_profile(raw_a100, stages, clocks)
    schedule = one_f_one_b(stages, microbatches)
    frontier = solve_frontier(schedule, raw, P_BLOCK_A100, wait_aware=True, options=UNBUDGETED)
    exact_model = CostModel(schedule, raw, P_BLOCK_A100)  # every measured clock
    t_min = frontier.fastest.time
    t_slowest = float(exact_model.dag.makespan(exact_model.times[np.arange(exact_model.num_nodes),
                                                                  exact_model.num_options - 1]))
    worst = 0.0
    for deadline in np.linspace(t_min, 1.05 * t_slowest, 24):
        optimum = exact_wait_aware(exact_model, deadline)
        ours = plan_ending_at(frontier, deadline)
        assert ours.time <= deadline + 1e-9
        worst = max(worst, waiting_energy(frontier, ours, deadline) / optimum.energy - 1)
    assert worst <= 0.005, f"{100 * worst:.3f}% above the exact wait-aware optimum"


def test_extension_plans_are_exact_replays_and_keep_the_ordinary_frontier(raw_a100: Profile) -> None:
    raw = raw_sub_profile(raw_a100, 3, (1410, 1275, 1140, 1035, 960, 885))
    schedule = one_f_one_b(3, 4)
    frontier = solve_frontier(schedule, raw, P_BLOCK_A100, wait_aware=True, options=UNBUDGETED)
    start = frontier.extension_start
    assert start is not None and start < len(frontier.plans)
    ordinary, extension = frontier.ordinary_plans, frontier.plans[start:]
    t_star = frontier.min_energy
    assert t_star is ordinary[-1]
    assert np.all(np.diff([p.time for p in ordinary]) > 0)
    assert np.all(np.diff([p.energy for p in ordinary]) < 0)
    assert any(p.time > t_star.time for p in extension)
    assert all(p.energy > t_star.energy for p in extension if p.time > t_star.time)
    # Every extension plan is Pareto-optimal in (time, energy - P S time) among all plans.
    slope = 3 * P_BLOCK_A100
    for plan in extension:
        waiting = plan.energy - slope * plan.time
        assert not any(
            other is not plan and other.time <= plan.time and other.energy - slope * other.time <= waiting
            for other in frontier.plans
        )
    model = CostModel(schedule, raw.useful_clocks(P_BLOCK_A100), P_BLOCK_A100)
    for plan in extension:
        time, energy = model.replay(model.choice_of(plan))
        assert (plan.time, plan.energy) == (pytest.approx(time, rel=1e-12), pytest.approx(energy, rel=1e-12))
    # Ordinary lookups ignore the extension; the wait-aware one uses it past T*.
    late = max(p.time for p in extension)
    assert frontier.plan_for_deadline(late) is t_star
    assert plan_ending_at(frontier, late) is max(extension, key=lambda p: p.time)
    assert plan_ending_at(frontier, t_star.time) is t_star
    assert plan_ending_at(frontier, 0.5 * frontier.fastest.time) is frontier.fastest
    round_trip = Frontier.from_dict(frontier.to_dict())
    assert round_trip.extension_start == start and round_trip.min_energy.energy == t_star.energy
    compact = Frontier.from_compact(frontier.to_compact())
    assert compact.extension_start == start


def test_latency_aware_extension_reports_latency_aware_replays(raw_a100: Profile) -> None:
    raw = raw_sub_profile(raw_a100, 2, (1410, 1200, 1050, 900))
    schedule = one_f_one_b(2, 4)
    latency = 0.004
    frontier = solve_frontier(schedule, raw, P_BLOCK_A100, switch_latency_s=latency, wait_aware=True, options=UNBUDGETED)
    model = CostModel(schedule, raw.useful_clocks(P_BLOCK_A100), P_BLOCK_A100, latency)
    extension = frontier.plans[frontier.extension_start:]
    assert extension
    for plan in extension:
        time, energy = model.replay(model.choice_of(plan))
        assert plan.time == pytest.approx(time, rel=1e-12) and plan.energy == pytest.approx(energy, rel=1e-12)


def test_one_global_clock_is_the_exact_optimum_when_every_computation_waits_best_at_it() -> None:
    """Bloom/A100 at T'/T = 2: every computation's clock of least energy - blocking power x time
    is 855 MHz, and the all-855 plan meets the deadline, so that plan -- one global clock -- is
    the exact wait-aware optimum (the cost is a sum over computations, each at its minimum):
    perseus-ext can only tie the global clock there, as the emulator's sweep shows."""
    bloom = load_profile(A100.with_name("bloom-a100_sxm.csv"))
    raw = Profile.from_rows([r for r in bloom.rows() if r["stage"] < 3
                             and r["frequency"] in (1410, 1200, 1050, 960, 900, 855, 810, 750)])
    useful = raw.useful_clocks(P_BLOCK_A100)
    assert {int(op.frequencies[np.argmin(op.energies - P_BLOCK_A100 * op.times)])
            for op in useful.points.values()} == {855}
    schedule = one_f_one_b(3, 4)
    frontier = solve_frontier(schedule, raw, P_BLOCK_A100, wait_aware=True, options=UNBUDGETED)
    deadline = 2.0 * frontier.fastest.time
    model = CostModel(schedule, raw, P_BLOCK_A100)
    uniform = np.argmax(model.frequencies == 855, axis=1)
    time, energy = model.replay(uniform)
    assert time <= deadline
    global_clock = float(energy) + 3 * P_BLOCK_A100 * (deadline - float(time))
    optimum = exact_wait_aware(model, deadline)
    assert optimum.energy == pytest.approx(global_clock, rel=1e-9)
    ours = plan_ending_at(frontier, deadline)
    assert waiting_energy(frontier, ours, deadline) == pytest.approx(global_clock, rel=1e-9)
    assert {int(c) for row in ours.frequencies for c in row} == {855}
