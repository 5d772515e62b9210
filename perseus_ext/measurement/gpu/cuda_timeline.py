"""The compute stream of a real GPU, seen through CUDA events.

A marker is a `torch.cuda.Event(enable_timing=True)` recorded on the current stream: recording
is asynchronous (the training thread never waits), and the controller's worker thread may block
on `event.synchronize()` to learn when the device got there.

Device times: CUDA gives event-to-event elapsed times, not wall-clock times. Each marker's time
is its elapsed time from a reference event plus an offset aligning the reference to
`time.perf_counter`. Every time the host notices a marker reached (a successful query or wait) at
perf_counter time n, n - elapsed is an upper bound of that offset (the device got there no later
than the host noticed); the smallest bound seen so far is used, so estimates only tighten.
"""

from __future__ import annotations

import time
from typing import Any

from perseus_ext.measurement.gpu.timeline import DeviceMarker, DeviceTimeline

POLL_S = 0.0002  # query interval of a wait with a timeout (event.synchronize cannot time out)


class CudaTimeline(DeviceTimeline):
    """Markers are CUDA events on the current stream of the current device."""

    def __init__(self, cuda: Any = None) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self._cuda = cuda
        self._reference = cuda.Event(enable_timing=True)
        self._reference.record()
        # Once, at construction: the reference must be complete before elapsed times exist.
        self._reference.synchronize()
        self._offset_s = time.perf_counter()

    def record_marker(self) -> DeviceMarker:
        event = self._cuda.Event(enable_timing=True)
        event.record()
        return CudaMarker(self, event)

    def synchronize(self) -> None:
        self._cuda.synchronize()

    def _noticed(self, event: Any, at_s: float) -> float:
        """Tighten the offset with a marker noticed reached at `at_s`; its device time."""
        elapsed_s = self._reference.elapsed_time(event) / 1000.0
        self._offset_s = min(self._offset_s, at_s - elapsed_s)
        return elapsed_s

    def device_time_of(self, elapsed_s: float) -> float:
        return self._offset_s + elapsed_s


class CudaMarker(DeviceMarker):
    """One CUDA event; its elapsed time from the reference is read once it has completed."""

    def __init__(self, timeline: CudaTimeline, event: Any) -> None:
        self._timeline = timeline
        self._event = event
        self._elapsed_s: float | None = None

    def query(self) -> bool:
        if self._elapsed_s is None and self._event.query():
            self._elapsed_s = self._timeline._noticed(self._event, time.perf_counter())
        return self._elapsed_s is not None

    def wait(self, timeout_s: float | None = None) -> bool:
        if self._elapsed_s is not None:
            return True
        if timeout_s is None:
            self._event.synchronize()
            self._elapsed_s = self._timeline._noticed(self._event, time.perf_counter())
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
        return self._timeline.device_time_of(self._elapsed_s)
