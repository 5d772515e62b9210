"""The planner graph built from the action lists real framework schedules execute.

torch.distributed.pipelining's schedules (Schedule1F1B, ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV) and megatron-core's
combined_1f1b order decide the actions here; the tests convert them to planning's action type
(`Computation`), build the graph, and check it against an oracle written from torch's own
action semantics (stage indices, not planning's placement or dependency code): the graph is
acyclic, every dependency the actions imply is a path in it, every edge it adds is one of them
or the stage order, and its longest path equals networkx's. The frontier solver on these graphs
is then held to the exact MILP over every profiled clock.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import networkx as nx
import numpy as np
import pytest

from perseus_ext.errors import ScheduleError
from perseus_ext.planning.dag import PipelineDAG
from perseus_ext.planning.derived import derive_kinds
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.exact import exact_solve
from perseus_ext.planning.profile import Profile, load_profile
from perseus_ext.planning.schedule import (
    Computation,
    Kind,
    combined,
    combined_1f1b,
    one_f_one_b,
    schedule_from_actions,
)
from perseus_ext.planning.solver import SolverOptions, solve_frontier
from tests.planning_profiles import P_BLOCK_A100, profile_path, sub_profile

# The per-computation solver on its own: no clock-change budget (tests/test_clock_budget.py has it).
UNBUDGETED = SolverOptions(max_clock_changes_per_s=0)

pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")

CLOCKS = tuple(range(1410, 1000, -75))

# ------------------------------------------------------------------ torch's schedules, offline


class _Stage:
    """What a torch schedule reads of a pipeline stage when it builds its order, and the entry
    points its `_step_microbatches` calls (recorded; no tensors, no process group)."""

    def __init__(self, index: int, num_stages: int, group_size: int, group_rank: int):
        self.stage_index, self.num_stages = index, num_stages
        self.group_size, self.group_rank = group_size, group_rank
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.stage_index_to_group_rank = None
        self.submod = None  # DualPipeV looks for torch.compile'd modules
        self.ran: list[tuple[str, int]] = []

    def get_fwd_recv_ops(self, mb):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.ran.append(("F", mb))

    def backward_one_chunk(self, mb, *args, **kwargs):
        self.ran.append(("B", mb))

    def perform_reduce_grad(self, *args, **kwargs):
        self.ran.append(("REDUCE_GRAD", 0))


MULTI_STAGE = {
    "ScheduleInterleaved1F1B": "loop",
    "ScheduleInterleavedZeroBubble": "loop",
    "ScheduleZBVZeroBubble": "v",
    "ScheduleDualPipeV": "v",
}


_COMPUTE = ("F", "B", "I", "W", "OVERLAP_F_B", "REDUCE_GRAD")


def torch_pipeline_order(name: str, num_ranks: int, microbatches: int) -> tuple[dict, dict[int, int]]:
    """(the computations each rank runs, stage index -> rank) of a two-chunks-per-rank torch
    schedule: the compute actions of the lowered order its runtime executes
    (`pipeline_order_with_comms`: `pipeline_order` with the gradient syncs and communication
    added), checked to be `pipeline_order`'s computations in the same order."""
    cls = getattr(pipelining, name)
    style = MULTI_STAGE[name]
    num_stages = 2 * num_ranks
    rank_of = pipelining.generate_stage_to_rank_mapping(num_ranks, num_stages, style=style)
    local = [i for i in range(num_stages) if rank_of[i] == 0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        schedule = cls([_Stage(i, num_stages, num_ranks, 0) for i in local], microbatches)
    executed = {
        rank: [a for a in actions if a.computation_type.value in _COMPUTE]
        for rank, actions in schedule.pipeline_order_with_comms.items()
    }
    for rank, actions in schedule.pipeline_order.items():
        listed = [a for a in actions if a is not None]
        assert [a for a in executed[rank] if a.computation_type.value != "REDUCE_GRAD"] == listed
    return executed, rank_of


_KINDS = {"F": Kind.FORWARD, "B": Kind.BACKWARD, "I": Kind.INPUT_GRADIENT, "W": Kind.WEIGHT_GRADIENT,
          "REDUCE_GRAD": Kind.REDUCE_GRAD}


def convert(pipeline_order: dict, rank_of: dict[int, int]):
    """torch actions -> (planning orders, placement): a stage's chunk is its stage indices'
    rank in increasing order; idle steps (None) are dropped."""
    held = {}
    for index in sorted(rank_of):
        held.setdefault(rank_of[index], []).append(index)
    chunk_of = {index: held[rank].index(index) for rank in held for index in held[rank]}

    def one(rank: int, action) -> Computation:
        kind = _KINDS[action.computation_type.value]
        microbatch = 0 if action.microbatch_index is None else action.microbatch_index
        return Computation(rank, chunk_of[action.stage_index], microbatch, kind)

    orders = []
    for rank in sorted(pipeline_order):
        order = []
        for action in pipeline_order[rank]:
            if action is None:
                continue
            if action.computation_type.value == "OVERLAP_F_B":
                order.append(combined(*(one(rank, part) for part in action.sub_actions)))
            else:
                order.append(one(rank, action))
        orders.append(order)
    placement = [(rank_of[v], chunk_of[v]) for v in sorted(rank_of)]
    return orders, placement


# ------------------------------------------------------------------ megatron's combined_1f1b


def megatron_combined_order(num_stages: int, microbatches: int, chunks: int) -> list[list[Computation]]:
    """The combined_1f1b order megatron-core's interleaved schedule runs with
    `overlap_moe_expert_parallel_comm`: its own warm-up count (one extra microbatch) and its
    own (microbatch, chunk) table; steady steps pair forward k + warm-up with backward k."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

    table = get_schedule_table(microbatches, chunks, num_stages)
    orders = []
    for rank in range(num_stages):
        p2p = SimpleNamespace(
            pp_group=SimpleNamespace(size=lambda: num_stages, rank=lambda r=rank: r),
            virtual_pipeline_model_parallel_size=chunks,
        )
        total, _, warmup, remaining = get_pp_rank_microbatches(
            microbatches, chunks, num_stages, overlap_moe_expert_parallel_comm=True, p2p_communicator=p2p)

        def forward(k: int, rank: int = rank) -> Computation:
            return Computation(rank, table[k][1], table[k][0], Kind.FORWARD)

        def backward(k: int, rank: int = rank) -> Computation:
            return Computation(rank, chunks - 1 - table[k][1], table[k][0], Kind.BACKWARD)

        order = [forward(k) for k in range(warmup)]
        order += [combined(forward(k + warmup), backward(k)) for k in range(remaining)]
        order += [backward(k) for k in range(remaining, total)]
        orders.append(order)
    return orders


# ------------------------------------------------------------------ the oracle


def implied_dependencies(orders: list[list[Computation]], placement) -> list[tuple[Computation, Computation]]:
    """(needed, needer) between single computations, from torch's action semantics: stage index
    i = the placement's position; F(i) after F(i - 1); B/I(i) after F(i) and after B/I(i + 1)
    (the last stage after its loss, its own forward); W(i) after I(i); a gradient sync after
    every B/W of its stage index. Written without planning's dependency code."""
    index_of = {where: i for i, where in enumerate(placement)}
    last = len(placement) - 1
    units = [u for order in orders for a in order for u in (a.parts or (a,))]
    present = set(units)
    deps = []
    for u in units:
        i = index_of[u.stage, u.chunk]
        here = lambda index, kind, m=u.microbatch: Computation(*placement[index], m, kind)  # noqa: E731
        if u.kind is Kind.FORWARD and i > 0:
            deps.append((here(i - 1, Kind.FORWARD), u))
        elif u.kind in (Kind.BACKWARD, Kind.INPUT_GRADIENT):
            deps.append((here(i, Kind.FORWARD), u))
            if i < last:
                grad = here(i + 1, Kind.INPUT_GRADIENT)
                deps.append((grad if grad in present else here(i + 1, Kind.BACKWARD), u))
        elif u.kind is Kind.WEIGHT_GRADIENT:
            deps.append((here(i, Kind.INPUT_GRADIENT), u))
        elif u.kind is Kind.REDUCE_GRAD:
            deps += [(w, u) for w in units if w.kind in (Kind.BACKWARD, Kind.WEIGHT_GRADIENT)
                     and (w.stage, w.chunk) == (u.stage, u.chunk)]
    return deps


def check_graph(orders: list[list[Computation]], placement) -> PipelineDAG:
    schedule = schedule_from_actions(orders, placement)
    dag = PipelineDAG(schedule)
    node_of = {}
    for node, action in enumerate(dag.computations):
        for unit in action.parts or (action,):
            node_of[unit] = node
    oracle = nx.DiGraph()
    oracle.add_nodes_from(range(len(dag)))
    for order in orders:
        oracle.add_edges_from((dag.index[a], dag.index[b]) for a, b in zip(order, order[1:]))
    deps = implied_dependencies(orders, placement)
    assert deps, "a schedule implies dependencies"
    oracle.add_edges_from((node_of[a], node_of[b]) for a, b in deps if node_of[a] != node_of[b])
    assert nx.is_directed_acyclic_graph(oracle)

    graph = dag.to_networkx()
    assert nx.is_directed_acyclic_graph(graph)
    assert all(p < i for p, i in dag.edges()), "node numbering must be topological"
    closure = nx.transitive_closure_dag(graph)
    missing = [(dag.computations[a], dag.computations[b]) for a, b in oracle.edges if not closure.has_edge(a, b)]
    assert not missing, f"dependencies the graph does not respect: {missing[:5]}"
    extra = [(dag.computations[a], dag.computations[b]) for a, b in graph.edges if not oracle.has_edge(a, b)]
    assert not extra, f"edges no dependency asks for: {extra[:5]}"

    rng = np.random.default_rng(len(dag))
    durations = rng.uniform(0.5, 2.0, len(dag))
    weighted = nx.DiGraph()
    weighted.add_edges_from((a, b, {"w": durations[b]}) for a, b in graph.edges)
    weighted.add_edges_from(("start", b, {"w": durations[b]}) for b in range(len(dag)))
    longest = nx.dag_longest_path_length(weighted, weight="w")
    assert dag.makespan(durations) == pytest.approx(longest, rel=1e-12)
    return dag


TORCH_SIZES = [(2, 4), (4, 8)]


@pytest.mark.parametrize("name", sorted(MULTI_STAGE))
@pytest.mark.parametrize("ranks, microbatches", TORCH_SIZES)
def test_torch_schedule_graphs_respect_every_dependency(name: str, ranks: int, microbatches: int) -> None:
    order, rank_of = torch_pipeline_order(name, ranks, microbatches)
    orders, placement = convert(order, rank_of)
    dag = check_graph(orders, placement)
    kinds = {c.kind for c in dag.computations}
    assert sum(c.kind is Kind.REDUCE_GRAD for c in dag.computations) == 2 * ranks
    if name in ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"):
        assert {Kind.INPUT_GRADIENT, Kind.WEIGHT_GRADIENT} <= kinds
    if name == "ScheduleDualPipeV":
        assert Kind.COMBINED in kinds
    if MULTI_STAGE[name] == "v":
        assert placement[ranks - 1][0] == placement[ranks][0] == ranks - 1  # the V's turn


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (3, 3), (4, 8)])
def test_torch_schedule1f1b_runs_the_planner_s_1f1b(stages: int, microbatches: int) -> None:
    """Schedule1F1B's executed order (its own `_step_microbatches`, recorded per rank) is the
    planner's 1F1B plus the gradient sync; its graph passes the oracle."""
    orders = []
    for rank in range(stages):
        stage = _Stage(rank, stages, stages, rank)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            schedule = pipelining.Schedule1F1B(stage, microbatches)
        schedule._initialize_stage = lambda *args, **kwargs: None
        schedule._step_microbatches([()] * microbatches, [{}] * microbatches, None, None, return_outputs=False)
        orders.append([Computation(rank, 0, m, _KINDS[k]) for k, m in stage.ran])
    planned = one_f_one_b(stages, microbatches).orders
    assert [order[:-1] for order in orders] == [list(o) for o in planned]
    assert all(order[-1].kind is Kind.REDUCE_GRAD for order in orders)
    check_graph(orders, [(s, 0) for s in range(stages)])


