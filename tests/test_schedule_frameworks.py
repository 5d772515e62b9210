"""The planner's per-stage orders are exactly what DeepSpeed and megatron-core execute.

Perseus assigns clock `plan.frequencies[s][k]` to the k-th computation stage s runs, so an
order that differs from the framework's by a single swap puts the wrong clock on real work.
These tests run the frameworks' own schedule code (DeepSpeed's `TrainSchedule`, megatron-core's
scheduling loops via tests/megatron_shims.py) and compare, and check that `PipelineDAG`'s
edges are the data dependencies those frameworks actually satisfy.
"""

from __future__ import annotations

import itertools
import random

import networkx as nx
import numpy as np
import pytest

from perseus_ext.errors import ScheduleError
from perseus_ext.planning.dag import PipelineDAG
from perseus_ext.planning.schedule import (
    Computation,
    Kind,
    PipelineSchedule,
    build_schedule,
    interleaved,
    one_f_one_b,
)

# (stages, microbatches): fewer microbatches than stages, as many, and more.
ONE_F_ONE_B_SIZES = [
    (1, 1), (1, 4),
    (2, 1), (2, 2), (2, 5),
    (3, 2), (3, 3), (3, 7),
    (4, 1), (4, 3), (4, 4), (4, 9),
    (8, 5), (8, 8), (8, 16),
]  # fmt: skip

# (stages, microbatches, chunks) that megatron accepts with its default group size (= stages).
INTERLEAVED_SIZES = [
    (S, M, V) for S in (2, 4) for V in (2, 3) for M in (S, 2 * S, 3 * S)
] + [(3, 6, 2), (8, 16, 2)]

# (stages, microbatches, chunks, microbatch_group_size_per_vp_stage): microbatch counts that
# are not a multiple of the stages, which megatron allows only with a larger group size.
INTERLEAVED_GROUPED_SIZES = [(2, 5, 2, 3), (2, 7, 3, 4), (4, 9, 2, 5), (4, 10, 2, 5), (3, 8, 2, 5)]

# Sizes megatron refuses for the interleaved schedule (microbatches < group, group < stages,
# or a last group smaller than the stages); the planner must refuse them too.
INTERLEAVED_REFUSED = [
    (2, 3, 2, None),
    (4, 6, 2, None),
    (4, 10, 3, None),
    (2, 4, 2, 5),
    (4, 8, 2, 3),
    (2, 7, 2, 3),
]


def _as_steps(schedule: PipelineSchedule) -> list[list[tuple[str, int, int]]]:
    return [[(c.kind.value, c.microbatch, c.chunk) for c in order] for order in schedule.orders]


# ----------------------------------------------------------------------------- DeepSpeed


def deepspeed_order(num_stages: int, num_microbatches: int, stage: int) -> list[Computation]:
    """The ForwardPass/BackwardPass sequence of DeepSpeed's `TrainSchedule` for one stage.

    TrainSchedule names pipeline *buffers*, not microbatches. DeepSpeed's engine feeds
    forwards in data order (LoadMicroBatch on the first stage, in-order RecvActivation after
    it), so the k-th ForwardPass is microbatch k; a BackwardPass differentiates whatever
    activation sits in its buffer, i.e. the microbatch of the last ForwardPass into that buffer.
    A buffer overwritten before its backward would lose activations, so that fails the test.
    """
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule

    schedule = TrainSchedule(micro_batches=num_microbatches, stages=num_stages, stage_id=stage)
    in_buffer: dict[int, int] = {}
    next_forward = itertools.count()
    order = []
    for instructions in schedule.steps():
        for instruction in instructions:
            if isinstance(instruction, ForwardPass):
                assert instruction.buffer_id not in in_buffer, "live activation overwritten"
                microbatch = next(next_forward)
                in_buffer[instruction.buffer_id] = microbatch
                order.append(Computation(stage, 0, microbatch, Kind.FORWARD))
            elif isinstance(instruction, BackwardPass):
                microbatch = in_buffer.pop(instruction.buffer_id)
                order.append(Computation(stage, 0, microbatch, Kind.BACKWARD))
    return order


@pytest.fixture(scope="module")
def deepspeed_available() -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is optional (extra `deepspeed`)")


@pytest.mark.parametrize("num_stages, num_microbatches", ONE_F_ONE_B_SIZES)
def test_one_f_one_b_matches_deepspeed_train_schedule(
    deepspeed_available, num_stages: int, num_microbatches: int
) -> None:
    planned = one_f_one_b(num_stages, num_microbatches)
    for stage in range(num_stages):
        assert list(planned.orders[stage]) == deepspeed_order(num_stages, num_microbatches, stage)


# ----------------------------------------------------------------------------- megatron-core


@pytest.fixture(scope="module")
def megatron():
    pytest.importorskip("megatron.core", reason="megatron-core is optional (extra `megatron`)")
    import megatron_shims

    return megatron_shims


