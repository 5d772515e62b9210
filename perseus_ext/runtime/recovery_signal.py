"""The straggler's own word that it runs at full speed again, within the iteration it recovers in.

Why: a slowed pipeline's own wait at the gradient sync (`recovery.RecoveryJudge`) tells only at
the end of the straggler's first recovered iteration, which the slowed pipeline has run entirely
at its slowed plan by then (with a 1.2x straggler, that iteration takes 20 % longer than it
needs to). The straggler pipeline knows much earlier: its ranks see each computation end on the
device, and two computations in a row that take their model time again (against the plan's
planned duration, within half the straggler threshold), after two in a row that took longer than
the threshold allows, say it has recovered. A clock change inside a computation bends its time
one way: one from a lower clock (landing late, or the next computation's lowering issued ahead)
lengthens it, one from a higher clock shortens it. Which clocks may be in force during a
computation: those of the computations that ended less than a change's landing window before it
started, and the next one's. So a computation none of them is above is evidence of model speed
when it takes its planned time, one none of them is below is evidence of slowness when it takes
longer, and neither is read the other way (it keeps the counts of computations in a row). A
straggler whose computations never ran slow (a slow link, a slow host, a plan solved from its
own slow profile) says nothing: the slowed pipelines' own waits tell its recovery.

The same key carries the other half: in each iteration in which the straggler's computations
still run slow, it says so once. A slowed pipeline's own wait at the gradient sync can dip on a
crowded host although its straggler lasts (its slowed plan ends only a few wait spreads before
the straggler); the judge takes no verdict from a wait in an iteration the straggler said it ran
slow in (`RecoveryJudge.still_slow`).

The cheapest way to say so: one key written to the process group's rendezvous store (not a
collective, nothing any rank waits for). While a plan slowed for a straggler is in force, the
slowed pipelines' ranks read the key from this background thread every `POLL_S` and report the
recovery to their `RecoveryJudge`, which overrides the episode on the device: their remaining
computations run the fastest plan's clocks. Both ends run on this thread only; a store that is
slow blocks nothing but it, and one that fails is given up (logged once): the iteration-level
verdict stands.

Which straggler: a straggler check names it alike on every rank (its pipeline time is the
slowest, and slower than the fastest pipeline's by more than the threshold); the key's value
carries that check's number and the iteration it ran at model speed in, and a slowed pipeline
takes only a post of an iteration its episode's first check measured or a later one: a post from
an episode long gone, or from a pipeline a noisy check named the straggler for a moment, is not
its straggler's.
With several stragglers only the slowest posts, and the slowed pipelines go back to their
fastest plan when it recovers (never slower than the job; the next checks slow them again for the
next straggler, after their confirmations).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from perseus_ext.background import start_background
from perseus_ext.runtime.recovery import RecoveryJudge, Verdict

if TYPE_CHECKING:
    from perseus_ext.measurement.gpu.timeline import DeviceMarker

logger = logging.getLogger(__name__)

POLL_S = 0.005  # how often a slowed pipeline reads the key, and a straggler's thread looks for ended work
IN_A_ROW = 2  # computations in a row that show the straggler slow, then at model speed again
JOIN_TIMEOUT_S = 1.0
KEY = "perseus-ext/{job}/straggler-state"
RECOVERED, SLOW = "recovered", "slow"  # what the key's value says of its iteration


@dataclass(frozen=True)
class Span:
    """One computation of the straggler pipeline's stage, launched: its device markers, its planned
    duration, and which way a clock change inside it could bend its time: `may_run_fast` (a
    higher clock may be in force for part of it: the one before it, landing late, or the next
    one's, raised early) and `may_run_slow` (the clock before it was lower); both where unknown."""

    iteration: int
    start: DeviceMarker
    end: DeviceMarker
    planned_s: float
    may_run_fast: bool
    may_run_slow: bool

    @classmethod
    def of(cls, iteration: int, start: DeviceMarker, end: DeviceMarker, clocks: tuple[int, ...],
           durations_s: tuple[float, ...], position: int, clock_before: float | None, window_s: float) -> Span:
        """Computation `position` of a plan with `clocks` and planned `durations_s`, the
        iteration before having ended at `clock_before` MHz (None: unknown). A clock change lands
        up to `window_s` late (the switch latency, the ramp, the controller's delay) or is
        issued ahead for the next computation: the clock in force may be that of any
        computation ending less than `window_s` before this one starts, or the next one's."""
        own = clocks[position]
        nearby: list[float | None] = [clocks[position + 1]] if position + 1 < len(clocks) else []
        gap_s, j = 0.0, position - 1
        while gap_s < window_s or j == position - 1:
            nearby.append(clocks[j] if j >= 0 else clock_before)
            if j < 0:
                break
            gap_s += durations_s[j]
            j -= 1
        if any(clock is None for clock in nearby):
            return cls(iteration, start, end, durations_s[position], True, True)
        return cls(iteration, start, end, durations_s[position], any(c > own for c in nearby),
                   any(c < own for c in nearby))


@dataclass(frozen=True)
class _Counts:
    """What the straggler's computations showed since it was named: whether `IN_A_ROW` of them
    in a row ran slow (a slow straggler, not a clock change's artefact), and how many in a row
    since ran at model speed."""

    slow_in_a_row: int = 0
    ran_slow: bool = False
    at_speed_in_a_row: int = 0

    def after(self, slow: bool, at_speed: bool, over_tolerance: bool) -> _Counts:
        """One more computation: slow, at model speed, or neither (a clock change inside it may
        have bent its time); `over_tolerance`: it took longer than its model allows."""
        slow_in_a_row = self.slow_in_a_row + 1 if slow else (self.slow_in_a_row if over_tolerance else 0)
        at_speed_in_a_row = 0 if over_tolerance else self.at_speed_in_a_row + at_speed
        return _Counts(slow_in_a_row, self.ran_slow or slow_in_a_row >= IN_A_ROW, at_speed_in_a_row)


class RecoverySignal:
    """The straggler's post and the slowed pipelines' read of the rendezvous store, on one
    background thread started at the first arming. `store`: a torch.distributed Store (or
    anything with set/check/get), None where there is none (one pipeline, no process group)."""

    def __init__(self, store: Any, job_id: str | None, judge: RecoveryJudge, tolerance: float) -> None:
        self._store = store
        self._key = KEY.format(job=job_id or "job")
        self._judge = judge
        self._tolerance = tolerance  # a computation is at model speed within this factor of its plan
        self._lock = threading.Lock()
        self._spans: queue.SimpleQueue[Span] = queue.SimpleQueue()
        self._straggler_check: int | None = None  # the check that named this pipeline the straggler
        self._held: tuple[int, int] | None = None  # (episode, the first iteration its first check measured)
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.failure: str | None = None  # why the store was given up
        self.posted: list[str] = []  # what this rank posted (a straggler's ranks), for tests and logs
        self._posted_at: int | None = None  # the iteration this rank last told of a recovery in
        self._counts = _Counts()  # what its computations showed since this rank was named the straggler
        self._slow_told: int | None = None  # the iteration this rank last said it ran slow in

    @property
    def usable(self) -> bool:
        return self._store is not None and self.failure is None and not self._stopping

    # ------------------------------------------------------------------ training thread
    def arm_straggler(self, check: int | None, window_start: int = 0) -> None:
        """Check `check`, which measured iterations from `window_start` on, named this pipeline
        the straggler (None: it did not). A check whose window began before this rank last told
        of a recovery measured that straggler, gone since: it arms nothing."""
        stale = self._posted_at is not None and self._posted_at >= window_start
        with self._lock:
            if self._straggler_check is None:  # newly named: the counts start afresh (each check re-arms)
                self._counts = _Counts()
            self._straggler_check = check if self.usable and not stale else None
        self._start()

    @property
    def watching(self) -> bool:
        """Whether this rank's computations are watched (its pipeline is the straggler)."""
        return self._straggler_check is not None

    def computation(self, span: Span) -> None:
        """A computation of the straggler pipeline launched (non-blocking)."""
        if self._straggler_check is not None:
            self._spans.put(span)

    def arm_held(self, episode: int | None, since: int = 0) -> None:
        """A plan slowed for a straggler is in force as straggler episode `episode`, whose first
        check measured iterations from `since` on (None: no longer): a post of a recovery in an
        earlier iteration is another straggler's (an episode long gone, or a pipeline a noisy
        check named the straggler for a moment)."""
        with self._lock:
            self._held = None if episode is None or not self.usable else (episode, since)
        self._start()

    def disarm(self) -> None:
        """Neither end any more (the deployment that armed it is gone)."""
        self.arm_straggler(None)
        self.arm_held(None)

    def close(self) -> None:
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_TIMEOUT_S)  # a store call that hangs keeps a daemon thread, never the job

    # ------------------------------------------------------------------ the thread
    def _start(self) -> None:
        self._wake.set()
        if self._thread is None and self.usable and (self._held is not None or self._straggler_check is not None):
            self._thread = start_background(threading.Thread(target=self._loop, name="perseus-recovery-signal",
                                                             daemon=True))

    def _loop(self) -> None:
        pending: Span | None = None
        while not self._stopping and self.failure is None:
            if self._straggler_check is None and self._held is None:
                self._wake.wait()
                self._wake.clear()
                pending = None
                continue
            if self._straggler_check is not None:
                if pending is None:
                    try:
                        pending = self._spans.get(timeout=POLL_S)
                    except queue.Empty:
                        pending = None
                if pending is not None and pending.end.wait(POLL_S):
                    self._judge_span(pending)
                    pending = None
            else:
                self._wake.wait(POLL_S)
                self._wake.clear()
            if self._held is not None:
                self._read()

    def _judge_span(self, span: Span) -> None:
        """One ended computation of the straggler, counted; the post, once it has run slow
        (the straggler is this rank's computations, not its communication or its host) and then
        `IN_A_ROW` computations in a row at model speed."""
        check = self._straggler_check
        begin, end = span.start.device_time_s(), span.end.device_time_s()
        if check is None or begin is None or end is None or span.planned_s <= 0:
            return  # no device time: it says nothing
        ratio = (end - begin) / span.planned_s
        slow = ratio > 1.0 + 2 * self._tolerance and not span.may_run_slow
        at_speed = ratio <= 1.0 + self._tolerance and not span.may_run_fast
        with self._lock:
            counts = self._counts = self._counts.after(slow, at_speed, ratio > 1.0 + self._tolerance)
        if slow and counts.ran_slow and self._slow_told != span.iteration:  # still slow: said once an iteration
            if self._call(lambda: self._store.set(self._key, f"{check}:{span.iteration}:{SLOW}")):
                self._slow_told = span.iteration
        if not counts.ran_slow or counts.at_speed_in_a_row < IN_A_ROW:
            return
        value = f"{check}:{span.iteration}:{RECOVERED}"
        if self._call(lambda: self._store.set(self._key, value)):
            self.posted.append(value)
            self._posted_at = span.iteration
            logger.debug("perseus-ext: this pipeline ran %d computations in a row at model speed in iteration %d: the "
                         "straggler has recovered (told the slowed pipelines)", IN_A_ROW, span.iteration)
        with self._lock:
            if self._straggler_check == check:
                self._straggler_check = None
        while not self._spans.empty():
            self._spans.get_nowait()

    def _read(self) -> None:
        """A slowed pipeline's read of the key; a post of this episode's straggler is reported."""
        held = self._held
        if held is None:
            return
        found: list[bytes] = []
        if not self._call(lambda: self._store.check([self._key]) and found.append(self._store.get(self._key))):
            return
        if not found:
            return
        try:
            check_text, iteration_text, state = found[0].decode().split(":")
            check, iteration = int(check_text), int(iteration_text)
        except ValueError:
            return
        if state == SLOW:
            self._judge.still_slow(iteration)
            return
        episode, since = held
        if state == RECOVERED and iteration >= since and self._held == held:
            self._judge.report(Verdict(episode, iteration, f"the straggler pipeline ran at model speed again in "
                                                           f"iteration {iteration} (its post, check {check})"))
            with self._lock:
                if self._held == held:
                    self._held = None

    def _call(self, operation: Any) -> bool:
        """One store call; a failure gives the store up for good (logged once): False."""
        try:
            operation()
            return True
        except Exception as err:
            self.failure = f"{type(err).__name__}: {err}"
            logger.warning("perseus-ext: the rendezvous store failed (%s); slowed pipelines learn that a "
                           "straggler recovered from their own wait at the gradient sync only", self.failure)
            return False
