"""What each rank receives of its pipeline's frontier.

The pipeline leader solves and keeps the whole frontier. Every other rank needs every plan's
time and energy (its policy chooses by them, and reports them) but the clocks of its own stage
only: consecutive plans differ in few computations, so those go as changes from plan to plan
in a `StagePlanTable` (the type the leader deploys its own stage from too). The leader scatters
one such shipment per rank instead of broadcasting every stage's clock table to everyone -- at
8 stages x 96 microbatches, ~0.14 MB per rank instead of ~12 MB.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from perseus_ext.planning.frontier import StagePlanTable
from perseus_ext.runtime.comm import Member
from perseus_ext.runtime.records import MeasuredProfile, SolveOutcome


@dataclass(frozen=True)
class StageFrontier:
    """One rank's share of the solve outcome."""

    stage: int
    table: StagePlanTable | None  # this stage's plan table; None when there is no frontier
    error: str | None
    solve_s: float
    in_background: bool
    measured: MeasuredProfile | None


def ship(outcome: SolveOutcome, members: list[Member]) -> dict[int, StageFrontier]:
    """The shipment of each pipeline member, by global rank."""
    frontier = outcome.frontier
    return {
        member.rank: StageFrontier(member.stage, None if frontier is None else frontier.stage_table(member.stage),
                                   outcome.error, outcome.solve_s, outcome.in_background, outcome.measured)
        for member in members
    }


def shipped_bytes(shipment: StageFrontier) -> int:
    """What one rank receives (pickled, as gloo sends it)."""
    return len(pickle.dumps(shipment))
