"""The power floors a simulated device holds (a swing-capped plan's filler), in its device time.

Why a separate piece: the device integrates its power piece by piece (`device.py`); floors only
raise those pieces, from a device time that a marker fixes when the device reaches it, and they
end when the device starts work launched after that marker (the wait they fill is over). Kept
here, the device only asks which floors apply to a piece and tells when work starts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Protocol

from perseus_ext.measurement.gpu.common import PowerFloor


class Anchor(Protocol):
    """A marker of the device: reached after `seq` launches, at `device_time_s()`."""

    seq: int

    def query_locked(self) -> bool: ...

    def device_time_s(self) -> float | None: ...


class PowerFloors:
    """Floors waiting for their anchor, then held over [start, end) of device time."""

    def __init__(self, idle_power_w: float) -> None:
        self.idle_power_w = idle_power_w
        self._pending: deque[tuple[Anchor, tuple[PowerFloor, ...], float]] = deque()
        self._held: list[tuple[float, float, float, int]] = []  # (start, end, watts above idle, anchor's seq)

    def add(self, anchor: Anchor, floors: Sequence[PowerFloor], hold_until_work_s: float) -> None:
        """One wait's floors from `anchor` on; the latest-ending one may hold on past its end
        while the device still waits, at most `hold_until_work_s`."""
        self._pending.append((anchor, tuple(floors), max(0.0, hold_until_work_s)))
        self._activate()

    def _activate(self) -> None:
        """Floors whose anchor the device has reached, in device time (anchors in order)."""
        while self._pending and self._pending[0][0].query_locked():
            anchor, floors, hold_s = self._pending.popleft()
            at, last = anchor.device_time_s(), max((f.end_s for f in floors), default=0.0)
            self._held += [(at + f.start_s, at + f.end_s + (hold_s if f.end_s == last else 0.0), f.above_idle_w,
                            anchor.seq) for f in floors if f.end_s > f.start_s]

    def work_started(self, seq: int, at_s: float) -> None:
        """Launch `seq` starts at `at_s`: the waits of anchors before it are over."""
        self._activate()
        if self._held:
            self._held = [(start, min(end, at_s), watts, anchor) if anchor < seq else (start, end, watts, anchor)
                          for start, end, watts, anchor in self._held]

    def pieces(self, start: float, end: float, watts: float) -> Iterator[tuple[float, float, float]]:
        """[start, end) at `watts` cut where floors begin or end, each piece's power raised to at
        least idle + the floors held over it (floors that overlap add up)."""
        if self._pending:
            self._activate()
        if self._held:
            self._held = [floor for floor in self._held if floor[1] > start and floor[1] > floor[0]]
        if not self._held:
            yield start, end, watts
            return
        cuts = sorted({start, end, *(t for floor in self._held for t in floor[:2] if start < t < end)})
        for low, high in zip(cuts, cuts[1:]):
            yield low, high, self.floored(watts, low, high)

    def floored(self, watts: float, low: float, high: float) -> float:
        """`watts` raised to the floors held over all of [low, high)."""
        self._activate()
        above = sum(w for start, end, w, _ in self._held if start <= low and high <= end)
        return max(watts, self.idle_power_w + above) if above > 0 else watts
