"""What each rank receives of its pipeline's frontier.

The pipeline leader solves and keeps the whole frontier. Every other rank needs every plan's
time and energy (its policy chooses by them, and reports them) but the clocks of its own stage
only: consecutive plans differ in few computations, so those go as changes from plan to plan
(`Frontier.to_compact`). The leader scatters one such shipment per rank instead of broadcasting
every stage's clock table to everyone -- at 8 stages x 96 microbatches, ~0.14 MB per rank
instead of ~12 MB.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import numpy as np

from perseus_ext.planning.frontier import Frontier, Plan, compact_stage_clocks
from perseus_ext.runtime.comm import Member
from perseus_ext.runtime.records import MeasuredProfile, SolveOutcome


@dataclass(frozen=True)
class StageFrontier:
    """One rank's share of the solve outcome."""

    stage: int
    compact: dict | None  # Frontier.to_compact(stages=[stage]); None when there is no frontier
    error: str | None
    solve_s: float
    in_background: bool
    measured: MeasuredProfile | None

    def frontier(self) -> Frontier:
        """Every plan's time and energy; no stage's clocks (read them with `stage_clocks`)."""
        data = self.compact
        no_clocks = np.zeros((data["num_stages"], 0), dtype=np.int32)
        no_clocks.flags.writeable = False
        return Frontier(
            schedule=data["schedule"], blocking_power=float(data["blocking_power"]),
            plans=tuple(Plan(float(t), float(e), no_clocks) for t, e in zip(data["times"], data["energies"])),
            baseline=Plan(float(data["baseline"][0]), float(data["baseline"][1]), no_clocks),
            extension_start=data.get("extension_start"),
        )

    def stage_clocks(self) -> np.ndarray:
        """(plans, computations) clocks of this rank's stage."""
        return compact_stage_clocks(self.compact, self.stage)


def ship(outcome: SolveOutcome, members: list[Member]) -> dict[int, StageFrontier]:
    """The shipment of each pipeline member, by global rank."""
    frontier = outcome.frontier
    shipments = {}
    for member in members:
        compact = None
        if frontier is not None:
            compact = frontier.to_compact(stages=[member.stage])
            compact["num_stages"] = len(frontier.baseline.frequencies)
        shipments[member.rank] = StageFrontier(member.stage, compact, outcome.error, outcome.solve_s,
                                               outcome.in_background, outcome.measured)
    return shipments


def shipped_bytes(shipment: StageFrontier) -> int:
    """What one rank receives (pickled, as gloo sends it)."""
    return len(pickle.dumps(shipment))