def test_schedule1f1b_pipeline_order_is_not_what_it_runs() -> None:
    """Schedule1F1B's `pipeline_order` (a picture of the schedule) numbers the last rank's
    forwards from 1, unlike what it executes: a graph built from it is refused by name."""
    stage = _Stage(0, 2, 2, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        order = pipelining.Schedule1F1B(stage, 4).pipeline_order
    orders, placement = convert(order, {0: 0, 1: 1})
    with pytest.raises(ScheduleError, match="B0@s1 needs F0@s1, which no stage of the schedule runs"):
        schedule_from_actions(orders, placement)


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (2, 8), (4, 8), (4, 12)])
def test_megatron_combined_order_is_the_planner_s_and_its_graph_passes(stages: int, microbatches: int) -> None:
    pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    orders = megatron_combined_order(stages, microbatches, 2)
    planned = combined_1f1b(stages, microbatches, 2)
    assert [list(o) for o in planned.orders] == orders
    dag = check_graph(orders, planned.placement)
    assert sum(c.kind is Kind.COMBINED for c in dag.computations) > 0


def test_bad_action_lists_are_refused_by_name() -> None:
    forward = [Computation(0, 0, 0, Kind.FORWARD), Computation(1, 0, 0, Kind.FORWARD)]
    backward = [Computation(0, 0, 0, Kind.BACKWARD), Computation(1, 0, 0, Kind.BACKWARD)]
    with pytest.raises(ScheduleError, match="before F0@s1"):
        schedule_from_actions([[forward[0], backward[0]], [backward[1], forward[1]]])
    with pytest.raises(ScheduleError, match="B0@s1 needs F0@s1, which no stage of the schedule runs"):
        schedule_from_actions([[forward[0], backward[0]], [Computation(1, 0, 0, Kind.BACKWARD)]])
    with pytest.raises(ScheduleError, match="no stage runs the forward of microbatch 1 on virtual stage 0"):
        schedule_from_actions([[forward[0], backward[0]], [
            forward[1], backward[1], Computation(1, 0, 1, Kind.FORWARD), Computation(1, 0, 1, Kind.BACKWARD)]])
    f, b = (lambda s, m: Computation(s, 0, m, Kind.FORWARD)), (lambda s, m: Computation(s, 0, m, Kind.BACKWARD))
    crossed = [[f(0, 0), b(0, 0), f(0, 1), b(0, 1)], [f(1, 1), b(1, 1), f(1, 0), b(1, 0)]]
    with pytest.raises(ScheduleError, match="deadlocks"):
        PipelineDAG(schedule_from_actions(crossed))
    with pytest.raises(ScheduleError, match="input-gradient computation but no weight-gradient"):
        schedule_from_actions([[Computation(0, 0, 0, Kind.FORWARD), Computation(0, 0, 0, Kind.INPUT_GRADIENT)]])
    with pytest.raises(ScheduleError, match="syncs gradients"):
        schedule_from_actions([[Computation(0, 0, 0, Kind.FORWARD), Computation(0, 0, 0, Kind.REDUCE_GRAD),
                                Computation(0, 0, 0, Kind.BACKWARD)]])


