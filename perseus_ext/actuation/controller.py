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
  (applying a stale clock only delays the one the schedule needs now).
* A failing device call is logged once, counted, and the controller falls back to the default
  clocks and stops touching the GPU; training goes on.
* Clocks and power limit are restored on close, normal exit (atexit), exceptions (context
  manager), SIGINT/SIGTERM (handler, then the previous handler runs) and SIGKILL (watchdog).
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from perseus_ext.measurement.gpu import (
    GPU,
    PERMISSION_HELP,
    SIMULATED_HINT,
    GPUError,
    GPUPermissionError,
    GPUUnavailableError,
    open_gpu,
)

if TYPE_CHECKING:
    from perseus_ext.measurement.gpu.timeline import DeviceMarker

logger = logging.getLogger(__name__)

DRY_RUN_LOG_LIMIT = 1_000_000  # entries kept in dry_run_log; beyond it only dry_run_count grows
CHANGE_LOG_LIMIT = 100_000  # timestamped clock changes kept for clock-coverage estimates
JOIN_TIMEOUT_S = 10.0
MARKER_POLL_S = 0.05  # how often a worker waiting on a marker checks whether it must stop


class _Reset:
    """Clock target: unlock the SM clock (the driver default)."""


@dataclass(frozen=True)
class _ClockAt:
    """Queue item: apply `target` (MHz or _RESET) once the device reaches `at` (None: now)."""

    target: Any
    at: DeviceMarker | None


@dataclass(frozen=True)
class _Observe:
    """Queue item: note when the device reached `at` and read the energy counter there."""

    tag: Any
    at: DeviceMarker


@dataclass(frozen=True)
class _PowerLimit:
    watts: float


@dataclass(frozen=True)
class Observation:
    """What the worker saw when the device reached an observed marker."""

    tag: Any
    device_time_s: float  # when the device reached the marker (GPU.timestamp() clock)
    noticed_s: float  # when the worker noticed (perf_counter): the notice delay is the difference
    energy_mj: int | None  # the energy counter read right after noticing (None: no GPU or a failed read)


@dataclass(frozen=True)
class ClockChange:
    """One clock change as the worker issued it (applied, or recorded in dry-run)."""

    issued_s: float  # when the set call returned (perf_counter, the clock device times align to)
    mhz: int | None  # None: back to the default clocks


@dataclass(frozen=True)
class _Barrier:
    done: threading.Event


class _Stop:
    """Queue item: restore everything and end the worker."""


