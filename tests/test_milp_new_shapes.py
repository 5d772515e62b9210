"""The frontier solver against the exact MILP on the graphs of the split-backward and combined schedules.

The orders come from the frameworks' own code: torch's ScheduleInterleavedZeroBubble (looped,
input/weight-gradient split), ScheduleZBVZeroBubble and ScheduleDualPipeV, built offline by
`torch_schedule` (DualPipeV's overlapped step as its forward and backward, as the torch adapter
records them, and as one combined unit, as `pipeline_order` lists it), and megatron-core's
combined_1f1b (`planning.schedule.combined_1f1b`, held equal to megatron-core's own order in
tests/test_planner_graph_frameworks.py). The profile is a three-clock slice of GPT-3 175B on
A100 with the kinds it lacks derived by `planning.derived`'s documented rule, at 4 pipeline
ranks x 8 microbatches, so that each MILP (over every clock of that profile) runs in seconds.

The issue's 0.1 % is a claim over every profiled clock: benchmarks/milp_new_shapes.py checks it
at 4 and 8 ranks x 8 and 16 microbatches (its table is in docs/solver.md). On a three-clock
slice the discrete steps are coarse and the frontier's rounding leaves up to ~0.25 % on the
zero-bubble graphs at 4 ranks; these tests hold it to `TOLERANCE` there.
"""

from __future__ import annotations

import importlib
import warnings

import pytest

from perseus_ext.adapters.torch_pipelining_actions import RankLayout
from perseus_ext.adapters.torch_pipelining_orders import TORCH_SCHEDULES, _OrderOnlyStage, torch_schedule
from perseus_ext.planning.derived import DerivationRule, derive_kinds
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.exact import exact_solve
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import (
    Computation,
    Kind,
    PipelineSchedule,
    ScheduleKind,
    combined,
    combined_1f1b,
    schedule_from_actions,
)
from perseus_ext.planning.solver import solve_frontier
from perseus_ext.planning.options import SolverOptions
from tests.planning_profiles import P_BLOCK_A100, profile_path, sub_profile

NO_BUDGET = SolverOptions(max_clock_changes_per_s=0)  # the MILP has no clock-change budget either

pytest.importorskip("torch.distributed.pipelining.schedules")

CLOCKS = (1410, 1200, 990)  # three of the profile's clocks: a MILP HiGHS nearly closes in seconds
FACTORS = (1.00, 1.05, 1.10)
TOLERANCE = 3e-3  # against the MILP's plan, on three clocks (module docstring)
# HiGHS does not prove every one of these MILPs optimal within seconds (the split backward's W
# computations can sit in many places of equal cost). It stops at the time limit with its best
# plan and a proven lower bound: the solver must be within `TOLERANCE` of that plan, and the
# bound close enough (`MILP_GAP`) that this is a statement about the optimum.
MILP_TIME_LIMIT_S, MILP_GAP = 4.0, 5e-3


def _dualpipe_units(ranks: int, microbatches: int) -> PipelineSchedule:
    """torch's DualPipeV order with each OVERLAP_F_B action as one combined unit of its two
    parts (the order `pipeline_order` lists), from the class itself."""
    schedules = importlib.import_module("torch.distributed.pipelining.schedules")
    mapping = importlib.import_module("torch.distributed.pipelining._utils").generate_stage_to_rank_mapping
    spec = TORCH_SCHEDULES[ScheduleKind.DUALPIPE_V]
    num_stages = 2 * ranks
    rank_of = mapping(ranks, num_stages, style=spec.style)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = getattr(schedules, spec.class_name)(
            [_OrderOnlyStage(i, num_stages, ranks) for i in range(num_stages) if rank_of[i] == 0], microbatches)
    layout = RankLayout.from_indices([[i for i in range(num_stages) if rank_of[i] == r] for r in range(ranks)])

    def one(action) -> Computation:
        rank, chunk = layout.locate(action.stage_index)
        return Computation(rank, chunk, action.microbatch_index, _KINDS[action.computation_type.value])

    orders = []
    for rank in range(ranks):
        order = []
        for action in built.pipeline_order[rank]:
            if action is None:
                continue
            if action.computation_type.value == "OVERLAP_F_B":
                order.append(combined(*(one(part) for part in action.sub_actions)))
            else:
                order.append(one(action))
        orders.append(order)
    return schedule_from_actions(orders, layout.placement, ScheduleKind.DUALPIPE_V)


_KINDS = {"F": Kind.FORWARD, "B": Kind.BACKWARD, "I": Kind.INPUT_GRADIENT, "W": Kind.WEIGHT_GRADIENT}


def _schedule(shape: str, ranks: int, microbatches: int) -> PipelineSchedule:
    if shape == "combined_1f1b":
        return combined_1f1b(ranks, microbatches, 2)
    if shape == "dualpipev-units":
        return _dualpipe_units(ranks, microbatches)
    kinds = {"zero-bubble": ScheduleKind.ZERO_BUBBLE, "zb-v": ScheduleKind.ZBV, "dualpipev": ScheduleKind.DUALPIPE_V}
    return torch_schedule(kinds[shape], ranks, microbatches, 2)


def _worst_excess(schedule: PipelineSchedule) -> float:
    """The frontier's worst excess energy over the MILP's plan (every clock of the profile) at
    1.00, 1.05 and 1.10 x the all-max-clock time."""
    raw = sub_profile(load_profile(profile_path("gpt3-175b-a100_sxm")), schedule.num_stages, CLOCKS)
    profile = derive_kinds(raw, DerivationRule(overlap_share=0.2))
    model = CostModel(schedule, profile, P_BLOCK_A100)
    assert int(model.num_options.min()) == len(CLOCKS)  # the MILP sees every clock of the profile
    frontier = solve_frontier(schedule, profile, P_BLOCK_A100, NO_BUDGET)
    t_fast = float(model.replay(model.fastest_choice())[0])
    assert frontier.fastest.time == pytest.approx(t_fast, rel=1e-9)
    worst = -1.0
    for factor in FACTORS:
        exact = exact_solve(model, t_fast * factor, rel_gap=1e-6, time_limit_s=MILP_TIME_LIMIT_S)
        assert exact is not None and exact.gap <= MILP_GAP, f"MILP at {factor} x T: gap {exact.gap:.2e}"
        at = max(t_fast * factor, float(model.replay(exact.choice)[0]))  # HiGHS' feasibility tolerance
        worst = max(worst, frontier.plan_for_deadline(at).energy / exact.energy - 1.0)
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["zero-bubble", "zb-v", "dualpipev", "dualpipev-units", "combined_1f1b"])
def test_solver_against_the_milp_at_4_ranks_8_microbatches(shape: str) -> None:
    schedule = _schedule(shape, 4, 8)
    kinds = {c.kind for order in schedule.orders for c in order}
    new_kind = Kind.COMBINED if shape in ("dualpipev-units", "combined_1f1b") else Kind.WEIGHT_GRADIENT
    assert new_kind in kinds, kinds  # the graph has the new node kind
    worst = _worst_excess(schedule)
    assert worst <= TOLERANCE, f"{shape}: {100 * worst:.3f} % above the MILP's plan"
