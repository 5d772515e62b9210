"""Times and meters device markers off the training thread.

The training thread records a marker at each iteration boundary and hands it over; this thread
waits for the device to reach it, notes when it did and reads the energy counter right then, so
per-iteration time and energy follow the device's timeline without the host ever waiting. It is
its own thread, apart from the clock controller's worker, so a clock change held back to land on
time never delays a measurement.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from perseus_ext.background import start_background
from perseus_ext.measurement.gpu.capture_mode import ignore_other_threads_captures

if TYPE_CHECKING:
    from perseus_ext.measurement.gpu import GPU
    from perseus_ext.measurement.gpu.timeline import DeviceMarker

MARKER_POLL_S = 0.05  # how often a wait on a marker checks whether it must stop
JOIN_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Observation:
    """What the observer saw when the device reached an observed marker."""

    tag: Any
    device_time_s: float  # when the device reached the marker (GPU.timestamp() clock)
    noticed_s: float  # when the observer noticed (perf_counter): the notice delay is the difference
    energy_mj: int | None  # the energy counter read right after noticing (None: a failed read)


@dataclass(frozen=True)
class _Observe:
    tag: Any
    at: DeviceMarker


class _Stop:
    """Queue item: end the thread."""


_STOP = _Stop()


def wait_for_marker(marker: DeviceMarker, stopping: Callable[[], bool],
                    on_error: Callable[[BaseException], None], poll_s: float = MARKER_POLL_S) -> bool:
    """Block until the device reaches `marker`; False when `stopping()` first (asked every
    `poll_s`). A marker that cannot be waited on (a broken event) counts as reached, after
    `on_error`. Runs on perseus-ext's own threads, whose queries must not break another thread's
    CUDA graph capture."""
    ignore_other_threads_captures()
    while not stopping():
        try:
            if marker.wait(poll_s):
                return True
        except Exception as err:
            on_error(err)
            return True
    return False


class DeviceObserver:
    """One thread that observes markers in order; `observations()` hands them over."""

    def __init__(self, gpu: GPU, on_error: Callable[[str, BaseException, str, str], None]) -> None:
        self.gpu = gpu
        self._on_error = on_error
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._seen: collections.deque[Observation] = collections.deque()
        self._stopping = False
        self._listeners: list[Callable[[Observation], None]] = []
        self._thread = start_background(
            threading.Thread(target=self._loop, name="perseus-device-observer", daemon=True)
        )

    def observe(self, at: DeviceMarker, tag: Any) -> None:
        self._queue.put(_Observe(tag, at))

    def listen(self, callback: Callable[[Observation], None]) -> None:
        """Call `callback` on this thread with each observation, before `observations()` hands
        it over (what is judged off the training thread as the device goes, runtime/recovery.py)."""
        self._listeners.append(callback)

    def observations(self) -> list[Observation]:
        seen = []
        while self._seen:
            seen.append(self._seen.popleft())
        return seen

    def barrier(self) -> threading.Event | None:
        """An event set once everything queued so far is observed (None: the thread is gone)."""
        if not self._thread.is_alive():
            return None
        done = threading.Event()
        self._queue.put(done)
        return done

    def close(self) -> None:
        self._stopping = True
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._queue.put(_STOP)
            self._thread.join(JOIN_TIMEOUT_S)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, threading.Event):
                item.set()
            elif wait_for_marker(item.at, lambda: self._stopping, self._marker_failed):
                self._record(item)

    def _marker_failed(self, err: BaseException) -> None:
        self._on_error("marker", err, "could not wait for a device marker", "it is measured at once instead")

    def _record(self, item: _Observe) -> None:
        noticed = time.perf_counter()
        reached = item.at.device_time_s()
        energy = None
        try:
            energy = self.gpu.energy_mj()
        except Exception as err:
            self._on_error("read", err, "could not read the energy counter", "the iteration's energy is not measured")
        observation = Observation(item.tag, noticed if reached is None else reached, noticed, energy)
        for listener in list(self._listeners):
            try:
                listener(observation)
            except Exception as err:  # a listener's failure must not stop the measurements
                self._listeners.remove(listener)
                self._on_error("listener", err, "an observation listener failed", "it is no longer called")
        self._seen.append(observation)
