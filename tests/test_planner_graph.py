"""The schedule-agnostic planner graph: placements, stages of different lengths, and every
planning path (frontier, wait-aware plans, stage-constant plans, switch merging, the straggler
lookup, shipping a stage's table) on schedules that run combined units and split gradients."""

from __future__ import annotations

import numpy as np
import pytest

from perseus_ext.errors import ScheduleError
from perseus_ext.planning.dag import PipelineDAG
from perseus_ext.planning.derived import derive_kinds
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.frontier import Frontier
from perseus_ext.planning.profile import Profile, load_profile
from perseus_ext.planning.schedule import (
    Computation,
    Kind,
    build_schedule,
    combined_1f1b,
    interleaved,
    looped_placement,
    schedule_from_actions,
    v_shape_placement,
)
from perseus_ext.planning.solver import SolverOptions, planning_model, solve_frontier
from perseus_ext.planning.stage_constant import is_stage_constant, solve_stage_constant
from perseus_ext.planning.thinning import with_fewer_switches
from tests.planning_profiles import P_BLOCK_A100, profile_path, sub_profile

# The per-computation solver on its own: no clock-change budget (tests/test_clock_budget.py has it).
UNBUDGETED = SolverOptions(max_clock_changes_per_s=0)


@pytest.fixture(scope="module")
def profile2() -> Profile:
    raw = load_profile(profile_path("gpt3-175b-a100_sxm"))
    return derive_kinds(sub_profile(raw, 2, (1410, 1290, 1170, 1050)))


def f(stage: int, chunk: int, m: int) -> Computation:
    return Computation(stage, chunk, m, Kind.FORWARD)


def i(stage: int, chunk: int, m: int) -> Computation:
    return Computation(stage, chunk, m, Kind.INPUT_GRADIENT)


def w(stage: int, chunk: int, m: int) -> Computation:
    return Computation(stage, chunk, m, Kind.WEIGHT_GRADIENT)


def v_shaped_zero_bubble(microbatches: int) -> list[list[Computation]]:
    """A hand-written two-stage V schedule with split gradients: stage 0 holds virtual stages 0
    and 3, stage 1 holds 1 and 2; stage 1 runs both middle ones."""
    s0, s1 = [], []
    for m in range(microbatches):
        s0 += [f(0, 0, m)]
        s1 += [f(1, 0, m), f(1, 1, m)]
        s0 += [f(0, 1, m), i(0, 1, m), w(0, 1, m)]
        s1 += [i(1, 1, m), i(1, 0, m), w(1, 1, m), w(1, 0, m)]
        s0 += [i(0, 0, m), w(0, 0, m)]
    return [s0, s1]


