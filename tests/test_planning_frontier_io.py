"""Frontier files and the compact per-stage form ranks receive."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from planning_profiles import P_BLOCK_A100, profile_path, sub_profile

from perseus_ext.errors import SolverError
from perseus_ext.planning.frontier import Frontier, compact_stage_clocks
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import one_f_one_b
from perseus_ext.planning.solver import SolverOptions, solve_frontier


@pytest.fixture(scope="module")
def frontier() -> Frontier:
    raw = load_profile(profile_path("gpt3-175b-a100_sxm"))
    profile = sub_profile(raw, 4, tuple(range(1410, 850, -45)))
    # Per-computation plans (no clock-change budget): neighbouring plans differ in a few clocks,
    # which the compact form relies on; every plan carries its clock figures all the same.
    return solve_frontier(one_f_one_b(4, 8), profile, P_BLOCK_A100, SolverOptions(max_clock_changes_per_s=0))


def same(a: Frontier, b: Frontier) -> bool:
    return (
        a.schedule == b.schedule
        and a.blocking_power == b.blocking_power
        and len(a.plans) == len(b.plans)
        and all(
            p.time == q.time and p.energy == q.energy and np.array_equal(p.frequencies, q.frequencies)
            and same_figures(p.clock, q.clock)
            for p, q in zip((a.baseline, *a.plans), (b.baseline, *b.plans))
        )
    )


def same_figures(a, b) -> bool:
    """Clock figures equal to float32 precision (the compact form ships them as float32)."""
    if a is None or b is None:
        return a is b
    return bool(np.allclose([a.changes_per_s, a.shortest_hold_s], [b.changes_per_s, b.shortest_hold_s], rtol=1e-6))


def test_saved_json_has_the_documented_layout_and_round_trips(frontier: Frontier, tmp_path) -> None:
    path = tmp_path / "f.json"
    frontier.save(path)
    data = json.loads(path.read_text())  # plain JSON, whatever wrote it
    assert set(data) == {"schedule", "blocking_power", "baseline", "plans"}
    first = data["plans"][0]
    assert set(first) == {"time", "energy", "frequencies", "clock"}
    assert set(first["clock"]) == {"changes_per_s", "shortest_hold_s"}
    assert "clock" not in data["baseline"]  # all clocks at max: no figures were asked of it
    assert first["frequencies"] == frontier.plans[0].frequencies.tolist()
    assert same(Frontier.load(path), frontier)
    assert same(Frontier.from_dict(data), frontier)


def test_compact_form_round_trips(frontier: Frontier) -> None:
    compact = frontier.to_compact()
    assert same(Frontier.from_compact(compact), frontier)
    assert len(pickle.dumps(compact)) < len(pickle.dumps(frontier.to_dict())) / 3


def test_one_stage_and_some_plans(frontier: Frontier) -> None:
    chosen = [0, 3, len(frontier.plans) - 1]
    compact = frontier.to_compact(stages=[2], plans=chosen)
    clocks = compact_stage_clocks(compact, 2)
    assert np.array_equal(clocks, np.stack([frontier.plans[j].frequencies[2] for j in chosen]))
    assert list(compact["plan_indices"]) == chosen
    with pytest.raises(SolverError, match="not all"):
        Frontier.from_compact(compact)
    whole = len(pickle.dumps(frontier.to_compact()))
    assert len(pickle.dumps(frontier.to_compact(stages=[2]))) < whole


def test_the_schedule_round_trips_typed_and_a_bad_one_names_its_field(frontier: Frontier, tmp_path) -> None:
    from perseus_ext.inputs import InputError
    from perseus_ext.planning.schedule import ScheduleKind, ScheduleSummary

    path = tmp_path / "f.json"
    frontier.save(path)
    expected = ScheduleSummary(ScheduleKind.ONE_F_ONE_B, stages=4, microbatches=8, virtual_stages=1)
    assert frontier.schedule == expected and Frontier.load(path).schedule == expected
    assert json.loads(path.read_text())["schedule"] == {"kind": "1f1b", "stages": 4, "microbatches": 8,
                                                        "virtual_stages": 1}
    assert Frontier.from_compact(frontier.to_compact()).schedule == expected
    for schedule, field in (({"kind": "zigzag", "stages": 4, "microbatches": 8}, "schedule"),
                            ({"kind": "1f1b", "stages": 0, "microbatches": 8}, "schedule.stages"),
                            ({"kind": "1f1b", "stages": 4}, "schedule"),
                            ({"kind": "1f1b", "stages": 4, "microbatches": 8, "extra": 1}, "schedule")):
        data = json.loads(path.read_text())
        data["schedule"] = schedule
        path.write_text(json.dumps(data))
        with pytest.raises(InputError, match=field):
            Frontier.load(path)