_RESET = _Reset()
_STOP = _Stop()


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
    ) -> None:
        """gpu None means no usable device: everything is recorded, nothing is applied.

        dry_run None = decide from `gpu.can_set_clocks()`: without the privilege, warn once and
        record clocks instead of setting them; with `strict=True`, raise GPUPermissionError.
        """
        self.gpu = gpu
        self.strict = strict
        self.error_count = 0
        self.dropped_count = 0  # requests ignored because the controller was disabled/closed
        self.stale_skipped = 0  # targets superseded before the worker reached them
        self.applied_count = 0
        self.dry_run_log: list[int] = []
        self.dry_run_count = 0
        self.dry_run_power_limits: list[float] = []
        self.changes: collections.deque[ClockChange] = collections.deque(maxlen=CHANGE_LOG_LIMIT)
        self.last_error: BaseException | None = None
        self.disabled_reason: str | None = None
        self._logged: set[str] = set()
        self._closed = False
        self._last_requested: int | None = None
        self._applied_clock: int | None = None
        self._clock_touched = False
        self._initial_power_limit: float | None = None
        self._power_touched = False
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._observations: collections.deque[Observation] = collections.deque()
        self._stopping = False
        self._worker: threading.Thread | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self.dry_run = self._decide_dry_run(dry_run)
        if not self.dry_run:
            self._initial_power_limit = self._read_power_limit()
        if self.gpu is not None:
            # Also in dry-run: the worker still follows the device to time and meter it.
            self._worker = threading.Thread(
                target=self._work, name="perseus-clock-controller", daemon=True
            )
            self._worker.start()
        if not self.dry_run and watchdog:
            self._start_watchdog()
        _register(self, handle_signals)

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
            self._note_error("probe", err, "could not probe GPU clock permission")
            return True
        if allowed:
            return False
        message = (
            f"{self.gpu.name}: this process may not change GPU clocks; {PERMISSION_HELP}"
        )
        if self.strict:
            raise GPUPermissionError(message + " (strict mode: not falling back to dry-run)")
        logger.warning(
            "%s. Running in DRY-RUN mode: the clocks perseus-ext would set are recorded "
            "(FrequencyController.dry_run_log), the GPU stays at its default clocks.",
            message,
        )
        return True

    def _read_power_limit(self) -> float | None:
        assert self.gpu is not None
        try:
            return self.gpu.power_limit_w()
        except GPUError as err:
            self._note_error("read", err, "could not read the power limit to restore later")
            return None

    def _start_watchdog(self) -> None:
        assert self.gpu is not None
        spec = self.gpu.restore_spec()
        if spec is None:
            logger.debug("%s: no restore spec, no SIGKILL watchdog needed", self.gpu.name)
            return
        spec = dict(spec, power_limit_w=self._initial_power_limit)
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-m", "perseus_ext.actuation.watchdog", json.dumps(spec),
                 str(os.getpid())],
                stdin=subprocess.PIPE,
                start_new_session=True,  # a Ctrl-C to the job must not kill it before we die
                env=_env_with_package_path(),
            )
        except OSError as err:
            self._note_error("watchdog", err, "could not start the clock-restoring watchdog")

    # ----------------------------------------------------------------- hook path
    def set_clock(self, mhz: int, at: DeviceMarker | None = None) -> None:
        """Ask for SM clock `mhz` from the moment the device reaches `at` (None: as soon as
        possible); returns at once, never raises."""
        if mhz == self._last_requested:
            return
        self._last_requested = mhz
        if self.dry_run:
            self.dry_run_count += 1
            if len(self.dry_run_log) < DRY_RUN_LOG_LIMIT:
                self.dry_run_log.append(mhz)
        elif self._closed or self.disabled_reason is not None:
            self.dropped_count += 1
            return
        if self._worker is not None and not self._closed:
            self._queue.put(_ClockAt(mhz, at))

    def reset(self, at: DeviceMarker | None = None) -> None:
        """Ask for the default (unlocked) clocks from marker `at` on; non-blocking."""
        self._last_requested = None
        if self._worker is not None and not self._closed:
            self._queue.put(_ClockAt(_RESET, at))

    def observe(self, at: DeviceMarker, tag: Any) -> None:
        """Time and meter the moment the device reaches `at`; collect with `observations()`."""
        if self._worker is not None and not self._closed:
            self._queue.put(_Observe(tag, at))

    def observations(self) -> list[Observation]:
        """Everything observed since the last call, in device order; never blocks."""
        seen = []
        while self._observations:
            seen.append(self._observations.popleft())
        return seen

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
            self._queue.put(_PowerLimit(float(watts)))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is done (its markers reached); False if
        `timeout` ran out. Blocks the caller: only for profiling, tests and shutdown."""
        if self._worker is None or not self._worker.is_alive():
            return True
        barrier = _Barrier(threading.Event())
        self._queue.put(barrier)
        return barrier.done.wait(timeout)

    @property
    def current_clock(self) -> int | None:
        """The clock last applied (None: default clocks)."""
        return self._applied_clock

    # ----------------------------------------------------------------- worker
    def _work(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if self._run_batch(batch):
                return

    def _run_batch(self, batch: list[Any]) -> bool:
        """Process queue items in order; True once the worker must end."""
        for index, item in enumerate(batch):
            if item is _STOP:
                self._restore()
                for rest in batch[index + 1:]:
                    if isinstance(rest, _Barrier):
                        rest.done.set()
                return True
            if isinstance(item, _Barrier):
                item.done.set()
            elif isinstance(item, _PowerLimit):
                self._apply_power_limit(item.watts)
            elif isinstance(item, _Observe):
                if self._reach(item.at):
                    self._record_observation(item)
            elif isinstance(item, _ClockAt):
                if self._superseded(item, batch[index + 1:]):
                    self.stale_skipped += 1
                elif self._reach(item.at):
                    self._apply_clock(item.target)
        return False

    @staticmethod
    def _superseded(item: _ClockAt, later: list[Any]) -> bool:
        """A newer clock target whose marker the device has already passed makes this one stale."""
        return any(isinstance(other, _ClockAt) and (other.at is None or other.at.query())
                   for other in later)

    def _reach(self, marker: DeviceMarker | None) -> bool:
        """Block this worker until the device reaches `marker`; False when stopping first."""
        if marker is None:
            return True
        while not self._stopping:
            try:
                if marker.wait(MARKER_POLL_S):
                    return True
            except Exception as err:  # a broken event must not kill the worker
                self._note_error("marker", err, "could not wait for a device marker")
                return True
        return False

    def _record_observation(self, item: _Observe) -> None:
        noticed = time.perf_counter()
        reached = item.at.device_time_s()
        energy = None
        if self.gpu is not None:
            try:
                energy = self.gpu.energy_mj()
            except Exception as err:
                self._note_error("read", err, "could not read the energy counter")
        self._observations.append(Observation(item.tag, noticed if reached is None else reached, noticed, energy))

    def _apply_clock(self, target: int | _Reset) -> None:
        assert self.gpu is not None
        if self.disabled_reason is not None:
            self.dropped_count += 1
            return
        mhz = None if target is _RESET else target
        if mhz == self._applied_clock:
            return
        if self.dry_run:  # recorded with its device-ordered time, for coverage estimates
            self._applied_clock = mhz
            self.changes.append(ClockChange(time.perf_counter(), mhz))
            return
        try:
            if mhz is None:
                self.gpu.reset_locked_sm_clocks()
            else:
                self._clock_touched = True
                self.gpu.set_locked_sm_clocks(mhz)
        except Exception as err:  # any device failure must stay out of the training step
            self._fail("set", err, f"could not {'reset' if mhz is None else f'set {mhz} MHz'}")
            return
        self._applied_clock = mhz
        self.applied_count += 1
        self.changes.append(ClockChange(time.perf_counter(), mhz))

    def _apply_power_limit(self, watts: float) -> None:
        assert self.gpu is not None
        if self.disabled_reason is not None:
            self.dropped_count += 1
            return
        try:
            self._power_touched = True
            self.gpu.set_power_limit_w(watts)
        except Exception as err:
            self._fail("set", err, f"could not set the power limit to {watts} W")

    def _fail(self, kind: str, err: BaseException, what: str) -> None:
        """A device call failed: log once, count, go back to defaults and stop touching the GPU."""
        self._note_error(kind, err, what)
        self.disabled_reason = f"{what}: {err}"
        self._restore()

    def _restore(self) -> None:
        """Unlock clocks and put the power limit back; each failure is counted, never raised."""
        gpu = self.gpu
        if gpu is None or self.dry_run:
            return
        if self._clock_touched or self._applied_clock is not None:
            try:
                gpu.reset_locked_sm_clocks()
                self._applied_clock = None
            except Exception as err:
                self._note_error("restore", err, "could not reset locked clocks")
        if self._power_touched and self._initial_power_limit is not None:
            try:
                gpu.set_power_limit_w(self._initial_power_limit)
            except Exception as err:
                self._note_error("restore", err, "could not restore the power limit")

    def _note_error(self, kind: str, err: BaseException, what: str) -> None:
        self.error_count += 1
        self.last_error = err
        key = f"{kind}:{type(err).__name__}"
        if key not in self._logged:
            self._logged.add(key)
            name = self.gpu.name if self.gpu is not None else "GPU"
            logger.warning(
                "perseus-ext: %s: %s (%s); training continues at default clocks. Further errors "
                "of this kind are only counted (FrequencyController.error_count).",
                name, what, err,
            )

    # ----------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Restore default clocks and the original power limit, stop the worker; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True  # a worker waiting on a marker the device never reaches gives up
        worker = self._worker
        if worker is not None and worker.is_alive():
            if worker is threading.current_thread():
                self._restore()
            else:
                self._queue.put(_STOP)
                worker.join(JOIN_TIMEOUT_S)
                if worker.is_alive():  # hung device call: restore from here as a last resort
                    self._restore()
        self._stop_watchdog()
        _unregister(self)

    def _stop_watchdog(self) -> None:
        watchdog = self._watchdog
        if watchdog is None:
            return
        self._watchdog = None
        try:
            assert watchdog.stdin is not None
            watchdog.stdin.write(b"clean\n")
            watchdog.stdin.close()
            watchdog.wait(JOIN_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as err:
            logger.debug("watchdog did not stop cleanly: %s", err)

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


def _env_with_package_path() -> dict[str, str]:
    """Environment for the watchdog so it imports this very copy of perseus_ext."""
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


# --------------------------------------------------------------------------- process-wide restore
_live: "weakref.WeakSet[FrequencyController]" = weakref.WeakSet()
_previous_handlers: dict[int, Any] = {}
_registry_lock = threading.Lock()
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def close_all() -> None:
    """Restore every live controller of this process (atexit and signal path)."""
    for controller in list(_live):
        controller.close()


def _register(controller: FrequencyController, handle_signals: bool) -> None:
    with _registry_lock:
        _live.add(controller)
        if handle_signals and threading.current_thread() is threading.main_thread():
            for signum in _HANDLED_SIGNALS:
                if signum in _previous_handlers:
                    continue
                previous = signal.getsignal(signum)
                if previous is signal.SIG_IGN or previous is None:
                    continue  # ignored (or set outside Python): do not make it fatal
                _previous_handlers[signum] = previous
                signal.signal(signum, _on_signal)


def _unregister(controller: FrequencyController) -> None:
    _live.discard(controller)
    if _live or threading.current_thread() is not threading.main_thread():
        return
    for signum, previous in list(_previous_handlers.items()):
        if signal.getsignal(signum) is _on_signal:
            signal.signal(signum, previous)
        del _previous_handlers[signum]


def _on_signal(signum: int, frame: Any) -> None:
    """Restore clocks first, then let the signal do what it did before (usually: end us)."""
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    close_all()
    if callable(previous):
        previous(signum, frame)
    else:  # SIG_DFL: re-deliver with the default action
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


atexit.register(close_all)
