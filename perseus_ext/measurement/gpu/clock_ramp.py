"""The effective SM clock over time when clock changes take time to land.

One model, two users: the simulated GPU runs computations on it, and the coverage estimator
(`perseus_ext.measurement.coverage`) replays a real GPU's clock requests through it. A request
issued at time t keeps the old clock until t + switch_s, then ramps to the target over
transition_s in steps of `RAMP_STEP_S` (each step at the ramp's mid-value over its interval, so
the time-averaged clock equals a linear ramp's). A request landing while an earlier ramp is still
under way starts its own ramp from wherever that one had got to.

Clock values are floats: ramp steps need not be supported clocks, and NaN stands for "a clock we
do not know" (the estimator's driver default); NaN equals no planned clock, so it never counts as
covered.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator

RAMP_STEP_S = 0.001  # ramp resolution: fine next to millisecond computations, cheap to walk


class ClockTrajectory:
    """A piecewise-constant clock: value `values[i]` from `times[i]` until `times[i + 1]`."""

    def __init__(self, initial_mhz: float, *, switch_s: float = 0.0, transition_s: float = 0.0,
                 start_s: float = -math.inf) -> None:
        if not (switch_s >= 0 and transition_s >= 0):
            raise ValueError(
                f"switch_s={switch_s}, transition_s={transition_s}: latencies must be >= 0 seconds"
            )
        self.switch_s = switch_s
        self.transition_s = transition_s
        self._times = [start_s]
        self._values = [float(initial_mhz)]
        self._last_landing_s = start_s

    def request(self, issued_at_s: float, target_mhz: float) -> None:
        """A clock change requested at `issued_at_s` (when the set call returned)."""
        lands_at = issued_at_s + self.switch_s
        if lands_at < self._last_landing_s:
            raise ValueError(
                f"clock request landing at {lands_at:.6f} s is earlier than one already placed "
                f"at {self._last_landing_s:.6f} s; requests must come in time order"
            )
        self._last_landing_s = lands_at
        origin = self.value_at(lands_at)
        del self._values[bisect.bisect_right(self._times, lands_at):]
        del self._times[len(self._values):]
        target = float(target_mhz)
        steps = max(1, math.ceil(self.transition_s / RAMP_STEP_S - 1e-9))
        if self.transition_s > 0 and origin != target:
            width = self.transition_s / steps
            for k in range(steps):
                self._append(lands_at + k * width, origin + (target - origin) * (k + 0.5) / steps)
            self._append(lands_at + self.transition_s, target)
        else:
            self._append(lands_at, target)

    def _append(self, at_s: float, value: float) -> None:
        if self._times[-1] == at_s:
            self._values[-1] = value
        elif not _same_clock(self._values[-1], value):
            self._times.append(at_s)
            self._values.append(value)

    def value_at(self, t: float) -> float:
        return self._values[max(0, bisect.bisect_right(self._times, t) - 1)]

    def segments(
        self, start_s: float, end_s: float = math.inf
    ) -> Iterator[tuple[float, float, float]]:
        """(from, to, clock) pieces covering [start_s, end_s); the last one may end at inf."""
        index = max(0, bisect.bisect_right(self._times, start_s) - 1)
        at = start_s
        while at < end_s:
            following = self._times[index + 1] if index + 1 < len(self._times) else math.inf
            upto = min(following, end_s)
            yield at, upto, self._values[index]
            at = upto
            index += 1

    def breakpoints(self, start_s: float, end_s: float) -> list[float]:
        """Times in (start_s, end_s) where the clock changes."""
        low = bisect.bisect_right(self._times, start_s)
        high = bisect.bisect_left(self._times, end_s)
        return self._times[low:high]

    def prune(self, before_s: float) -> None:
        """Forget the history before `before_s` (nothing will ask about it again)."""
        cut = bisect.bisect_right(self._times, before_s) - 1
        if cut > 0:
            del self._times[:cut]
            del self._values[:cut]


def _same_clock(first: float, second: float) -> bool:
    return first == second or (math.isnan(first) and math.isnan(second))
