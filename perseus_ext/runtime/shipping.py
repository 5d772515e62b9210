"""What each rank receives of its pipeline's frontier.

The pipeline leader solves and keeps the whole frontier. Every other rank needs every plan's
time and energy (its policy chooses by them, and reports them) but the clocks of its own stage
only: consecutive plans differ in few computations, so those go as changes from plan to plan
in a `StagePlanTable` (the type the leader deploys its own stage from too), inside the rank's
`StageSolve` view of the solve's result. The leader scatters one such view per rank instead of
broadcasting every stage's clock table to everyone -- at 8 stages x 96 microbatches, ~0.14 MB
per rank instead of ~12 MB.
"""

from __future__ import annotations

import pickle

from perseus_ext.runtime.comm import Member
from perseus_ext.runtime.records import SolveResult, StageSolve


def ship(result: SolveResult, members: list[Member]) -> dict[int, StageSolve]:
    """The shipment of each pipeline member, by global rank: its stage's view of `result`."""
    return {member.rank: result.for_stage(member.stage) for member in members}


def shipped_bytes(shipment: StageSolve) -> int:
    """What one rank receives (pickled, as gloo sends it)."""
    return len(pickle.dumps(shipment))
