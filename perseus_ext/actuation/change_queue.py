"""When a queued clock change falls due: the controller's queue items and the rules, in device
order, for applying, holding back or skipping each one.

Why apart from the controller: these rules decide only *when* a change goes out -- once the
device reaches its marker, `after_s` later, no later than its `by` marker, and never after a
newer change has fallen due -- from the markers alone; the controller (controller.py) decides
*what* a change does to the GPU, counts and logs failures and restores. The rules hold the
controller's guarantee that a misplanned delay costs at most the computation it was aimed at,
never the changes queued behind it.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from perseus_ext.measurement.gpu.timeline import DeviceMarker

SET_ASIDE_KEPT = 64  # recovery changes kept while their episode is not overridden (a few iterations' worth)
OVERTAKE_POLL_S = 0.01  # while a change is held back: how often later ones are checked for being due (a
# new request wakes the worker at once; each wake takes the GIL from the training thread briefly)


class Reset:
    """Clock target: unlock the SM clock (the driver default)."""


RESET = Reset()


@dataclass(frozen=True)
class ClockAt:
    """Apply `target` (MHz or RESET) `after_s` seconds after the device reaches `at` (None:
    now), or once it reaches `by`, whichever comes first."""

    target: int | Reset
    at: DeviceMarker | None
    after_s: float = 0.0
    by: DeviceMarker | None = None
    epoch: int = 0  # the controller drops every change queued in an earlier epoch (release_silent)
    # The straggler episode whose slowed plan this change serves (None: none) and whether it is
    # that episode's recovery program (the fastest plan's clocks), which applies only once the
    # episode is overridden, when the episode's own changes stop applying (`RecoveryOverride`).
    episode: int | None = None
    recovery: bool = False


@dataclass(frozen=True)
class PowerLimitAt:
    """Set the power limit to `watts` when the worker comes to it (power-limit mode)."""

    watts: float


@dataclass(frozen=True)
class Barrier:
    """Set `done` once everything queued before it is done (flush)."""

    done: threading.Event


class Stop:
    """Restore everything and end the worker."""


STOP = Stop()

Item = Union[ClockAt, PowerLimitAt, Barrier, Stop]


class RecoveryOverride:
    """The straggler episodes whose slowed plans the worker no longer runs.

    Why: a pipeline slowed for a straggler learns that the straggler has recovered on a
    background thread, as the device runs (`runtime.recovery`), while the training thread has
    already queued the slowed plan's changes for the iterations it launched. Overriding the
    episode swaps those for its recovery program (the fastest plan's clocks, queued beside
    them at the same device markers), so every computation the device has not started yet
    runs fast, without the training thread waiting for anything. Thread-safe; one-way."""

    def __init__(self) -> None:
        self._episodes: set[int] = set()
        self._lock = threading.Lock()
        self._aside: collections.deque[ClockAt] = collections.deque(maxlen=SET_ASIDE_KEPT)

    def activate(self, episode: int) -> bool:
        """Override `episode` from now on; True the first time."""
        with self._lock:
            if episode in self._episodes:
                return False
            self._episodes.add(episode)
            return True

    def pass_by(self, item: ClockAt) -> int:
        """The worker passes an item that does not apply: a recovery change is set aside (its
        episode may be overridden before the device gets there, `catch_up`); 1 for a slowed
        plan's change that never goes out, 0 otherwise. Worker only."""
        if item.recovery:
            self._aside.append(item)
            return 0
        return 1

    def catch_up(self, epoch: int) -> tuple[ClockAt | None, list[ClockAt]]:
        """Once an episode is overridden, its recovery changes the worker passed by: (the latest
        whose marker the device has reached -- the clock of the computation it runs now --, the
        ones still ahead, which the worker takes next, in order). Worker only."""
        due = [item for item in self._aside if self.active(item.episode) and item.epoch == epoch]
        if not due:
            return None, []
        taken = {id(item) for item in due}
        self._aside = collections.deque((i for i in self._aside if id(i) not in taken), maxlen=SET_ASIDE_KEPT)
        reached = [item.at is None or item.at.query() for item in due]
        latest = max((i for i, done in enumerate(reached) if done), default=None)
        return (None if latest is None else due[latest]), [i for i, done in zip(due, reached) if not done]

    def active(self, episode: int | None) -> bool:
        return episode is not None and episode in self._episodes

    def applies(self, item: Any) -> bool:
        """Whether a queued item still applies: an episode's own changes until it is overridden,
        its recovery program from then on, everything else always."""
        if not isinstance(item, ClockAt) or item.episode is None:
            return True
        return self.active(item.episode) == item.recovery


class ChangeQueue:
    """The training thread's requests to the worker: `put` never blocks (a C call, safe inside
    signal handlers); the worker takes them in batches."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Item] = queue.SimpleQueue()

    def put(self, item: Item) -> None:
        self._queue.put(item)

    def next_batch(self) -> list[Item]:
        """Block for the next request, then take every one already waiting behind it."""
        batch = [self._queue.get()]
        while True:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                return batch

    def wait_until_due(self, item: ClockAt, batch: list[Item], index: int, dropped: Callable[[], bool],
                       applies: Callable[[Any], bool] = lambda _: True) -> bool | None:
        """Wait until `item` (`batch[index]`, its marker reached) is due: True. False when
        `dropped()` says the controller stopped or dropped it first; None when a change queued
        later falls due first: `item` is then stale, and waiting on would hold up every change
        behind it (a delay planned from a gap that was unusually long, an inline solve or a
        checkpoint, would otherwise cost whole iterations). Requests that arrive meanwhile are
        appended to `batch`."""
        if item.after_s <= 0 or item.at is None:
            return True
        untimed_due_s = time.perf_counter() + item.after_s  # a marker without a device time
        while not dropped():
            due = due_s(item)
            remaining = (untimed_due_s if due is None else due) - time.perf_counter()
            if remaining <= 0:
                return True
            try:
                batch.append(self._queue.get(timeout=min(remaining, OVERTAKE_POLL_S)))
            except queue.Empty:
                pass
            if superseded(item, batch[index + 1:], applies):
                return None
        return False


def superseded(item: ClockAt, later: list[Any], applies: Callable[[Any], bool] = lambda _: True) -> bool:
    """A newer clock target already due (its marker passed, its delay over) makes `item` stale;
    `applies`: whether a queued item still applies (`RecoveryOverride.applies`)."""
    now = time.perf_counter()
    for other in later:
        if isinstance(other, ClockAt) and applies(other) and (other.at is None or other.at.query()):
            due = due_s(other)
            if due is None or due <= now:
                return True
    return False


def due_s(item: ClockAt) -> float | None:
    """When a change whose marker the device has reached falls due on the device's clock:
    `after_s` past `at`, or earlier if the device has reached `by`; None where the marker
    carries no device time."""
    reached_s = item.at.device_time_s() if item.at is not None else None
    due = None if reached_s is None else reached_s + item.after_s
    if item.by is not None and item.by.query():
        by_s = item.by.device_time_s()
        if by_s is not None and (due is None or by_s < due):
            return by_s
    return due
