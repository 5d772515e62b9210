"""Straggler detection with hysteresis: how much slower than this pipeline the slowest one is.

Pipelines compare *normalised* compute times: a pipeline's measured compute time (before the
gradient all-reduce wait) scaled by `fastest.time / current_plan.time`, i.e. what it would take
at its fastest plan. A pipeline that slowed down on purpose therefore never looks like a straggler
itself, and a straggler's own ratio is 1, so it keeps the fastest plan.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SlowdownTracker:
    """Turns measured ratios into the slowdown factor a pipeline should plan for.

    threshold: a ratio must exceed 1 + threshold before a pipeline slows down at all.
    hysteresis: once slowed, the target only moves when the ratio changes by more than this
    (relative), and recovery happens below 1 + threshold - hysteresis, so plans do not flap.
    """

    threshold: float
    hysteresis: float
    factor: float = 1.0  # the slowdown currently planned for (1.0 = fastest plan)

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
        changed = target != self.factor
        self.factor = target
        return changed