# ------------------------------------------------------------------ solver against the MILP


@pytest.fixture(scope="module")
def stage_profiles() -> dict[int, Profile]:
    raw = load_profile(profile_path("gpt3-175b-a100_sxm"))
    profiles = {}
    for stages in (2,):
        base = derive_kinds(sub_profile(raw, stages, CLOCKS))
        rows = base.rows()
        rows += [dict(r, instruction="reduce_grad", time=r["time"] * 0.3, energy=r["energy"] * 0.25)
                 for r in rows if r["instruction"] == "forward"]
        profiles[stages] = Profile.from_rows(rows, source=f"gpt3 {stages} stages, derived kinds")
    return profiles


def _solver_against_milp(orders, placement, profile: Profile) -> float:
    """The frontier's worst excess energy over the MILP's plan (every profiled clock) at 1.00,
    1.05 and 1.10 x the all-max-clock time. HiGHS proves the small cases optimal; on the larger
    it stops at `MILP_TIME_LIMIT_S` with its best plan, which is then the yardstick (its
    bound is within `MILP_GAP` of it, so the frontier is within 0.1 % + that of the optimum)."""
    schedule = schedule_from_actions(orders, placement)
    model = CostModel(schedule, profile, P_BLOCK_A100)  # every profiled clock
    frontier = solve_frontier(schedule, profile, P_BLOCK_A100, UNBUDGETED)
    t_fast = float(model.replay(model.fastest_choice())[0])
    assert frontier.fastest.time == pytest.approx(t_fast, rel=1e-9)
    worst = -1.0
    for factor in (1.00, 1.05, 1.10):
        deadline = t_fast * factor
        exact = exact_solve(model, deadline, rel_gap=1e-6, time_limit_s=MILP_TIME_LIMIT_S)
        assert exact is not None and exact.gap <= MILP_GAP, f"MILP gap {exact.gap:.2e}"
        at = max(deadline, float(model.replay(exact.choice)[0]))  # HiGHS' feasibility tolerance
        worst = max(worst, frontier.plan_for_deadline(at).energy / exact.energy - 1)
    return worst


