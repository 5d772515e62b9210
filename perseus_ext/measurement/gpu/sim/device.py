"""The simulated GPU's device: an asynchronous, in-order executor on its own timeline.

Why: real CUDA work runs after the host launched it, and a clock change lands milliseconds after
the NVML call. A simulator that ran work synchronously on the host and applied clocks instantly
would hide exactly the effects a clock controller must get right.

The device state is a deterministic function of what was launched, which clocks were requested
when, and what other ranks published; `_advance(t)` integrates it up to time t. With `pace=True`
the time is the wall clock (perf_counter) and an engine thread advances the device whenever
something happens on it (a computation ends, a dependency may have arrived), so it completes work,
resolves markers and publishes to the board even while every host thread is blocked. With
`pace=False` the device keeps a virtual clock that only waiting on it advances (single-threaded,
exactly reproducible).

Per computation: progress rate 1 / (time_factor(f(t)) * slowdown) and power P(f(t)) at the
effective clock f(t) = min(locked clock trajectory, power-limit cap), integrated piecewise; idle
time (no work, or waiting for a dependency) draws the idle power. A power floor it was asked to
hold (`hold_power_floor`: a swing-capped plan's filler) raises its power to at least idle + the
floor's watts, in windows anchored on the device time a marker is reached, so it lands where the
device is, not where the host was; the power log and the energy counter include it.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from perseus_ext.background import start_background
from perseus_ext.measurement.gpu.clock_ramp import ClockTrajectory
from perseus_ext.measurement.gpu.common import GPUError, PowerFloor
from perseus_ext.measurement.gpu.sim.board import POLL_S, Board
from perseus_ext.measurement.gpu.sim.power_floor import PowerFloors
from perseus_ext.measurement.gpu.sim.power_log import PowerLog
from perseus_ext.measurement.gpu.timeline import CoverageTally, DeviceMarker, SwitchLatency

if TYPE_CHECKING:
    from perseus_ext.measurement.gpu.sim.presets import Preset

ENGINE_LINGER_S = 1.0  # an idle engine thread waits this long for new work before exiting
# While waiting for another rank's key, the device keeps its last this-many seconds open: a key
# seen late (the publisher's engine woke late on a loaded machine, or the poll came late) still
# starts the work at publish time + transfer, as on hardware. Energy readings during such a
# wait trail by at most this much idle energy, less than one counter update period.
DEPENDENCY_HOLD_S = 0.05


@dataclass
class _Work:
    """One launched computation."""

    seq: int  # 1-based launch number
    remaining: float  # work left, in seconds at the max clock without slowdown
    slowdown: float
    planned_clock_mhz: int | None
    after: tuple[str, ...]
    publish: str | None
    launched_at: float
    start: float | None = None
    end: float | None = None


class SimDevice:
    """The compute stream of one simulated GPU (see module doc)."""

    def __init__(self, preset: Preset, *, latency: SwitchLatency, pace: bool, queue_depth: int,
                 energy_update_period_s: float, energy_noise: float, rng: random.Random,
                 initial_clock_mhz: int | None = None, initial_cap_mhz: int | None = None) -> None:
        if not (isinstance(queue_depth, int) and queue_depth >= 1):
            raise GPUError(f"queue_depth={queue_depth!r}; it must be an integer >= 1 computations")
        self.preset = preset
        self.pace = pace
        self.queue_depth = queue_depth
        self.energy_update_period_s = energy_update_period_s
        self.energy_noise = energy_noise
        self.cond = threading.Condition(threading.RLock())
        self.board: Board | None = None
        self._rng = rng
        self._virtual_now = 0.0
        now = self.now()
        self._pos = now  # the device state is final up to here
        self._locked = ClockTrajectory(initial_clock_mhz or preset.max_clock_mhz,
                                       switch_s=latency.switch_s,
                                       transition_s=latency.transition_s, start_s=now)
        self._cap = ClockTrajectory(initial_cap_mhz or preset.max_clock_mhz, start_s=now)
        self._queue: deque[_Work] = deque()  # launched, not finished; the head may be running
        self._launched = 0
        self._completed = 0
        self._last_end = now
        self._markers: deque[SimMarker] = deque()
        self._tally = CoverageTally()
        self._engine: threading.Thread | None = None
        self._engine_failure: BaseException | None = None
        # How long the head may wait for another rank's key (the job's control_timeout_s, set
        # by SimulatedTimeline): past it the peer is taken for dead and the device fails, as a
        # communicator aborts on a dead peer, so no host wait on it lasts longer (None: no bound).
        self.peer_timeout_s: float | None = None
        self._blocked_since: float | None = None  # when the head started waiting for a key
        self._peer_failure: GPUError | None = None
        # Energy: exact integral, and an NVML-like counter updated at ticks tick0 + k * period.
        self._true_j = 0.0
        self._tick0 = now - rng.random() * energy_update_period_s
        self._tick = 0
        self._counter_j = 0.0
        self._counter_true_j = 0.0
        self._power_log = PowerLog()  # the power drawn, piece by piece: fine samples (power_bins)
        self._floors = PowerFloors(preset.idle_power_w)  # what `hold_power_floor` asked for

    # ------------------------------------------------------------------ host-side calls
    def now(self) -> float:
        return time.perf_counter() if self.pace else self._virtual_now

    def request_clock(self, target_mhz: int) -> None:
        """A locked clock (or the max clock for a reset) requested now; lands after the latency."""
        with self.cond:
            now = self._sync()
            self._locked.request(now, target_mhz)
            self.cond.notify_all()

    def set_power_cap(self, cap_mhz: int) -> None:
        """The highest clock the power limit allows, from now on (power capping is immediate)."""
        with self.cond:
            now = self._sync()
            self._cap.request(now, cap_mhz)
            self.cond.notify_all()

    def launch(self, seconds_at_max_clock: float, *, slowdown: float,
               planned_clock_mhz: int | None = None, after: Sequence[str] = (),
               publish: str | None = None) -> _Work:
        if not (math.isfinite(seconds_at_max_clock) and seconds_at_max_clock >= 0):
            raise GPUError(f"seconds_at_max_clock={seconds_at_max_clock!r}; it must be >= 0")
        if isinstance(after, str):
            raise GPUError(f"after={after!r} must be a sequence of keys, not one string")
        if (after or publish) and self.board is None:
            raise GPUError(
                "cross-rank dependencies (after=/publish=) need the device board: open the "
                "timeline with open_timeline(gpu, job_id=..., rank=...) on a paced simulated GPU "
                "(pace=False keeps a per-process virtual clock, which other ranks cannot share)"
            )
        with self.cond:
            self._sync()
            self._wait_until(lambda: len(self._queue) < self.queue_depth, None)  # CUDA's queue
            self._raise_peer_failure()
            self._launched += 1
            work = _Work(self._launched, float(seconds_at_max_clock), slowdown, planned_clock_mhz,
                         tuple(after), publish, self.now())
            self._queue.append(work)
            self._kick()
            return work

    def hold_power_floor(self, anchor: SimMarker, floors: Sequence[PowerFloor], hold_until_work_s: float = 0.0) -> None:
        """Hold the floors of one wait (at least idle + each one's watts) from the device time
        `anchor` is reached + its start to + its end, ending all of them when the device starts
        work launched after `anchor`; the latest-ending one holds on while the device still
        waits, at most `hold_until_work_s` past its end. Never waits for the device. Floors that
        overlap add up."""
        if anchor.device is not self:
            raise GPUError("hold_power_floor: the anchor is a marker of another device's timeline")
        with self.cond:
            self._floors.add(anchor, floors, hold_until_work_s)

    def record_marker(self) -> SimMarker:
        with self.cond:
            marker = SimMarker(self, self._launched, self.now())
            if self._completed >= marker.seq:
                marker.resolve(max(marker.recorded_at, self._last_end))
            else:
                self._markers.append(marker)
            return marker

    def synchronize(self) -> None:
        with self.cond:
            self._wait_until(lambda: not self._queue, None)
            self._raise_peer_failure()

    def wait_for(self, work: _Work) -> None:
        with self.cond:
            self._wait_until(lambda: work.end is not None, None)
            self._raise_peer_failure()

    def _raise_peer_failure(self) -> None:
        """Work waited on was dropped, not done: the host learns why (markers just resolve)."""
        if self._peer_failure is not None:
            raise self._peer_failure

    def idle(self, seconds: float) -> None:
        """Let `seconds` pass on the device's clock (the host does nothing for it)."""
        if seconds <= 0:
            return
        if self.pace:
            time.sleep(seconds)
        else:
            with self.cond:
                self._virtual_now += seconds

    def wait_marker(self, marker: SimMarker, timeout_s: float | None) -> bool:
        with self.cond:
            return self._wait_until(marker.query_locked, timeout_s)

    # ------------------------------------------------------------------ observations
    def true_energy_j(self) -> float:
        with self.cond:
            self._sync()
            return self._true_j

    def counter_j(self) -> float:
        with self.cond:
            self._sync()
            return self._counter_j

    def effective_clock(self) -> float:
        with self.cond:
            now = self._sync()
            return min(self._locked.value_at(now), self._cap.value_at(now))

    def power_w(self) -> float:
        with self.cond:
            now = self._sync()
            head = self._queue[0] if self._queue else None
            if head is not None and head.start is not None and head.start <= now:
                return self._floors.floored(self.preset.compute_power_w(self.effective_clock()), now, now)
            return self._floors.floored(self.preset.idle_power_w, now, now)

    def power_bins(self, start_s: float, end_s: float, period_s: float) -> tuple[int, np.ndarray] | None:
        """Mean power of each `period_s` bin of device time in [start_s, end_s) (`PowerLog.bins`)."""
        with self.cond:
            self._sync()
            return self._power_log.bins(start_s, end_s, period_s)

    def exact_energy_j(self, start_s: float, end_s: float) -> float | None:
        """The exact energy drawn over device time [start_s, end_s) (`PowerLog.energy_j`)."""
        with self.cond:
            self._sync()
            return self._power_log.energy_j(start_s, end_s)

    def tally(self) -> CoverageTally:
        with self.cond:
            self._sync()
            return CoverageTally(self._tally.planned_s, self._tally.covered_s)

    # ------------------------------------------------------------------ waiting
    def _wait_until(self, done: Callable[[], bool], timeout_s: float | None) -> bool:
        """Block until `done()` (lock held); in virtual time, jump the clock to that moment."""
        deadline = None if timeout_s is None else self.now() + timeout_s
        while not done():
            if self.pace:
                self._ensure_engine()
                if self._engine_failure is not None:
                    raise GPUError(
                        f"simulated device engine failed: {self._engine_failure!r}"
                    ) from self._engine_failure
                remaining = None if deadline is None else deadline - self.now()
                if remaining is not None and remaining <= 0:
                    return False
                self.cond.wait(remaining)
                continue
            upcoming = self._next_event()
            if upcoming is None:
                raise GPUError("simulated device: waiting for something the device will never do")
            if deadline is not None and upcoming > deadline:
                self._virtual_now = max(self._virtual_now, deadline)
                self._sync()
                return False
            self._virtual_now = max(self._virtual_now, upcoming)
            self._sync()
        return True

    def _kick(self) -> None:
        """New work or a new clock: the engine must re-plan (paced devices only)."""
        if not self.pace:
            self._sync()
            return
        self.cond.notify_all()
        self._ensure_engine()

    def _ensure_engine(self) -> None:
        if self._engine_failure is None and (self._engine is None or not self._engine.is_alive()):
            self._engine = start_background(
                threading.Thread(target=self._engine_loop, name="perseus-sim-device", daemon=True)
            )

    def _engine_loop(self) -> None:
        """Advance the device at each of its events; exit after ENGINE_LINGER_S with nothing to
        do (a later launch starts it again), so idle simulated GPUs hold no thread."""
        with self.cond:
            try:
                self._engine_events()
            except BaseException as failure:  # surfaced to every host thread waiting on it
                self._engine_failure = failure
                self._engine = None
                self.cond.notify_all()

    def _engine_events(self) -> None:
        """The engine's loop (lock held): sleep until the device's next event, advance to it."""
        idle_since: float | None = None
        while True:
            now = self._sync()
            upcoming = self._next_event()
            if upcoming is None:
                idle_since = now if idle_since is None else idle_since
                if now - idle_since >= ENGINE_LINGER_S:
                    self._engine = None
                    return
                self.cond.wait(ENGINE_LINGER_S - (now - idle_since))
                continue
            idle_since = None
            self.cond.wait(max(0.0, upcoming - self.now()))

    # ------------------------------------------------------------------ the device model
    def _sync(self) -> float:
        now = self.now()
        self._advance(now)
        return now

    def _next_event(self) -> float | None:
        """When the device state next changes by itself: the head's end, or the next poll."""
        if not self._queue:
            return None
        head = self._queue[0]
        start = head.start if head.start is not None else self._start_time(head)
        if start is None:  # waiting for another rank: poll, unless no board can ever tell
            return self.now() + POLL_S if self.board is not None else None
        return self._run(head, max(start, self._pos), math.inf, commit=False)

    def _start_time(self, work: _Work) -> float | None:
        """When `work` can start: launched, previous work done, dependencies arrived."""
        start = max(self._pos, work.launched_at)
        for key in work.after:
            published = self.board.lookup(key) if self.board is not None else None
            if published is None:
                return None
            start = max(start, published + self.board.transfer_s)
        return start

    def _advance(self, t: float) -> None:
        """Integrate the device up to `t`, completing everything that ends by then."""
        while True:
            if not self._queue:
                self._idle_until(t)
                break
            head = self._queue[0]
            if head.start is None:
                start = self._start_time(head)
                if start is None:  # waiting for a key: hold the recent past open (see above)
                    self._idle_until(t - DEPENDENCY_HOLD_S)
                    self._check_peer(head, t)
                    break
                self._blocked_since = None
                if start > t:
                    self._idle_until(t)
                    break
                self._idle_until(start)
                head.start = start
                self._floors.work_started(head.seq, start)
            end = self._run(head, self._pos, t, commit=True)
            if end is None:
                self._pos = t
                break
            self._pos = end
            self._complete(head, end)
        self._locked.prune(self._pos)
        self._cap.prune(self._pos)

    def _check_peer(self, head: _Work, t: float) -> None:
        """Fail the device when the head has waited for another rank's key past
        `peer_timeout_s`: its work and every later one are dropped unpublished (the peers
        learn nothing false), markers resolve now, and every host wait or launch raises."""
        if self._blocked_since is None:
            self._blocked_since = max(self._pos, head.launched_at, t - DEPENDENCY_HOLD_S)
        if self.peer_timeout_s is None or t - self._blocked_since <= self.peer_timeout_s:
            return
        missing = [key for key in head.after if self.board is None or self.board.lookup(key) is None]
        self._peer_failure = GPUError(
            f"simulated device: waited {t - self._blocked_since:.1f} s for {', '.join(missing)} from another rank, "
            f"more than perseus.control_timeout_s {self.peer_timeout_s:g} s; that rank is gone (its device "
            "work never arrives), so this device's work is dropped")
        for work in self._queue:
            work.end = t
        self._queue.clear()
        self._completed, self._last_end = self._launched, t
        while self._markers:
            marker = self._markers.popleft()
            marker.resolve(max(marker.recorded_at, t))
        self.cond.notify_all()

    def _segments(self, start: float, end: float) -> Iterator[tuple[float, float, float, float]]:
        """(from, to, locked clock, power cap) pieces of [start, end)."""
        cuts = sorted({*self._locked.breakpoints(start, end), *self._cap.breakpoints(start, end)})
        edges = [start, *cuts, end]
        for low, high in zip(edges, edges[1:]):
            yield low, high, self._locked.value_at(low), self._cap.value_at(low)

    def _run(self, work: _Work, start: float, limit: float, *, commit: bool) -> float | None:
        """Execute `work` from `start`; its end time if it ends before `limit`, else None.

        With commit, integrate energy and coverage and consume the work done."""
        remaining = work.remaining
        if remaining <= 0:
            return start
        for low, high, locked, cap in self._segments(start, limit):
            clock = min(locked, cap)
            seconds_per_unit = self.preset.time_factor(clock) * work.slowdown
            finish = low + remaining * seconds_per_unit
            upto = min(finish, high)
            if commit:
                self._account(low, upto, self.preset.compute_power_w(clock))
                if work.planned_clock_mhz is not None:
                    self._tally.planned_s += upto - low
                    if locked == work.planned_clock_mhz:
                        self._tally.covered_s += upto - low
            if finish <= high:
                if commit:
                    work.remaining = 0.0
                return finish
            remaining -= (high - low) / seconds_per_unit
        if commit:
            work.remaining = remaining
        return None

    def _idle_until(self, t: float) -> None:
        if t > self._pos:
            self._account(self._pos, t, self.preset.idle_power_w)
            self._pos = t

    def _complete(self, work: _Work, end: float) -> None:
        self._queue.popleft()
        work.end = end
        self._completed = work.seq
        self._last_end = end
        while self._markers and self._markers[0].seq <= work.seq:
            marker = self._markers.popleft()
            marker.resolve(max(marker.recorded_at, end))
        if work.publish is not None and self.board is not None:
            self.board.publish(work.publish, end)
        self.cond.notify_all()

    def _account(self, start: float, end: float, watts: float) -> None:
        """Integrate `watts`, raised to the power floors held over it, over [start, end)."""
        for low, high, floored in self._floors.pieces(start, end, watts):
            self._integrate(low, high, floored)

    def _integrate(self, start: float, end: float, watts: float) -> None:
        """Integrate `watts` over [start, end), updating the counter at each tick crossed."""
        self._power_log.add(start, end, watts)
        period = self.energy_update_period_s
        while True:
            tick_at = self._tick0 + (self._tick + 1) * period
            if tick_at > end:
                self._true_j += watts * (end - start)
                return
            self._true_j += watts * max(0.0, tick_at - start)
            start = max(start, tick_at)
            self._tick += 1
            increment = self._true_j - self._counter_true_j
            error = self.energy_noise * self._rng.gauss(0.0, 1.0)
            self._counter_j += max(0.0, increment * (1.0 + error))
            self._counter_true_j = self._true_j


class SimMarker(DeviceMarker):
    """A marker on a simulated device: reached when every computation launched before is done."""

    def __init__(self, device: SimDevice, seq: int, recorded_at: float) -> None:
        self.device = device
        self.seq = seq  # computations launched before it
        self.recorded_at = recorded_at
        self._reached_at: float | None = None

    def resolve(self, at_s: float) -> None:
        self._reached_at = at_s

    def query_locked(self) -> bool:
        return self._reached_at is not None

    def query(self) -> bool:
        if self._reached_at is None and not self.device.pace:
            with self.device.cond:
                self.device._sync()
        return self._reached_at is not None

    def wait(self, timeout_s: float | None = None) -> bool:
        if self._reached_at is not None:
            return True
        return self.device.wait_marker(self, timeout_s)

    def device_time_s(self) -> float | None:
        return self._reached_at