def _megatron_steps(megatron, *sizes) -> list[list[tuple[str, int, int]]]:
    ranks = megatron.run_megatron_schedule(*sizes)
    return [[(step.kind, step.microbatch, step.chunk) for step in steps] for steps in ranks]


@pytest.mark.parametrize("num_stages, num_microbatches", ONE_F_ONE_B_SIZES)
def test_one_f_one_b_matches_megatron(megatron, num_stages: int, num_microbatches: int) -> None:
    planned = build_schedule("1f1b", num_stages, num_microbatches)
    assert _as_steps(planned) == _megatron_steps(megatron, num_stages, num_microbatches)


@pytest.mark.parametrize("num_stages, num_microbatches, num_chunks", INTERLEAVED_SIZES)
def test_interleaved_matches_megatron(
    megatron, num_stages: int, num_microbatches: int, num_chunks: int
) -> None:
    planned = build_schedule("interleaved", num_stages, num_microbatches, num_chunks)
    assert _as_steps(planned) == _megatron_steps(
        megatron, num_stages, num_microbatches, num_chunks
    )


@pytest.mark.parametrize(
    "num_stages, num_microbatches, num_chunks, group", INTERLEAVED_GROUPED_SIZES
)
def test_interleaved_with_group_size_matches_megatron(
    megatron, num_stages: int, num_microbatches: int, num_chunks: int, group: int
) -> None:
    planned = interleaved(num_stages, num_microbatches, num_chunks, microbatch_group_size=group)
    assert _as_steps(planned) == _megatron_steps(
        megatron, num_stages, num_microbatches, num_chunks, group
    )


@pytest.mark.parametrize("num_stages, num_microbatches, num_chunks, group", INTERLEAVED_REFUSED)
def test_planner_refuses_interleaved_sizes_megatron_refuses(
    megatron, num_stages: int, num_microbatches: int, num_chunks: int, group: int | None
) -> None:
    with pytest.raises((ValueError, RuntimeError), match="micro-batches"):
        megatron.run_megatron_schedule(num_stages, num_microbatches, num_chunks, group)
    with pytest.raises(ScheduleError):
        interleaved(num_stages, num_microbatches, num_chunks, microbatch_group_size=group)


@pytest.mark.parametrize(
    "schedule",
    [one_f_one_b(S, M) for S, M in [(1, 3), (4, 2), (4, 9)]]
    + [interleaved(*sizes) for sizes in [(2, 4, 2), (4, 8, 3)]]
    + [interleaved(2, 5, 2, microbatch_group_size=3)],
    ids=str,
)
def test_dag_data_edges_are_what_megatron_communicates(megatron, schedule) -> None:
    """Every tensor a megatron rank consumed came from the node's DAG data predecessor, and
    every cross-stage DAG edge carried a tensor."""
    dag = PipelineDAG(schedule)
    ranks = megatron.run_megatron_schedule(
        schedule.num_stages,
        schedule.num_microbatches,
        schedule.num_chunks,
        None if schedule.num_chunks == 1 else _group_size_of(schedule),
    )
    observed = set()
    for stage, steps in enumerate(ranks):
        for step in steps:
            if step.consumed is None:
                continue
            node = Computation(stage, step.chunk, step.microbatch, Kind(step.kind))
            virtual_stage, microbatch = step.consumed
            producer = Computation(
                virtual_stage % schedule.num_stages,
                virtual_stage // schedule.num_stages,
                microbatch,
                node.kind,
            )
            assert dag.index[producer] in dag.predecessors(dag.index[node]), (node, producer)
            observed.add((dag.index[producer], dag.index[node]))
    cross_stage = {(p, i) for p, i in dag.edges() if dag.stage[p] != dag.stage[i]}
    if schedule.num_stages > 1:
        assert cross_stage, "a multi-stage schedule must have cross-stage edges"
    assert observed == cross_stage


def _group_size_of(schedule: PipelineSchedule) -> int:
    """microbatch_group_size_per_vp_stage that produced an interleaved schedule: the length of
    the first run of chunk-0 forwards on stage 0."""
    first_chunks = [c.chunk for c in schedule.orders[0] if c.kind is Kind.FORWARD]
    return next(k for k, chunk in enumerate(first_chunks) if chunk != 0)


# ----------------------------------------------------------------------------- PipelineDAG

DAG_SCHEDULES = (
    [one_f_one_b(S, M) for S, M in ONE_F_ONE_B_SIZES]
    + [interleaved(S, M, V) for S, M, V in INTERLEAVED_SIZES]
    + [interleaved(S, M, V, microbatch_group_size=G) for S, M, V, G in INTERLEAVED_GROUPED_SIZES]
)


