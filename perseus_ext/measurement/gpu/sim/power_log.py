"""The simulated device's power as it drew it, read back as fine samples.

Why: a power swing (peak to trough within an iteration, the ramp of a 50 ms moving average) can
only be measured from samples much finer than an iteration. A real GPU's default power reading
is averaged over a second on H100/H200 (docs/monitoring.md), so perseus-ext measures swings where
it can do so honestly: on the simulated device, whose power is exactly known. The device integrates a
piecewise-constant power (compute power at the effective clock, idle power otherwise); this log
keeps those pieces for the recent past and answers the mean power over each bin of a grid
anchored at device time 0 (bin b spans [b p, (b + 1) p)), so the bins of different ranks' devices
line up and sum into the job's power without resampling.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right

import numpy as np

KEEP_S = 120.0  # device seconds of history kept: records arrive about an iteration late
MAX_PIECES = 400_000  # a bound whatever the iteration length (a piece is three floats)
EDGE_SLACK_S = 1e-9  # a bin edge computed as b * period may pass the device's position by rounding


class PowerLog:
    """Contiguous pieces (start, end, watts) of one device's power, the latest `keep_s` seconds.

    Three lists and a head index, so a read bisects to the pieces it needs instead of copying
    the whole history (reads run under the device's lock, on a paced device in real time)."""

    def __init__(self, keep_s: float = KEEP_S, max_pieces: int = MAX_PIECES) -> None:
        self.keep_s = keep_s
        self.max_pieces = max_pieces
        self._starts: list[float] = []
        self._ends: list[float] = []
        self._watts: list[float] = []
        self._head = 0  # pieces before it are forgotten

    def add(self, start: float, end: float, watts: float) -> None:
        """The device drew `watts` over [start, end) (called in time order, pieces touching)."""
        if end <= start:
            return
        if len(self._ends) > self._head and self._watts[-1] == watts and self._ends[-1] == start:
            self._ends[-1] = end  # one piece while nothing changes
        else:
            self._starts.append(start)
            self._ends.append(end)
            self._watts.append(watts)
        head = max(self._head, len(self._ends) - self.max_pieces)
        while self._ends[head] < end - self.keep_s:
            head += 1
        if head > 4096 and 2 * head > len(self._ends):  # compact now and then, never per piece
            del self._starts[:head], self._ends[:head], self._watts[:head]
            head = 0
        self._head = head

    def bins(self, start_s: float, end_s: float, period_s: float) -> tuple[int, np.ndarray] | None:
        """(first bin, mean watts of each bin) for the bins floor(start / p) .. floor(end / p) - 1:
        consecutive windows [a, b), [b, c) get consecutive, disjoint bins. None when a bin is not
        entirely in the log (before the oldest piece kept, or past what the device has run), or
        the window holds no whole bin."""
        if not (period_s > 0 and math.isfinite(start_s) and math.isfinite(end_s)):
            return None
        first, stop = math.floor(start_s / period_s), math.floor(end_s / period_s)
        head = self._head
        if stop <= first or len(self._ends) <= head:
            return None
        edges = np.arange(first, stop + 1, dtype=float) * period_s
        if edges[0] < self._starts[head] - EDGE_SLACK_S or edges[-1] > self._ends[-1] + EDGE_SLACK_S:
            return None
        low = bisect_right(self._ends, edges[0], lo=head)
        high = max(low + 1, bisect_left(self._starts, edges[-1], lo=head))
        starts, ends = np.array(self._starts[low:high]), np.array(self._ends[low:high])
        energy = np.concatenate([[0.0], np.cumsum((ends - starts) * np.array(self._watts[low:high]))])
        return first, np.diff(np.interp(edges, np.append(starts, ends[-1]), energy)) / period_s

    def energy_j(self, start_s: float, end_s: float) -> float | None:
        """The exact energy drawn over device time [start_s, end_s); None when part of that
        window is not in the log (before the oldest piece kept, or past what the device has run)."""
        head = self._head
        if not (math.isfinite(start_s) and math.isfinite(end_s) and end_s >= start_s) or len(self._ends) <= head:
            return None
        if start_s < self._starts[head] - EDGE_SLACK_S or end_s > self._ends[-1] + EDGE_SLACK_S:
            return None
        low, high = bisect_right(self._ends, start_s, lo=head), bisect_left(self._starts, end_s, lo=head)
        return sum(self._watts[i] * (min(self._ends[i], end_s) - max(self._starts[i], start_s))
                   for i in range(low, high))
