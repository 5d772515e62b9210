"""How late the controller's worker issues clock changes, so the sequencer can issue earlier.

A change tied to a device marker is due when the device reaches the marker plus a planned delay.
The worker notices the marker only after a polling interval or a thread wake-up, and it shares
the interpreter lock with the training thread, so on a busy host every change goes out some
milliseconds late -- and lands that late on the computation it was planned for. The typical
lateness of recent changes is measured here; `ClockSequencer` issues that much earlier.
"""

from __future__ import annotations

import collections

SAMPLES = 32  # recent changes the typical lateness is taken over
UPDATE_EVERY = 8  # changes between updates of the median (the worker shares the GIL with training)
MAX_DELAY_S = 0.1  # a lateness beyond this is a stall, not something to plan around


class IssueDelay:
    """The median lateness of the worker's recent marker-tied clock changes, seconds."""

    def __init__(self) -> None:
        self._late_s: collections.deque[float] = collections.deque(maxlen=SAMPLES)
        self._recorded = 0
        self.typical_s = 0.0  # read by the training thread: a float swap, no lock needed

    def record(self, late_s: float) -> None:
        """Worker thread: one change went out `late_s` after it was due."""
        self._late_s.append(min(max(late_s, 0.0), MAX_DELAY_S))
        self._recorded += 1
        if self._recorded <= UPDATE_EVERY or self._recorded % UPDATE_EVERY == 0:
            ordered = sorted(self._late_s)
            self.typical_s = ordered[len(ordered) // 2]
