"""A rank receives every plan's time and energy, but only its own stage's clocks: its `StageSolve`
view of the solve's result, the leader's holding the whole frontier."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np

from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.planning.solver import SolverOptions, solve_frontier
from perseus_ext.runtime.comm import Member
from perseus_ext.runtime.records import SolveResult
from perseus_ext.runtime.shipping import ship, shipped_bytes

from planning_profiles import profile_path


def test_each_rank_gets_its_stage_and_every_plans_figures():
    profile = load_profile(profile_path("gpt3-175b-a100_sxm"))
    frontier = solve_frontier(build_schedule("1f1b", 8, 12), profile, 83.64, SolverOptions(min_grid_points=200))
    outcome = SolveResult(frontier, None, 1.0, True)
    members = [Member(rank, 0, rank) for rank in range(8)]
    shipments = ship(outcome, members)
    whole = len(pickle.dumps(outcome))
    for member in members:
        shipment = shipments[member.rank]
        table = shipment.table
        clocks = table.table()
        expected = np.stack([plan.frequencies[member.stage] for plan in frontier.plans])
        assert np.array_equal(clocks, expected)
        assert table.stage == member.stage and table.clocks(3) == tuple(frontier.plans[3].frequencies[member.stage])
        light = table.frontier()
        assert [p.time for p in light.plans] == [p.time for p in frontier.plans]
        assert [p.energy for p in light.plans] == [p.energy for p in frontier.plans]
        assert light.fastest.time == frontier.fastest.time and light.baseline.energy == frontier.baseline.energy
        assert light.extension_start == frontier.extension_start and light.min_energy.time == frontier.min_energy.time
        assert len(light.fastest.frequencies) == 8  # policies count stages by it
        assert shipped_bytes(shipment) < whole / 4
        assert shipment.whole_frontier is None and shipment.frontier.plans[3].time == frontier.plans[3].time
        again = pickle.loads(pickle.dumps(table))  # decoded once, still shipped change-encoded
        assert again.clocks(3) == table.clocks(3) and again.stage == table.stage
    print(f"whole outcome {whole / 1e6:.3f} MB, one rank {shipped_bytes(shipments[0]) / 1e6:.3f} MB")


def test_a_missing_frontier_ships_its_error():
    shipments = ship(SolveResult(None, "no usable profile", 0.0, False), [Member(0, 0, 0), Member(1, 0, 1)])
    assert set(shipments) == {0, 1}
    assert all(s.table is None and s.frontier is None and s.error == "no usable profile" for s in shipments.values())


def test_the_leader_s_view_holds_the_whole_frontier_and_ships_without_it():
    profile = load_profile(profile_path("gpt3-175b-a100_sxm"))
    frontier = solve_frontier(build_schedule("1f1b", 8, 8), profile, 83.64, SolverOptions(min_grid_points=100))
    shipped = SolveResult(frontier, None, 1.0, False).for_stage(0)
    leader = dataclasses.replace(shipped, whole_frontier=frontier)
    assert leader.frontier is frontier and leader.table == shipped.table
    assert len(shipped.frontier.fastest.frequencies[0]) == 0  # the clockless figures, built from the table
    assert shipped_bytes(shipped) < len(pickle.dumps(leader))
