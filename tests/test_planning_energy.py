"""The energy model: replaying a plan on a profile, checked by hand on a tiny pipeline."""

from __future__ import annotations

import numpy as np
import pytest

from perseus_ext.errors import ProfileError
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.frontier import Frontier, Plan
from perseus_ext.planning.profile import Profile
from perseus_ext.planning.schedule import Kind, interleaved, one_f_one_b


def two_stage_profile() -> Profile:
    rows = []
    for stage in range(2):
        for instruction, fast, slow in (("forward", (1.0, 10.0), (2.0, 6.0)), ("backward", (2.0, 20.0), (3.0, 15.0))):
            rows.append({"stage": stage, "instruction": instruction, "frequency": 1000, "time": fast[0], "energy": fast[1]})
            rows.append({"stage": stage, "instruction": instruction, "frequency": 500, "time": slow[0], "energy": slow[1]})
    return Profile.from_rows(rows, source="hand")


def test_replay_matches_hand_computation() -> None:
    # 2 stages x 1 microbatch: F@s0 -> F@s1 -> B@s1 -> B@s0, a chain.
    model = CostModel(one_f_one_b(2, 1), two_stage_profile(), blocking_power=5.0)
    fastest = model.fastest_choice()
    time, energy = model.replay(fastest)
    assert time == pytest.approx(1 + 1 + 2 + 2)
    # computation 10+10+20+20, each stage busy 3 s of 6 s: blocking 5 W x (3 + 3) s
    assert energy == pytest.approx(60 + 5 * 6)

    slow_first_forward = fastest.copy()
    first = model.dag.index[model.schedule.orders[0][0]]
    slow_first_forward[first] = 1
    time, energy = model.replay(slow_first_forward)
    assert time == pytest.approx(7)
    assert energy == pytest.approx(56 + 5 * (2 * 7 - 7))


def test_batched_replay_equals_one_by_one() -> None:
    model = CostModel(one_f_one_b(2, 3), two_stage_profile(), blocking_power=5.0)
    rng = np.random.default_rng(0)
    choices = rng.integers(0, 2, size=(model.num_nodes, 16))
    times, energies = model.replay(choices)
    for j in range(16):
        t, e = model.replay(choices[:, j])
        assert times[j] == pytest.approx(t)
        assert energies[j] == pytest.approx(e)


def test_plans_round_trip_through_choices_and_json(tmp_path) -> None:
    model = CostModel(one_f_one_b(2, 3), two_stage_profile(), blocking_power=5.0)
    choice = np.array([0, 1] * (model.num_nodes // 2))
    plan = model.to_plan(choice)
    assert plan.frequencies.shape == (2, 6)
    for stage, order in enumerate(model.schedule.orders):
        for k, computation in enumerate(order):
            expected = model.frequencies[model.dag.index[computation], choice[model.dag.index[computation]]]
            assert plan.for_stage(stage)[k] == expected
    assert np.array_equal(model.choice_of(plan), choice)
    frontier = Frontier(model.schedule.summary(), 5.0, (plan,), plan)
    frontier.save(tmp_path / "f.json")
    loaded = Frontier.load(tmp_path / "f.json")
    assert np.array_equal(loaded.plans[0].frequencies, plan.frequencies)
    assert loaded.plans[0].time == plan.time


def test_plan_clocks_are_read_only() -> None:
    plan = Plan(1.0, 2.0, np.array([[1000, 500]]))
    with pytest.raises(ValueError):
        plan.frequencies[0, 0] = 1


def test_plan_with_unknown_clock_is_rejected() -> None:
    model = CostModel(one_f_one_b(2, 1), two_stage_profile(), blocking_power=5.0)
    with pytest.raises(ProfileError, match="not in stage 0's profile"):
        model.choice_of(Plan(0, 0, np.array([[1000, 777], [1000, 1000]])))


def test_profile_must_cover_the_pipeline() -> None:
    with pytest.raises(ProfileError, match="has 2 stages but the schedule has 4 stages"):
        CostModel(one_f_one_b(4, 4), two_stage_profile(), blocking_power=5.0)


def test_interleaved_chunks_take_a_share_of_the_stage_profile() -> None:
    model = CostModel(interleaved(2, 4, 2), two_stage_profile(), blocking_power=5.0)
    forward = next(i for i, c in enumerate(model.dag.computations) if c.kind is Kind.FORWARD)
    assert model.times[forward, 0] == pytest.approx(0.5)
    assert model.energies[forward, 0] == pytest.approx(5.0)


def test_negative_blocking_power_is_rejected() -> None:
    with pytest.raises(ProfileError, match="blocking power"):
        CostModel(one_f_one_b(2, 1), two_stage_profile(), blocking_power=-1.0)
