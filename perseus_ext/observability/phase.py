"""The runtime's phases: the vocabulary of everything a rank publishes (its iteration records,
log rows, metrics, summary), so it lives beside them, below the runtime; the runtime, the
log reader and the exporters all name the phases from this one enum."""

from __future__ import annotations

import enum
from typing import Literal


class Phase(str, enum.Enum):
    """Where one rank's lifecycle stands; every rank of a job changes phase at the same iteration."""

    WARMUP = "warmup"  # default clocks before profiling
    PROFILING = "profiling"  # whole iterations at one candidate clock each
    SOLVING = "solving"  # default clocks while the frontier is solved off the training thread
    DEPLOYED = "deployed"  # a frontier plan's clocks on every computation
    POWER_LIMIT = "power_limit"  # policy.mode power_limit: profiling, then holding one GPU power limit
    OBSERVING = "observing"  # default clocks for the rest of the run (observe mode or fallback)

    @property
    def at_default_clocks(self) -> bool:
        """Whether this phase runs the driver's default clocks (what savings are measured against)."""
        return self in (Phase.WARMUP, Phase.SOLVING, Phase.OBSERVING)


# The phases' names as a Literal, derived from the enum so a log row's type can never fall out of
# step with it (a new phase is a new literal without touching the row model).
PhaseName = Literal[tuple(phase.value for phase in Phase)]  # type: ignore[valid-type]