MILP_TIME_LIMIT_S, MILP_GAP = 20.0, 2e-3
MILP_SIZES = [(2, 4), (2, 8)]  # (ranks, microbatches): 35 to 100 computations, 6 clocks each
# Every torch schedule class at 2 ranks x 4 microbatches, and DualPipeV, whose MILP HiGHS solves
# in seconds, at 8 as well. At 6 or 8 microbatches the interleaved and zero-bubble graphs keep the
# MILP busy for 20 to 60 s a graph on two cores, at some deadlines up to its time limit, where it
# yields its best plan rather than the optimum (tests/test_milp_new_shapes.py holds the
# zero-bubble graphs at 4 ranks x 8 microbatches to the MILP on a three-clock profile).
TORCH_MILP_CASES = [(2, 4, name) for name in sorted(MULTI_STAGE)] + [(2, 8, "ScheduleDualPipeV")]


@pytest.mark.slow
@pytest.mark.parametrize("ranks, microbatches, name", TORCH_MILP_CASES)
def test_solver_within_0_1_percent_of_the_milp_on_torch_graphs(stage_profiles, name, ranks, microbatches) -> None:
    order, rank_of = torch_pipeline_order(name, ranks, microbatches)
    orders, placement = convert(order, rank_of)
    worst = _solver_against_milp(orders, placement, stage_profiles[ranks])
    assert worst <= 1e-3, f"{100 * worst:.3f}% above the exact optimum"


@pytest.mark.slow
@pytest.mark.parametrize("stages, microbatches", MILP_SIZES)
def test_solver_within_0_1_percent_of_the_milp_on_combined_1f1b(stage_profiles, stages, microbatches) -> None:
    pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    orders = megatron_combined_order(stages, microbatches, 2)
    worst = _solver_against_milp(orders, combined_1f1b(stages, microbatches, 2).placement, stage_profiles[stages])
    assert worst <= 1e-3, f"{100 * worst:.3f}% above the exact optimum"
