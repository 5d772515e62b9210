"""The runtime's per-rank profile read per virtual stage (`MeasuredProfile.for_schedule`).

Each rank measures its own computations; a schedule with several model chunks per rank is planned
from one entry per virtual stage, and that entry must be the measurements of the rank that holds
the virtual stage (the schedule's placement: looped for interleaved 1F1B, V-shaped for ZB-V and
DualPipeV). Ranks may keep different clocks (a clock whose energy a rank could not pin down is
left out of its profile), so a wrong mapping plans a rank at a clock it never measured.
"""

from __future__ import annotations

import pytest

from perseus_ext.planning.options import SolverOptions
from perseus_ext.planning.profile import Profile
from perseus_ext.planning.schedule import ScheduleKind, interleaved
from perseus_ext.runtime.records import MeasuredProfile, SolveProblem
from perseus_ext.runtime.solver_process import solve

CLOCKS_MHZ = (1410, 1200, 990, 780)
BLOCKING_W = 80.0


def _measured(kinds: list[str], clocks_of_rank: dict[int, tuple[int, ...]]) -> MeasuredProfile:
    """Rank r's computations take (1 + r) x a base time, so every entry says whose it is."""
    rows = []
    for rank, clocks in clocks_of_rank.items():
        for kind in kinds:
            for mhz in clocks:
                seconds = 0.005 * (1 + rank) * (1410 / mhz) ** 0.7
                rows.append({"stage": rank, "instruction": kind, "frequency": mhz, "time": seconds,
                             "energy": seconds * (80 + 250 * (mhz / 1410) ** 2)})
    return MeasuredProfile(Profile.from_rows(rows), BLOCKING_W, 1, "simulated")


def _torch_schedule(kind: ScheduleKind):
    pytest.importorskip("torch.distributed.pipelining.schedules")
    from perseus_ext.adapters.torch_pipelining_orders import torch_schedule

    return torch_schedule(kind, 2, 4, 2)


@pytest.mark.parametrize("shape", ["dualpipev", "zb-v", "interleaved"])
def test_every_virtual_stage_reads_the_rank_that_holds_it(shape: str) -> None:
    schedule = (interleaved(2, 4, 2) if shape == "interleaved"
                else _torch_schedule(ScheduleKind.DUALPIPE_V if shape == "dualpipev" else ScheduleKind.ZBV))
    kinds = sorted({c.kind.value for order in schedule.orders for c in order})
    measured = _measured(kinds, {0: CLOCKS_MHZ, 1: CLOCKS_MHZ[:3]})
    per_virtual = measured.for_schedule(schedule)
    assert per_virtual.num_stages == len(schedule.placement) == 4
    for virtual, (rank, _) in enumerate(schedule.placement):
        for kind in kinds:
            entry, own = per_virtual[virtual, kind], measured.profile[rank, kind]
            assert list(entry.frequencies) == list(own.frequencies) and list(entry.times) == list(own.times)


@pytest.mark.parametrize("kind", [ScheduleKind.DUALPIPE_V, ScheduleKind.ZBV])
def test_a_v_shaped_plan_runs_each_rank_at_clocks_it_measured(kind: ScheduleKind) -> None:
    """Rank 1 left 780 MHz out: no plan may give its computations 780 MHz (the deployed plan
    looks each computation's planned time up in the rank's own profile)."""
    schedule = _torch_schedule(kind)
    kinds = sorted({c.kind.value for order in schedule.orders for c in order})
    measured = _measured(kinds, {0: CLOCKS_MHZ, 1: CLOCKS_MHZ[:3]})
    result = solve(SolveProblem(schedule, measured, SolverOptions(max_clock_changes_per_s=0), 0.001))
    assert result.frontier is not None, result.error
    used: set[int] = set()
    for rank in range(2):
        table = result.for_stage(rank).table
        for plan in range(len(table.times)):
            for computation, mhz in zip(schedule.orders[rank], table.clocks(plan)):
                assert mhz in measured.profile[rank, computation.kind.value].frequencies, (rank, computation, mhz)
            if rank == 0:
                used.update(table.clocks(plan))
    assert 780 in used  # rank 0's slowest clock is planned: the check above had something to reject
