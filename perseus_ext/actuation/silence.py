"""Default clocks when the hooks fall silent: a GPU is never left throttled by a plan nobody runs.

perseus-ext learns where each computation runs from the framework's per-computation hooks. When
they stop while training goes on -- megatron-core's full-iteration CUDA graph replays the
iteration without running a single hook, a schedule perseus-ext does not know runs the steps, a
script bound the schedule before `install()` -- the last clock queued would stay in force for
the rest of the job. The guard watches the hooks from its own thread: the training thread only
stores a timestamp per hook (`heartbeat()`: no lock, no device call, no synchronisation), and
once no hook has come for `bound_s` while the controller holds a non-default clock, the guard
has the controller drop every queued change and unlock the clocks at once (`FrequencyController.
release_silent`), logs one warning and keeps the episode for the job summary.

The bound is a small multiple (`BOUND_FACTOR`) of the expected iteration time, the median host
period between recent iteration starts, and never below `MIN_BOUND_S` (a host that runs an
iteration ahead of its device, an optimizer step or a data-loader hiccup must not trip it).
Until two iterations have started, `INITIAL_BOUND_S` applies. Evaluation and checkpoints run
at default clocks anyway (the sequencer releases after an iteration's last computation), so a
long pause between iterations trips nothing unless a clock is still held; hooks that come back
simply queue their plan again.
"""

from __future__ import annotations

import collections
import logging
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable

from perseus_ext.background import start_background

logger = logging.getLogger(__name__)

BOUND_FACTOR = 3.0  # silence tolerated, in expected iteration times
MIN_BOUND_S = 0.5  # never shorter (host run-ahead, optimizer step, data loading)
INITIAL_BOUND_S = 30.0  # until the iteration time is known (two iteration starts)
PERIODS_KEPT = 16  # host periods between iteration starts the expected time is the median of
POLL_FRACTION = 0.25  # the guard looks every this fraction of the bound (so it trips within 1.25 x)
MAX_POLL_S = 1.0


@dataclass(frozen=True)
class SilentEpisode:
    """The hooks fell silent while a clock was held; the guard restored the default clocks."""

    silent_for_s: float  # host time since the last hook when the guard acted
    bound_s: float
    expected_iteration_s: float | None  # None: not measured yet (INITIAL_BOUND_S applied)
    held_mhz: int | None  # the clock in force when the guard acted
    at_iteration: int  # iterations started when the hooks fell silent

    def describe(self) -> str:
        expected = (f"{BOUND_FACTOR:g} x the expected iteration time {self.expected_iteration_s:.3f} s"
                    if self.expected_iteration_s is not None else "the bound before the iteration time is known")
        held = f"{self.held_mhz} MHz" if self.held_mhz is not None else "a locked clock"
        return (f"no perseus-ext hook for {self.silent_for_s:.2f} s after iteration {self.at_iteration} "
                f"started (bound {self.bound_s:.2f} s: {expected}) while the GPU was held at {held}: "
                f"default clocks restored. The framework ran work perseus-ext did not see (a CUDA graph "
                f"replay, an unhooked schedule) or stalled")


class SilenceGuard:
    """Watches hook heartbeats; calls `release(episode)` when a held clock outlives the hooks."""

    def __init__(self, held_clock: Callable[[], int | None], release: Callable[[SilentEpisode], None]) -> None:
        """held_clock: the non-default clock in force or pending (None: default clocks); read
        from the guard's thread. release: restore the default clocks now; never raises."""
        self._held_clock = held_clock
        self._release = release
        self._last_s = time.monotonic()
        self._starts: collections.deque[float] = collections.deque(maxlen=PERIODS_KEPT + 1)
        self._started = 0  # iterations started
        self._tripped_since: float | None = None  # the heartbeat the last episode followed
        self.episodes: list[SilentEpisode] = []
        self._stop = threading.Event()
        self._thread = start_background(
            threading.Thread(target=self._watch, name="perseus-silence-guard", daemon=True))

    # ---------------------------------------------------------------- training thread
    def heartbeat(self) -> None:
        """A hook ran: one store, never blocks."""
        self._last_s = time.monotonic()

    def iteration_started(self) -> None:
        """An iteration starts (also a heartbeat): its host period feeds the expected time."""
        now = time.monotonic()
        self._last_s = now
        self._starts.append(now)
        self._started += 1

    # ---------------------------------------------------------------- bound
    @property
    def expected_iteration_s(self) -> float | None:
        starts = list(self._starts)
        if len(starts) < 2:
            return None
        return statistics.median(b - a for a, b in zip(starts, starts[1:]))

    @property
    def bound_s(self) -> float:
        expected = self.expected_iteration_s
        return INITIAL_BOUND_S if expected is None else max(MIN_BOUND_S, BOUND_FACTOR * expected)

    # ---------------------------------------------------------------- guard thread
    def _watch(self) -> None:
        while not self._stop.wait(min(MAX_POLL_S, POLL_FRACTION * self.bound_s)):
            try:
                self._check()
            except Exception:  # the guard must outlive any surprise; log it, keep guarding
                logger.exception("perseus-ext: the silence guard's check failed")

    def _check(self) -> None:
        last = self._last_s
        silent_for = time.monotonic() - last
        bound = self.bound_s
        if silent_for <= bound or self._tripped_since == last:
            return
        held = self._held_clock()
        if held is None:
            return
        episode = SilentEpisode(silent_for, bound, self.expected_iteration_s, held, self._started)
        self._tripped_since = last
        self.episodes.append(episode)
        logger.warning("perseus-ext: %s", episode.describe())
        self._release(episode)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(2 * MAX_POLL_S)
