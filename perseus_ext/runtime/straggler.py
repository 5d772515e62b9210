"""Straggler detection with hysteresis: how much longer than this pipeline the slowest one takes.

Pipelines compare *normalised* compute times: a pipeline's measured compute time (before the
gradient all-reduce wait) minus the extra model time of the plan it runs (`plan.time -
fastest.time`), i.e. what it would take at its fastest plan. Subtracting (rather than scaling)
matches how plans change an iteration: they lengthen the computations, while communication and
optimizer overheads stay the same. A pipeline that slowed down on purpose therefore never looks
like a straggler itself, and the straggler's own ratio is 1, so it keeps the fastest plan.
The ratio fed to the tracker is 1 + (straggler time - own time) / fastest plan time: the factor by
which this pipeline's plan may be longer than the fastest plan without slowing the job.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SlowdownTracker:
    """Turns measured ratios into the slowdown factor a pipeline should plan for.

    threshold: a ratio must exceed 1 + threshold before a pipeline slows down at all.
    hysteresis: once slowed, the target only moves when the ratio changes by more than this
    (relative), and recovery happens below 1 + threshold - hysteresis, so plans do not flap.
    confirmations: how many checks in a row must ask for a slower plan before it happens, so a
    transient hiccup (a slow checkpoint write, a noisy neighbour) slows nothing down. Moves to
    a faster plan happen at once: lagging there would slow the whole job.
    """

    threshold: float
    hysteresis: float
    confirmations: int = 1
    factor: float = 1.0  # the slowdown currently planned for (1.0 = fastest plan)
    _pending: int = 0

    def update(self, ratio: float) -> bool:
        """Feed the latest straggler ratio; True when `factor` changed."""
        slowed = self.factor > 1.0
        if not slowed:
            target = ratio if ratio >= 1.0 + self.threshold else 1.0
        elif ratio < 1.0 + self.threshold - self.hysteresis:
            target = 1.0
        elif abs(ratio / self.factor - 1.0) > self.hysteresis:
            target = ratio
        else:
            target = self.factor
        if target == self.factor:
            self._pending = 0
            return False
        self._pending += 1
        if target > self.factor and self._pending < self.confirmations:
            return False
        self._pending = 0
        self.factor = target
        return True