def _expected_edges(schedule: PipelineSchedule) -> set[tuple[Computation, Computation]]:
    """Stage execution order plus data dependencies, derived independently of PipelineDAG."""
    edges = set()
    for order in schedule.orders:
        edges |= set(zip(order, order[1:]))
    num_virtual = schedule.num_virtual_stages

    def at(virtual_stage: int, microbatch: int, kind: Kind) -> Computation:
        return Computation(
            virtual_stage % schedule.num_stages,
            virtual_stage // schedule.num_stages,
            microbatch,
            kind,
        )

    for m in range(schedule.num_microbatches):
        for v in range(num_virtual - 1):
            edges.add((at(v, m, Kind.FORWARD), at(v + 1, m, Kind.FORWARD)))
            edges.add((at(v + 1, m, Kind.BACKWARD), at(v, m, Kind.BACKWARD)))
        last = num_virtual - 1
        edges.add((at(last, m, Kind.FORWARD), at(last, m, Kind.BACKWARD)))
    return edges


@pytest.mark.parametrize("schedule", DAG_SCHEDULES, ids=str)
def test_every_computation_runs_exactly_once(schedule: PipelineSchedule) -> None:
    S, M, V = schedule.num_stages, schedule.num_microbatches, schedule.num_chunks
    expected = {
        Computation(s, c, m, kind)
        for s in range(S)
        for c in range(V)
        for m in range(M)
        for kind in (Kind.FORWARD, Kind.BACKWARD)
    }
    executed = [c for order in schedule.orders for c in order]
    assert len(executed) == len(expected) == 2 * S * V * M
    assert set(executed) == expected
    for stage, order in enumerate(schedule.orders):
        assert all(c.stage == stage for c in order)
    dag = PipelineDAG(schedule)
    assert sorted(dag.computations) == sorted(expected)


@pytest.mark.parametrize("schedule", DAG_SCHEDULES, ids=str)
def test_dag_edges_and_topological_numbering(schedule: PipelineSchedule) -> None:
    dag = PipelineDAG(schedule)
    edges = {(dag.computations[p], dag.computations[i]) for p, i in dag.edges()}
    assert edges == _expected_edges(schedule)
    assert all(p < i for p, i in dag.edges()), "node numbering must be topological"
    graph = dag.to_networkx()
    assert nx.is_directed_acyclic_graph(graph)
    assert graph.number_of_nodes() == len(dag)
    # successor table mirrors the predecessor table
    succ_edges = {(i, int(s)) for i in range(len(dag)) for s in dag.successors(i)}
    assert succ_edges == set(dag.edges())
    for stage, positions in enumerate(dag.stage_positions):
        assert [dag.computations[i] for i in positions] == list(schedule.orders[stage])


def _networkx_longest_paths(dag: PipelineDAG, durations: np.ndarray) -> tuple[float, np.ndarray]:
    """Makespan and, per node, the longest path from the node to the end (node included)."""
    graph = nx.DiGraph()
    source = len(dag)
    for i, duration in enumerate(durations):
        graph.add_edge(source, i, weight=float(duration))
    for p, i in dag.edges():
        graph.add_edge(p, i, weight=float(durations[i]))
    makespan = nx.dag_longest_path_length(graph, weight="weight")
    tail = np.array(durations, dtype=float)
    for node in reversed(list(nx.topological_sort(graph))):
        if node == source:
            continue
        for succ in graph.successors(node):
            tail[node] = max(tail[node], durations[node] + tail[succ])
    return makespan, tail


@pytest.mark.parametrize("schedule", DAG_SCHEDULES[::3], ids=str)
def test_longest_path_matches_networkx(schedule: PipelineSchedule) -> None:
    dag = PipelineDAG(schedule)
    rng = np.random.default_rng(len(dag))
    plans = rng.uniform(0.5, 3.0, size=(len(dag), 4))
    makespans = dag.makespan(plans)
    for plan in range(plans.shape[1]):
        durations = plans[:, plan]
        expected, tail = _networkx_longest_paths(dag, durations)
        assert makespans[plan] == pytest.approx(expected)
        assert dag.makespan(durations) == pytest.approx(expected)
        deadline = expected * 1.1
        latest = dag.latest_finish_times(durations, deadline)
        np.testing.assert_allclose(latest, deadline - (tail - durations))
        earliest = dag.finish_times(durations)
        assert np.all(earliest <= latest + 1e-9)


def test_interleaved_dag_is_acyclic_for_many_sizes() -> None:
    """A deadlocking interleaved order would make the DAG cyclic; sweep sizes megatron runs."""
    rng = random.Random(0)
    sizes = [(S, k * S, V) for S in range(2, 7) for V in range(2, 5) for k in (1, 2, 3)]
    for S, M, V in rng.sample(sizes, 25):
        dag = PipelineDAG(interleaved(S, M, V))
        assert nx.is_directed_acyclic_graph(dag.to_networkx())
        assert len(dag) == 2 * S * M * V
