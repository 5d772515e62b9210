"""Non-blocking GPU clock control for the training loop.

Why a worker *thread* (not a helper process): NVML set calls take ~10-20 ms but are ctypes calls
that release the GIL, so a thread applies them off the critical path for free, and the training
thread only pays for a `SimpleQueue.put` (a C call, reentrant, safe inside signal handlers). A
helper process would need IPC on every hook call; the one thing it adds -- surviving SIGKILL of
the trainer -- is covered by a tiny watchdog process that only restores clocks (watchdog.py).

Ordered by the device, not the host: CUDA is asynchronous, so the training thread launches a
computation long before the GPU runs it. A change is therefore queued together with a device
marker (a CUDA event recorded on the compute stream at a computation boundary) and the worker
applies it once the device *reaches* that marker -- the end of the previous computation -- never
when the host happened to launch the work. The worker also observes markers for measurement:
it reads the energy counter when the device reaches an iteration boundary, so per-iteration
time and energy follow the device's timeline without the training thread ever waiting.

Guarantees:
* `set_clock()` / `observe()` never block, never call NVML or CUDA, never raise.
* Changes apply in order; consecutive duplicates are skipped; when the worker falls behind,
  targets already superseded by a newer one whose marker the device has reached are skipped
  (applying a stale clock only delays the one the schedule needs now), and so is a change held
  back to land on time once a later one falls due first: a misplanned delay costs at most the
  computation it was aimed at, never the changes queued behind it (change_queue.py: when a
  queued change falls due; this module: what it does to the GPU).
* A failing device call is logged once, counted, and the controller falls back to the default
  clocks and stops touching the GPU; training goes on.
* Clocks and power limit are restored on close, normal exit (atexit), exceptions (context
  manager), SIGINT/SIGTERM (handler, then the previous handler runs; a watcher thread restores
  when the main thread is blocked in a collective, see exit_guard.py) and SIGKILL (watchdog).
* A restore that fails is retried (restore.py: a few quick attempts, then every RESTORE_RETRY_S while
  training goes on); one still unfinished at close is handed to the watchdog, which keeps
  retrying after the job ends, and the log says the GPU is still locked -- never that it runs at
  default clocks. The watchdog is told each clock and power limit this job sets, and only undoes
  a setting the GPU still holds, never one another job has made since.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from perseus_ext.actuation.change_queue import (
    RESET,
    STOP,
    Barrier,
    ChangeQueue,
    ClockAt,
    Item,
    PowerLimitAt,
    RecoveryOverride,
    Reset,
    due_s,
    superseded,
)
from perseus_ext.actuation.exit_guard import register, unregister
from perseus_ext.actuation.issue_delay import IssueDelay
from perseus_ext.actuation.observer import DeviceObserver, Observation, wait_for_marker
from perseus_ext.actuation.restore import JOIN_TIMEOUT_S, ClockWrites
from perseus_ext.actuation.watchdog import WatchdogMessage
from perseus_ext.background import start_background
from perseus_ext.measurement.gpu import (
    GPU,
    SIMULATED_HINT,
    GPUError,
    GPUUnavailableError,
    gpu_switch_latency,
    open_gpu,
)
from perseus_ext.measurement.gpu.capture_mode import ignore_other_threads_captures
from perseus_ext.measurement.gpu.common import StrictControlError

if TYPE_CHECKING:
    from perseus_ext.measurement.gpu.timeline import DeviceMarker

logger = logging.getLogger(__name__)

DRY_RUN_LOG_LIMIT = 1_000_000  # entries kept in dry_run_log; beyond it only dry_run_count grows
CHANGE_LOG_LIMIT = 100_000  # timestamped clock changes kept for clock-coverage estimates
CALL_TIMES_KEPT = 1000  # durations of the latest set calls kept (live runs)
OVERRIDE_POLL_S = 0.002  # waiting on a slowed plan's change: how often a recovery override is checked


@dataclass(frozen=True)
class ClockChange:
    """One clock change as the worker issued it (applied, or recorded in dry-run)."""

    issued_s: float  # when the set call returned (perf_counter, the clock device times align to)
    mhz: int | None  # None: back to the default clocks


class FrequencyController:
    """Applies SM clock targets from the training thread to a GPU, off the critical path."""

    def __init__(
        self,
        gpu: GPU | None,
        *,
        strict: bool = False,
        dry_run: bool | None = None,
        watchdog: bool = True,
        handle_signals: bool = True,
        dry_run_call_s: float | None = None,
    ) -> None:
        """gpu None means no usable device: everything is recorded, nothing is applied.

        dry_run None = decide from `gpu.can_set_clocks()`: without the privilege, warn once and
        record clocks instead of setting them; with `strict=True`, raise StrictControlError (a
        ConfigError and a GPUPermissionError) naming what is missing.

        dry_run_call_s: how long a set call would keep the worker busy (None: the GPU's
        `gpu_switch_latency(gpu).call_s`). A dry-run change is recorded that long after it is
        issued, and the worker is held as long, so coverage estimated from a dry-run, and the
        issue delay it learns, are what a live run would get.
        """
        self.gpu = gpu
        self.strict = strict
        self.error_count = 0
        self.dropped_count = 0  # requests ignored because the controller was disabled/closed
        self.stale_skipped = 0  # targets superseded before the worker reached them
        self.overridden_skipped = 0  # changes of a slowed plan overridden by its recovery program
        self.override = RecoveryOverride()  # straggler episodes whose slowed plans no longer run
        self.issue_delay = IssueDelay()  # how late marker-tied changes go out (the sequencer issues earlier)
        self.applied_count = 0
        self.dry_run_log: list[int] = []
        self.dry_run_count = 0
        self.dry_run_power_limits: list[float] = []
        self.changes: collections.deque[ClockChange] = collections.deque(maxlen=CHANGE_LOG_LIMIT)
        # live runs: how long each clock set/reset call took (the dry-run default's ground truth)
        self.set_call_s: collections.deque[float] = collections.deque(maxlen=CALL_TIMES_KEPT)
        if dry_run_call_s is None:
            dry_run_call_s = gpu_switch_latency(gpu).call_s if gpu is not None else 0.0
        self.dry_run_call_s = float(dry_run_call_s)
        self.last_error: BaseException | None = None
        self.disabled_reason: str | None = None
        self._logged: set[str] = set()
        self._closed = False
        self._last_requested: tuple[int, int | None] | None = None  # (MHz, straggler episode)
        self._epoch = 0  # bumped by release_silent(): changes queued before are dropped
        self.writes: ClockWrites | None = None  # the device writes and their restore (restore.py)
        self._closer: int | None = None  # thread that runs close(); a re-entrant call returns
        self._close_done = threading.Event()
        self._queue = ChangeQueue()  # when each request falls due: change_queue.py
        self._stopping = False
        self._worker: threading.Thread | None = None
        self.observer: DeviceObserver | None = None
        self.dry_run = self._decide_dry_run(dry_run)
        if gpu is not None:
            self.writes = ClockWrites(gpu, live=not self.dry_run, note_error=self._note_error,
                                      count_error=self._count_error)
        if not self.dry_run:
            self.writes.read_initial_power_limit()
        if self.gpu is not None:
            # Also in dry-run: the worker records changes in device order. The observer is its
            # own thread so a change held back to land on time never delays a measurement.
            self._worker = start_background(
                threading.Thread(target=self._work, name="perseus-clock-controller", daemon=True)
            )
            self.observer = DeviceObserver(self.gpu, self._note_error)
        if not self.dry_run and watchdog:
            self.writes.start_watchdog()
        register(self, handle_signals)

    # ----------------------------------------------------------------- setup
    def _decide_dry_run(self, dry_run: bool | None) -> bool:
        if self.gpu is None:
            if self.strict:
                raise GPUUnavailableError(f"strict mode: no GPU to control; {SIMULATED_HINT}")
            return True  # nothing to apply clocks to, whatever was asked
        if dry_run is not None:
            return dry_run
        try:
            allowed = self.gpu.can_set_clocks()
        except GPUError as err:
            if self.strict:
                raise
            self._note_error("probe", err, "could not probe GPU clock permission",
                             "running in DRY-RUN mode at default clocks")
            return True
        if allowed:
            return False
        message = f"{self.gpu.name}: this process may not change GPU clocks; {self.gpu.control_help()}"
        if self.strict:
            raise StrictControlError(message + " (strict mode: not falling back to dry-run)")
        logger.warning(
            "%s. Running in DRY-RUN mode: the clocks perseus-ext would set are recorded "
            "(FrequencyController.dry_run_log), the GPU stays at its default clocks.",
            message,
        )
        return True

    # ----------------------------------------------------------------- hook path
    def set_clock(self, mhz: int, at: DeviceMarker | None = None, after_s: float = 0.0,
                  by: DeviceMarker | None = None, episode: int | None = None) -> None:
        """Ask for SM clock `mhz` `after_s` seconds after the device reaches `at` (None: as soon
        as possible), and no later than when it reaches `by`; returns at once, never raises. A
        positive `after_s` lets the caller issue a change ahead of a computation by the
        switching latency, so it lands on time; `by` bounds how late a delay planned from
        timings that no longer hold can make it. `episode`: the straggler episode it serves."""
        if (mhz, episode) == self._last_requested:
            return
        self._last_requested = (mhz, episode)
        if self.dry_run:
            self.dry_run_count += 1
            if len(self.dry_run_log) < DRY_RUN_LOG_LIMIT:
                self.dry_run_log.append(mhz)
        elif self._closed or self.disabled_reason is not None:
            self.dropped_count += 1
            return
        if self._worker is not None and not self._closed:
            self._queue.put(ClockAt(mhz, at, after_s, by, self._epoch, episode))

    def queue_recovery(self, mhz: int, at: DeviceMarker, episode: int) -> None:
        """Straggler `episode`'s recovery program: `mhz` from marker `at` on, once `recover(episode)`."""
        if self._worker is not None and not self._closed and self.disabled_reason is None:
            self._queue.put(ClockAt(mhz, at, epoch=self._epoch, episode=episode, recovery=True))

    def recover(self, episode: int) -> bool:
        """Straggler `episode` recovered: its recovery program replaces its slowed plan for every
        change the device has not reached (change_queue.RecoveryOverride). Any thread, non-blocking."""
        if not self.override.activate(episode):
            return False
        if self._worker is not None and not self._closed:
            self._queue.put(Barrier(threading.Event()))  # an idle worker wakes to catch up
        return True

    def reset(self, at: DeviceMarker | None = None) -> None:
        """Ask for the default (unlocked) clocks from marker `at` on; non-blocking."""
        self._last_requested = None
        if self._worker is not None and not self._closed:
            self._queue.put(ClockAt(RESET, at, epoch=self._epoch))

    def release_silent(self) -> None:
        """The hooks fell silent with a clock held (silence.py): drop every change queued so far
        -- including any waiting for a marker the device may never reach -- and unlock the
        clocks at once. Changes asked for afterwards apply as usual; never blocks."""
        self._epoch += 1
        self._last_requested = None
        if self._worker is not None and not self._closed:
            self._queue.put(ClockAt(RESET, None, epoch=self._epoch))

    def observe(self, at: DeviceMarker, tag: Any) -> None:
        """Time and meter the moment the device reaches `at`; collect with `observations()`."""
        if self.observer is not None and not self._closed:
            self.observer.observe(at, tag)

    def observations(self) -> list[Observation]:
        """Everything observed since the last call, in device order; never blocks."""
        return self.observer.observations() if self.observer is not None else []

    def drain_changes(self) -> list[ClockChange]:
        """The clock changes issued since the last call, oldest first; never blocks."""
        drained = []
        while self.changes:
            drained.append(self.changes.popleft())
        return drained

    def set_power_limit(self, watts: float) -> None:
        """Ask for a power limit (power-limit mode); non-blocking, restored on close."""
        if self.dry_run:
            self.dry_run_power_limits.append(float(watts))
        elif self._closed:
            self.dropped_count += 1
        else:
            self._queue.put(PowerLimitAt(float(watts)))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is done (its markers reached); False if
        `timeout` ran out. Blocks the caller: only for profiling, tests and shutdown."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        done = []
        if self._worker is not None and self._worker.is_alive():
            barrier = Barrier(threading.Event())
            self._queue.put(barrier)
            done.append(barrier.done)
        if self.observer is not None and (event := self.observer.barrier()) is not None:
            done.append(event)
        for event in done:
            remaining = None if deadline is None else max(0.0, deadline - time.perf_counter())
            if not event.wait(remaining):
                return False
        return True

    @property
    def current_clock(self) -> int | None:
        """The clock last applied (None: default clocks)."""
        return self.writes.applied_clock if self.writes is not None else None

    @property
    def restore_error(self) -> str | None:
        """Why a restore is unfinished (None: nothing of ours is left on the GPU)."""
        return self.writes.restore_error if self.writes is not None else None

    # ----------------------------------------------------------------- worker
    def _work(self) -> None:
        while True:
            batch = self._queue.next_batch()
            if self.writes is not None and self.writes.restore_due():
                self._restore()  # a GPU left locked after a failure: keep trying while we run
            if self._run_batch(batch):
                return

    def _run_batch(self, batch: list[Item]) -> bool:
        """Process queue items in order; True once the worker must end."""
        ignore_other_threads_captures()  # its marker queries must not break a graph capture
        index = -1
        while (index := index + 1) < len(batch):
            now, later = self.override.catch_up(self._epoch)
            if now is not None:  # the computation the device runs now: its recovery clock at once
                self._apply_clock(now.target)
            batch[index:index] = later  # the recovery program's changes still ahead, in order
            item = batch[index]
            if item is STOP:
                self._restore()
                for rest in batch[index + 1:]:
                    if isinstance(rest, Barrier):
                        rest.done.set()
                return True
            if isinstance(item, Barrier):
                item.done.set()
            elif isinstance(item, PowerLimitAt):
                self._apply_power_limit(item.watts)
            elif isinstance(item, ClockAt):
                applies = self.override.applies
                if not applies(item):
                    self.overridden_skipped += self.override.pass_by(item)
                elif item.epoch != self._epoch or superseded(item, batch[index + 1:], applies):
                    self.stale_skipped += 1
                elif self._reach(item):
                    due = self._queue.wait_until_due(item, batch, index, lambda: self._dropped(item), applies)
                    if due is None:
                        self.stale_skipped += 1
                    elif due:
                        issued_s = time.perf_counter()
                        due_at_s = due_s(item)
                        if self._apply_clock(item.target) and due_at_s is not None:
                            self.issue_delay.record(issued_s - due_at_s)
                elif not applies(item):  # overridden while the worker waited for its marker
                    self.overridden_skipped += 1
        return False

    def _dropped(self, item: ClockAt) -> bool:  # stopping, release_silent(), or its episode overridden
        return self._stopping or item.epoch != self._epoch or not self.override.applies(item)

    def _reach(self, item: ClockAt) -> bool:
        """Block this worker until the device reaches `item`'s marker; False when stopping, or
        when `release_silent()` or a recovery override dropped the item, first."""
        if item.at is None:
            return True
        return wait_for_marker(item.at, lambda: self._dropped(item), lambda err: self._note_error(
            "marker", err, "could not wait for a device marker", "its clock change happens at once instead"),
            **({} if item.episode is None else {"poll_s": OVERRIDE_POLL_S}))

    def _apply_clock(self, target: int | Reset) -> bool:
        """Set (or, in dry-run, record) `target`; True if a change went out."""
        assert self.gpu is not None
        if self.disabled_reason is not None:
            self.dropped_count += 1
            return False
        mhz = None if target is RESET else target
        if mhz == self.writes.applied_clock:
            return False
        if self.dry_run:  # recorded with its device-ordered time, for coverage estimates
            if self.dry_run_call_s > 0:
                time.sleep(self.dry_run_call_s)  # busy as long as the set call would keep it
            self.writes.applied_clock = mhz
            self.changes.append(ClockChange(time.perf_counter(), mhz))
            return True
        began = time.perf_counter()
        try:
            self.writes.unlock() if mhz is None else self.writes.lock(mhz)
        except Exception as err:  # any device failure must stay out of the training step
            self._fail("set", err, f"could not {'reset' if mhz is None else f'set {mhz} MHz'}")
            return False
        self.set_call_s.append(time.perf_counter() - began)
        self.applied_count += 1
        self.changes.append(ClockChange(time.perf_counter(), mhz))
        return True

    def _apply_power_limit(self, watts: float) -> None:
        assert self.gpu is not None
        if self.disabled_reason is not None:
            self.dropped_count += 1
            return
        try:
            self.writes.power_dirty = True
            self.writes.tell_watchdog(WatchdogMessage.power(watts))
            self.gpu.set_power_limit_w(watts)
            self.writes.tell_watchdog(WatchdogMessage.power_held(watts))
        except Exception as err:
            self._fail("set", err, f"could not set the power limit to {watts} W")

    def _fail(self, kind: str, err: BaseException, what: str) -> None:
        """A device call failed: log once, count, go back to defaults and stop touching the GPU."""
        self._note_error(kind, err, what, "perseus-ext stops changing this GPU's clocks and restores its defaults")
        self.disabled_reason = f"{what}: {err}"
        self._restore()

    def _restore(self) -> bool:
        """Undo every clock and power limit this job set (`ClockWrites.restore`); never raises."""
        return self.writes.restore() if self.writes is not None else True

    def _count_error(self) -> None:
        self.error_count += 1

    def _note_error(self, kind: str, err: BaseException, what: str, outcome: str) -> None:
        self.error_count += 1
        self.last_error = err
        key = f"{kind}:{type(err).__name__}"
        if key not in self._logged:
            self._logged.add(key)
            name = self.gpu.name if self.gpu is not None else "GPU"
            logger.warning(
                "perseus-ext: %s: %s (%s); %s. Further errors of this kind are only counted "
                "(FrequencyController.error_count).", name, what, err, outcome,
            )

    # ----------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Restore default clocks and the original power limit, stop the worker; idempotent.
        A second caller on another thread (signal watcher vs. main thread) waits for the first;
        a re-entrant call (a signal handler interrupting close()) returns at once."""
        if self._closed:
            if self._closer != threading.get_ident():
                self._close_done.wait(2 * JOIN_TIMEOUT_S)
            return
        self._closed = True
        self._closer = threading.get_ident()
        self._stopping = True  # a worker waiting on a marker the device never reaches gives up
        worker = self._worker
        hung = False
        if worker is not None and worker.is_alive():
            if worker is threading.current_thread():
                self._restore()
            else:
                self._queue.put(STOP)
                worker.join(JOIN_TIMEOUT_S)
                hung = worker.is_alive()
                if hung:  # hung device call: restore from here as a last resort
                    self._restore()
        elif self.restore_error is not None:
            self._restore()
        if self.observer is not None:
            self.observer.close()
        if self.writes is not None:
            self.writes.stop_watchdog(hand_over=self.restore_error is not None, worker_hung=hung)
        unregister(self)
        self._close_done.set()

    def __enter__(self) -> "FrequencyController":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "dry-run" if self.dry_run else "live"
        return (
            f"FrequencyController({self.gpu!r}, {mode}, applied={self.applied_count}, "
            f"errors={self.error_count})"
        )


def open_controller(
    spec: str | None = None,
    *,
    local_rank: int = 0,
    strict: bool = False,
    dry_run: bool | None = None,
    watchdog: bool = True,
) -> FrequencyController:
    """Open this rank's GPU and a controller on it; a GPU that cannot be opened means dry-run.

    Non-strict: if the device layer fails (no NVML, NVML init error, MIG...), one warning is
    logged and the returned controller records clocks without a device, so training runs at
    default clocks. Strict: the GPUError is raised.
    """
    try:
        gpu = open_gpu(spec, local_rank=local_rank)
    except GPUError as err:
        if strict:
            raise
        logger.warning(
            "perseus-ext: no GPU clock control (%s); running in DRY-RUN mode at default clocks", err
        )
        controller = FrequencyController(None, dry_run=True, watchdog=False)
        controller.error_count = 1
        controller.last_error = err
        return controller
    return FrequencyController(gpu, strict=strict, dry_run=dry_run, watchdog=watchdog)

