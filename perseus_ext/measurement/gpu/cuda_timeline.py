"""The compute stream of a real GPU, seen through CUDA events.

A marker is a `torch.cuda.Event(enable_timing=True)` recorded on the current stream: recording
is asynchronous (the training thread never waits), and the controller's worker thread may block
on `event.synchronize()` to learn when the device got there.

Device times, for weeks of training. CUDA gives event-to-event elapsed times, not wall-clock
times, as a 32-bit float of milliseconds: measured from one event recorded when the job starts,
a marker's time would be quantised to 8 ms after a day and 64 ms after a week (the size of the
clock-switching latency and of the computations being timed). So markers are measured from an
*anchor*, an event the device has reached recently, and the anchor moves forward: to the
iteration start marker once the device has reached it (`anchor_at`, which the sequencer calls
at every iteration start), or to any marker noticed more than `ANCHOR_MAX_AGE_S` after it.
Nothing is synchronised for it: an anchor is a marker someone already waited for or queried.
Anchor-to-anchor elapsed times add up (float64) to a device clock `d` that never loses
precision; a link longer than `LONG_LINK_S` (its float32 rounding no longer negligible) starts
the offset estimate afresh.

The host/device offset. Every time the host notices a marker reached (a successful query or
wait) at perf_counter time n, n - d bounds the offset from above (the device got there no later
than the host noticed). The device's clock drifts against the host's (tens of ppm, either way),
so the offset is modelled as a line, offset(d) = level + rate · d: the rate is fitted to the
lowest bound of each `BUCKET_S` of device time, over the last `RATE_BUCKETS` buckets that hold
one, and the level is the lowest rate-corrected bound of the last `WINDOW_BUCKETS` of them. An offset taken as the
smallest bound ever seen (this module's first version) falls behind a device clock that runs
slow, by the drift: 30 s a week at 50 ppm.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any

from perseus_ext.measurement.gpu.timeline import DeviceMarker, DeviceTimeline

POLL_S = 0.001  # query interval of a wait with a timeout (event.synchronize cannot time out); each query takes the GIL
ANCHOR_MAX_AGE_S = 10.0  # without iteration starts: any marker noticed this long after the anchor becomes one
LONG_LINK_S = 60.0  # an anchor-to-anchor link this long (float32 ms step ~4 us) restarts the offset estimate
BUCKET_S = 1.0  # device time over which the lowest offset bound is kept
WINDOW_BUCKETS = 120  # latest buckets holding a bound that the offset's level is taken from (rate-corrected)
RATE_BUCKETS = 600  # latest buckets holding a bound that the drift rate is fitted to
REFIT_EVERY = 16  # new buckets between two fits of the rate (a fit reads the WINDOW_BUCKETS)
MIN_RATE_SPAN_S = 10.0  # no rate is fitted over a shorter span
MAX_RATE = 1e-3  # |drift| above 1000 ppm is noise in the bounds, not a clock


class OffsetEstimate:
    """host time − device time as a line over device time, from notice bounds; thread-safe to
    read (one tuple), written under the timeline's lock. Every update costs O(1) but a fit of
    the rate (every `REFIT_EVERY` new buckets: a pass over `WINDOW_BUCKETS`), whichever thread
    notices a marker, the training thread included."""

    def __init__(self) -> None:
        self._buckets: collections.deque[list[float]] = collections.deque()  # [index, d, bound]
        self._line: tuple[float, float] = (float("inf"), 0.0)  # (level, rate)
        self._new_buckets = 0
        self._appended = 0
        # least-squares sums over the buckets, of x = d - origin[0] and y = bound - origin[1]
        # (centred: a week of device time and a host clock since boot would lose digits)
        self._origin: tuple[float, float] | None = None
        self._sums = [0.0, 0.0, 0.0, 0.0, 0.0]  # n, Σx, Σy, Σxx, Σxy

    def add(self, d: float, bound: float) -> None:
        """A marker at device time d was noticed at host time d + bound."""
        index = d // BUCKET_S
        buckets = self._buckets
        if buckets and index <= buckets[-1][0]:
            last = buckets[-1]
            if index == last[0] and bound < last[2]:
                self._count(last, -1.0)
                last[1], last[2] = d, bound
                self._count(last, 1.0)
            self._lower(d, bound)
            return
        if self._origin is None:
            self._origin = (d, bound)
        if len(buckets) == RATE_BUCKETS:
            self._count(buckets.popleft(), -1.0)
        bucket = [index, d, bound]
        buckets.append(bucket)
        self._count(bucket, 1.0)
        self._appended += 1
        if self._appended % RATE_BUCKETS == 0:  # added and removed that often: sum afresh
            self._sums = [0.0, 0.0, 0.0, 0.0, 0.0]
            for each in buckets:
                self._count(each, 1.0)
        self._new_buckets += 1
        if self._new_buckets >= REFIT_EVERY or len(buckets) < REFIT_EVERY:
            self._refit()
        else:
            self._lower(d, bound)

    def _count(self, bucket: list[float], sign: float) -> None:
        x, y = bucket[1] - self._origin[0], bucket[2] - self._origin[1]
        sums = self._sums
        sums[0] += sign
        sums[1] += sign * x
        sums[2] += sign * y
        sums[3] += sign * x * x
        sums[4] += sign * x * y

    def _lower(self, d: float, bound: float) -> None:
        level, rate = self._line
        self._line = (min(level, bound - rate * d), rate)

    def _refit(self) -> None:
        buckets = self._buckets
        rate = self._line[1]
        self._new_buckets = 0
        n, sx, sy, sxx, sxy = self._sums
        if n >= 3 and buckets[-1][1] - buckets[0][1] >= MIN_RATE_SPAN_S:
            spread = sxx - sx * sx / n
            if spread > 0:
                rate = max(-MAX_RATE, min(MAX_RATE, (sxy - sx * sy / n) / spread))
        recent = itertools.islice(buckets, max(0, len(buckets) - WINDOW_BUCKETS), None)
        self._line = (min(b[2] - rate * b[1] for b in recent), rate)

    def restart(self) -> None:
        """Forget the bounds (the device clock's coordinate may have shifted); keep the rate."""
        self._buckets.clear()
        self._sums = [0.0, 0.0, 0.0, 0.0, 0.0]
        self._origin = None
        self._line = (float("inf"), self._line[1])

    def offset_s(self, d: float) -> float:
        level, rate = self._line
        return level + rate * d

    @property
    def rate(self) -> float:
        return self._line[1]


class CudaTimeline(DeviceTimeline):
    """Markers are CUDA events on the current stream of the current device."""

    def __init__(self, cuda: Any = None) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self._cuda = cuda
        self._lock = threading.Lock()
        self.offset = OffsetEstimate()
        reference = cuda.Event(enable_timing=True)
        reference.record()
        # Once, at construction: the first anchor must be complete before elapsed times exist.
        reference.synchronize()
        self._sequence = itertools.count(1)  # record order (the training thread records every marker)
        self._anchor_event = reference
        self._anchor_seq = 0
        self._anchor_d = 0.0
        self._next_anchor: CudaMarker | None = None
        self.anchors = 1  # anchors taken so far (the reference included)
        self.offset.add(0.0, time.perf_counter())

    def record_marker(self) -> DeviceMarker:
        event = self._cuda.Event(enable_timing=True)
        event.record()
        return CudaMarker(self, event, next(self._sequence))

    def anchor_at(self, marker: DeviceMarker) -> None:
        """Measure later markers from `marker` once the device has reached it (an iteration
        start); never blocks."""
        if isinstance(marker, CudaMarker) and marker.timeline is self:
            self._next_anchor = marker

    def synchronize(self) -> None:
        self._cuda.synchronize()

    def _noticed(self, marker: CudaMarker, at_s: float) -> float:
        """A marker noticed reached at `at_s`: its device time d (tightens the offset, and may
        become the anchor)."""
        with self._lock:
            if marker.seq >= self._anchor_seq:
                d = self._anchor_d + self._anchor_event.elapsed_time(marker.event) / 1000.0
            else:  # recorded before the anchor: always ask CUDA for earlier -> later
                d = self._anchor_d - marker.event.elapsed_time(self._anchor_event) / 1000.0
            link_s = d - self._anchor_d
            if marker is self._next_anchor or link_s >= ANCHOR_MAX_AGE_S:
                if marker is self._next_anchor:
                    self._next_anchor = None
                if link_s > 0:
                    self._anchor_event, self._anchor_seq, self._anchor_d = marker.event, marker.seq, d
                    self.anchors += 1
                    if link_s >= LONG_LINK_S:
                        self.offset.restart()
            self.offset.add(d, at_s - d)
        return d

    def device_time_of(self, d: float) -> float:
        return d + self.offset.offset_s(d)


class CudaMarker(DeviceMarker):
    """One CUDA event; its device time is read once it has completed."""

    __slots__ = ("timeline", "event", "seq", "_d")

    def __init__(self, timeline: CudaTimeline, event: Any, seq: int) -> None:
        self.timeline = timeline
        self.event = event
        self.seq = seq
        self._d: float | None = None

    def query(self) -> bool:
        if self._d is None and self.event.query():
            self._d = self.timeline._noticed(self, time.perf_counter())
        return self._d is not None

    def wait(self, timeout_s: float | None = None) -> bool:
        if self._d is not None:
            return True
        if timeout_s is None:
            self.event.synchronize()
            self._d = self.timeline._noticed(self, time.perf_counter())
            return True
        deadline = time.perf_counter() + timeout_s
        while not self.query():
            if time.perf_counter() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    def device_time_s(self) -> float | None:
        if not self.query():
            return None
        return self.timeline.device_time_of(self._d)
