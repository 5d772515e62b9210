"""Clock groups: runs of consecutive computations of a stage under one clock, solved exactly.

The MILP with groups is held to brute force over every assignment that keeps each group at one
clock (an oracle that enumerates and filters, sharing no code with the MILP's rows), and with
one group per stage to the best of every stage-constant plan, enumerated stage clock by stage
clock through the stage-constant model's own replay.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from perseus_ext.errors import ScheduleError, SolverError
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.exact import brute_force_min_energy, exact_min_energy
from perseus_ext.planning.groups import ClockGroups
from perseus_ext.planning.profile import Profile, load_profile
from perseus_ext.planning.schedule import Computation, Kind, combined_1f1b, one_f_one_b
from perseus_ext.planning.stage_constant import StageConstantModel
from tests.planning_profiles import P_BLOCK_A100, profile_path, sub_profile


@pytest.fixture(scope="module")
def raw() -> Profile:
    return load_profile(profile_path("gpt3-175b-a100_sxm"))


@pytest.mark.parametrize("length", [2, 3])
def test_milp_with_runs_equals_brute_force_over_tied_assignments(raw: Profile, length: int) -> None:
    schedule = one_f_one_b(2, 2)
    model = CostModel(schedule, sub_profile(raw, 2, (1410, 1215, 1020)), P_BLOCK_A100)
    groups = ClockGroups.runs(schedule, length)
    assert max(len(g) for g in groups.groups) == length
    t_min = float(model.replay(model.fastest_choice())[0])
    checked = 0
    for factor in (1.0, 1.03, 1.08, 1.2):
        energy, choice = exact_min_energy(model, t_min * factor, groups)
        assert energy == pytest.approx(brute_force_min_energy(model, t_min * factor, groups), rel=1e-9)
        clocks = model.frequencies[np.arange(model.num_nodes), choice]
        for nodes in groups.node_groups(model.dag.index):
            assert len(set(clocks[nodes].tolist())) == 1
        free, _ = exact_min_energy(model, t_min * factor)
        assert free <= energy * (1 + 1e-9)  # a tie never helps
        checked += 1
    assert checked == 4


def test_one_group_per_stage_is_the_best_stage_constant_plan(raw: Profile) -> None:
    schedule = one_f_one_b(3, 3)
    profile = sub_profile(raw, 3, (1410, 1290, 1170, 1050))
    model = CostModel(schedule, profile, P_BLOCK_A100)
    space = StageConstantModel(model)
    levels = np.array(list(itertools.product(*(range(n) for n in space.num_clocks)))).T
    times, energies = space.replay(levels)
    t_min = float(model.replay(model.fastest_choice())[0])
    groups = ClockGroups.per_stage(schedule)
    for factor in (1.0, 1.05, 1.15):
        deadline = t_min * factor
        best = energies[times <= deadline + 1e-12].min()
        energy, _ = exact_min_energy(model, deadline, groups)
        assert energy == pytest.approx(best, rel=1e-9)


def test_groups_of_a_combined_schedule(raw: Profile) -> None:
    from perseus_ext.planning.derived import derive_kinds

    schedule = combined_1f1b(2, 2, 2)
    profile = derive_kinds(sub_profile(raw, 2, (1410, 1110)))
    model = CostModel(schedule, profile, P_BLOCK_A100)
    groups = ClockGroups.runs(schedule, 2)
    t_min = float(model.replay(model.fastest_choice())[0])
    energy, _ = exact_min_energy(model, t_min * 1.1, groups)
    assert energy == pytest.approx(brute_force_min_energy(model, t_min * 1.1, groups), rel=1e-9)


def test_bad_groups_are_refused_by_name(raw: Profile) -> None:
    schedule = one_f_one_b(2, 2)
    f = lambda s, m: Computation(s, 0, m, Kind.FORWARD)  # noqa: E731
    b = lambda s, m: Computation(s, 0, m, Kind.BACKWARD)  # noqa: E731
    with pytest.raises(ScheduleError, match="spans stages"):
        ClockGroups.of(schedule, [[f(0, 0), f(1, 0)]])
    with pytest.raises(ScheduleError, match="not a run of consecutive"):
        ClockGroups.of(schedule, [[f(0, 0), b(0, 1)]])
    with pytest.raises(ScheduleError, match="already in another group"):
        ClockGroups.of(schedule, [[f(0, 0)], [f(0, 0), f(0, 1)]])
    with pytest.raises(ScheduleError, match="is empty"):
        ClockGroups.of(schedule, [[]])
    with pytest.raises(ScheduleError, match="not a computation of the schedule"):
        ClockGroups.of(schedule, [[f(0, 5)]])
    rows = raw.rows()
    split = [r for r in rows if r["stage"] < 2 and (
        (r["instruction"] == "forward" and r["frequency"] in (1410, 1200)) or
        (r["instruction"] == "backward" and r["frequency"] in (1410, 1200)))]
    model = CostModel(schedule, Profile.from_rows(split), P_BLOCK_A100)
    model.frequencies[model.dag.index[b(0, 0)], :2] = (1395, 1185)  # no clock shared with F0
    with pytest.raises(SolverError, match="no clock every member was profiled at"):
        exact_min_energy(model, 10.0, ClockGroups.of(schedule, [[f(0, 1), b(0, 0)]]))


def test_groups_tighten_the_lp_relaxation_and_bound_the_milp(raw: Profile) -> None:
    from perseus_ext.planning.exact import lp_bound

    schedule = one_f_one_b(3, 4)
    model = CostModel(schedule, sub_profile(raw, 3, (1410, 1290, 1170, 1050)), P_BLOCK_A100)
    groups = ClockGroups.per_stage(schedule)
    t_min = float(model.replay(model.fastest_choice())[0])
    tighter = 0
    for factor in (1.02, 1.06, 1.12):
        deadline = t_min * factor
        free, tied = lp_bound(model, deadline), lp_bound(model, deadline, groups)
        exact, _ = exact_min_energy(model, deadline, groups)
        assert free <= tied * (1 + 1e-9) and tied <= exact * (1 + 1e-9)
        tighter += tied > free * (1 + 1e-6)
    assert tighter > 0, "tying each stage to one clock must raise the LP bound somewhere"
    assert lp_bound(model, t_min * 0.9, groups) is None
