"""A capped plan's filler split per stage (`planning/filler_program.py`), against a pipeline
computed by hand, and on a real capped frontier: the stages' shares sum to the filler in every
segment, no stage draws above its headroom, and a stage draws only while it waits."""

from __future__ import annotations

import numpy as np
import pytest

from perseus_ext.errors import SolverError
from perseus_ext.measurement.gpu import open_gpu
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.filler_program import FillerWindow, solve_capped, split_filler
from perseus_ext.planning.options import SolverOptions
from perseus_ext.planning.profile import Profile
from perseus_ext.planning.schedule import build_schedule

BLOCKING_W = 10.0
BLOCKING_A100_W = 83.64

# 1F1B, 3 stages x 2 microbatches, forward 1 s and backward 2 s on every stage (one clock).
# By hand: s0 F0 [0,1] F1 [1,2] B0 [7,9] B1 [10,12]; s1 F0 [1,2] F1 [2,3] B0 [5,7] B1 [8,10];
# s2 F0 [2,3] B0 [3,5] F1 [5,6] B1 [6,8]; the iteration lasts 12 s.
BUSY_S = {0: [(0, 2), (7, 9), (10, 12)], 1: [(1, 3), (5, 7), (8, 10)], 2: [(2, 8)]}
BREAKPOINTS_S = [0, 1, 2, 3, 5, 7, 8, 9, 10, 12]
WAITING = [{1, 2}, {2}, {0}, {0, 1}, {0}, {1}, {2}, {0, 2}, {1, 2}]  # per segment, by hand
FILLER_W = [40, 15, 15, 40, 15, 15, 15, 40, 40]  # 20 W to each of two waiting stages, 15 W to one


def hand_pipeline() -> tuple[CostModel, np.ndarray]:
    rows = [{"stage": stage, "instruction": kind, "frequency": 1000, "time": seconds, "energy": 100.0 * seconds}
            for stage in range(3) for kind, seconds in (("forward", 1.0), ("backward", 2.0))]
    model = CostModel(build_schedule("1f1b", 3, 2), Profile.from_rows(rows), BLOCKING_W)
    return model, np.zeros(model.num_nodes, dtype=np.int64)


def test_the_split_of_a_hand_computed_pipeline():
    model, choice = hand_pipeline()
    programs = split_filler(model, choice, np.array(BREAKPOINTS_S, float), np.array(FILLER_W, float),
                            filler_max_w=BLOCKING_W + 20.0)
    assert [p.stage for p in programs] == [0, 1, 2]
    assert [p.first_start_s for p in programs] == [0.0, 1.0, 2.0] and {p.period_s for p in programs} == {12.0}
    assert [tuple((w.start_s, w.end_s, w.watts) for w in p.windows) for p in programs] == [
        ((2, 3, 15), (3, 5, 20), (5, 7, 15), (9, 10, 20)),
        ((0, 1, 20), (3, 5, 20), (7, 8, 15), (10, 12, 20)),
        ((0, 1, 20), (1, 2, 15), (8, 9, 15), (9, 12, 20)),  # touching windows at one power merged
    ]
    for low, high, watts, waiting in zip(BREAKPOINTS_S, BREAKPOINTS_S[1:], FILLER_W, WAITING):
        middle = (low + high) / 2
        drawing = {p.stage: sum(w.watts for w in p.windows if w.start_s < middle < w.end_s) for p in programs}
        assert sum(drawing.values()) == pytest.approx(watts)  # the stages' shares sum to the filler
        assert {stage for stage, w in drawing.items() if w > 0} == waiting  # only the waiting stages draw
        assert max(drawing.values()) <= 20.0  # none above its headroom
    for program in programs:  # never while the stage computes
        assert program.windows
        for window in program.windows:
            assert all(window.end_s <= start or end <= window.start_s for start, end in BUSY_S[program.stage])
    assert sum(p.energy_j for p in programs) == pytest.approx(np.dot(np.diff(BREAKPOINTS_S), FILLER_W))


def test_each_wait_is_anchored_on_the_end_of_the_computation_before_it():
    model, choice = hand_pipeline()
    stage_1 = split_filler(model, choice, np.array(BREAKPOINTS_S, float), np.array(FILLER_W, float),
                           filler_max_w=BLOCKING_W + 20.0)[1]
    assert stage_1.ends_s == (2.0, 3.0, 7.0, 10.0)  # F0, F1, B0, B1 by hand
    # the wait after F1 (3..5), after B0 (7..8), and after B1 (10..12) running into the next
    # iteration's fill (0..1 = 12..13): offsets from each computation's end; two GPUs halve the watts
    assert stage_1.by_computation(gpus_per_stage=2) == (
        (), (FillerWindow(0.0, 2.0, 10.0),), (FillerWindow(0.0, 1.0, 7.5),),
        (FillerWindow(0.0, 2.0, 10.0), FillerWindow(2.0, 3.0, 10.0)))


def test_a_share_above_the_headroom_is_refused():
    model, choice = hand_pipeline()
    with pytest.raises(SolverError, match="headroom 19.0 W"):
        split_filler(model, choice, np.array(BREAKPOINTS_S, float), np.array(FILLER_W, float),
                     filler_max_w=BLOCKING_W + 19.0)


def test_every_plan_of_a_capped_frontier_splits_its_filler_exactly():
    gpu = open_gpu("sim:a100_sxm?pace=0")  # the simulated A100's time and energy curves
    rows = [{"stage": stage, "instruction": kind, "frequency": clock,
             "time": gpu.expected(seconds, clock)[0], "energy": gpu.expected(seconds, clock)[1]}
            for stage in range(3) for kind, seconds in (("forward", 0.01 * (1 + stage)), ("backward", 0.02))
            for clock in (1410, 1200, 1005, 810)]
    schedule, profile = build_schedule("1f1b", 3, 4), Profile.from_rows(rows)
    frontier, capped = solve_capped(schedule, profile, BLOCKING_A100_W, SolverOptions(min_grid_points=100, power_swing_cap=0.3,
                                                                           max_clock_changes_per_s=0),
                                    power_floor=True)
    assert capped.filler and len(capped.plans) == len(frontier.plans) >= 2
    assert any(plan.filler_energy_j > 0 for plan in capped.plans)
    for k, plan in enumerate(capped.plans):
        assert capped.meets_cap(k)
        # energy: the plan's energy counts its filler, which the stages' programs draw in full
        assert sum(stage.energy_j for stage in plan.stages) == pytest.approx(plan.filler_energy_j, rel=1e-9, abs=1e-9)
        for stage in plan.stages:
            assert all(w.watts <= capped.filler_max_w - BLOCKING_A100_W + 1e-6 for w in stage.windows)
    assert capped.for_stage(1).plans[0].stages == (capped.plans[0].stages[1],)