def test_placements() -> None:
    assert looped_placement(3, 2) == ((0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1))
    assert v_shape_placement(3) == ((0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (0, 1))
    schedule = schedule_from_actions(v_shaped_zero_bubble(2), v_shape_placement(2), "zbv")
    assert schedule.num_virtual_stages == 4 and schedule.chunks_per_stage == (2, 2)
    dag = PipelineDAG(schedule)
    # F of virtual stage 2 (stage 1, chunk 1) waits for F of virtual stage 1 on the same stage.
    assert dag.index[f(1, 0, 0)] in dag.predecessors(dag.index[f(1, 1, 0)])
    # The loss turns at virtual stage 3 (stage 0, chunk 1); I of 2 needs I of 3.
    assert dag.index[i(0, 1, 0)] in dag.predecessors(dag.index[i(1, 1, 0)])
    # W needs its I on the same stage: the stage order has it first, so W's one edge is the
    # stage order (here from W1c1, which stage 1 runs just before).
    preds = dag.predecessors(dag.index[w(1, 0, 1)])
    assert [dag.computations[p] for p in preds] == [w(1, 1, 1)]


def test_asymmetric_layout_shares_a_stage_profile_by_its_chunks(profile2: Profile) -> None:
    """Stage 0 holds one chunk and stage 1 two: with a per-stage profile each of stage 1's
    chunks is half the stage, stage 0's one chunk all of it."""
    placement = [(0, 0), (1, 0), (1, 1)]
    order0 = [f(0, 0, 0), Computation(0, 0, 0, Kind.BACKWARD)]
    order1 = [f(1, 0, 0), f(1, 1, 0), Computation(1, 1, 0, Kind.BACKWARD), Computation(1, 0, 0, Kind.BACKWARD)]
    schedule = schedule_from_actions([order0, order1], placement)
    assert schedule.chunks_per_stage == (1, 2)
    model = CostModel(schedule, profile2, P_BLOCK_A100)
    for c, share in ((f(0, 0, 0), 1.0), (f(1, 0, 0), 0.5), (f(1, 1, 0), 0.5)):
        node = model.dag.index[c]
        np.testing.assert_array_equal(model.times[node, :4], profile2[c.stage, "forward"].times * share)


def _replays_honestly(frontier: Frontier, model: CostModel) -> int:
    checked = 0
    for plan in frontier.plans[:: max(1, len(frontier.plans) // 25)]:
        time, energy = model.replay(model.choice_of(plan))
        assert plan.time == pytest.approx(float(time), rel=1e-12)
        assert plan.energy == pytest.approx(float(energy), rel=1e-12)
        checked += 1
    return checked


def test_every_planning_path_on_a_combined_schedule(profile2: Profile) -> None:
    schedule = combined_1f1b(2, 4, 2)
    lengths = [len(order) for order in schedule.orders]
    assert lengths[0] != lengths[1]  # the later stage combines more steps
    frontier = solve_frontier(schedule, profile2, P_BLOCK_A100, wait_aware=True, options=UNBUDGETED)
    model = planning_model(schedule, profile2, P_BLOCK_A100, wait_aware=True)
    assert _replays_honestly(frontier, model) > 5
    for stage, length in enumerate(lengths):
        assert all(len(plan.for_stage(stage)) == length for plan in frontier.plans)
        table = frontier.stage_table(stage)
        np.testing.assert_array_equal(table.table()[3], frontier.plans[3].for_stage(stage))
    back = Frontier.from_compact(frontier.to_compact())
    assert [p.for_stage(1) for p in back.plans] == [p.for_stage(1) for p in frontier.plans]
    assert frontier.extension_start is not None
    held = frontier.plan_for_deadline(frontier.fastest.time * 1.07)
    assert held.time <= frontier.fastest.time * 1.07

    latency = solve_frontier(schedule, profile2, P_BLOCK_A100, switch_latency_s=5e-3, options=UNBUDGETED)
    merged = with_fewer_switches(latency, schedule, profile2, P_BLOCK_A100, 5e-3, 20.0)
    lat_model = CostModel(schedule, profile2.useful_clocks(P_BLOCK_A100), P_BLOCK_A100, 5e-3)
    assert _replays_honestly(merged, lat_model) > 0

    constant = solve_stage_constant(schedule, profile2, P_BLOCK_A100)
    assert all(is_stage_constant(p) for p in constant.plans)
    assert _replays_honestly(constant, CostModel(schedule, profile2, P_BLOCK_A100)) > 0


def test_every_planning_path_on_split_gradients(profile2: Profile) -> None:
    schedule = schedule_from_actions(v_shaped_zero_bubble(3), v_shape_placement(2), "zbv")
    frontier = solve_frontier(schedule, profile2, P_BLOCK_A100, UNBUDGETED)
    assert frontier.intrinsic_saving() > 0
    assert _replays_honestly(frontier, planning_model(schedule, profile2, P_BLOCK_A100)) > 5


def test_built_in_producers_and_names() -> None:
    assert build_schedule("combined_1f1b", 2, 4, 2).kind.value == "combined_1f1b"
    with pytest.raises(ScheduleError, match="built from the framework's own action list"):
        build_schedule("zbv", 2, 4, 2)
    with pytest.raises(ScheduleError, match="at least 2 model chunks"):
        build_schedule("combined_1f1b", 2, 4, 1)
    # A schedule from its own action list is the producer's schedule.
    produced = interleaved(4, 8, 2)
    rebuilt = schedule_from_actions(produced.orders, produced.placement, "interleaved")
    assert rebuilt == produced
    assert PipelineDAG(rebuilt).edges() == PipelineDAG(produced).edges()


@pytest.mark.parametrize("schedule", [
    combined_1f1b(2, 4, 2),
    schedule_from_actions(v_shaped_zero_bubble(3), v_shape_placement(2), "zbv"),
    schedule_from_actions([[f(0, 0, 0), Computation(0, 0, 0, Kind.BACKWARD)]]),
], ids=["combined", "zbv", "one-stage"])
def test_nodes_on_every_path_match_networkx(schedule) -> None:
    """`on_every_path` (edge-jump counting in the topological order) against its definition:
    removing the node leaves no path from a first computation to a last one."""
    import networkx as nx

    dag = PipelineDAG(schedule)
    graph = dag.to_networkx()
    sources = [v for v in graph if graph.in_degree(v) == 0]
    sinks = [v for v in graph if graph.out_degree(v) == 0]
    graph.add_edges_from(("source", v) for v in sources)
    graph.add_edges_from((v, "sink") for v in sinks)
    expected = []
    for node in range(len(dag)):
        rest = graph.copy()
        rest.remove_node(node)
        expected.append(not nx.has_path(rest, "source", "sink"))
    assert expected.count(True) > 0
    np.testing.assert_array_equal(dag.on_every_path, expected)
