"""What a `FrequencyController` writes to its GPU, and the guarantee that it is undone.

The controller's worker decides *when* a clock or power limit goes out (controller.py);
`ClockWrites` makes the device calls and keeps what they leave behind: the clock this job locked,
whether a lock or power limit may have landed, and the power limit to return to. Every write is
told to the SIGKILL watchdog before it is made (it may land) and after it did (watchdog.py), so
the watchdog only ever undoes a setting the GPU still holds from this job. `restore()` undoes
everything, each call retried a few times (`RESTORE_ATTEMPTS`); an unfinished restore is
reported once as what it is, retried every `RESTORE_RETRY_S` while training goes on, and handed
to the watchdog at close (`stop_watchdog(hand_over=True)`), which keeps retrying for
`WATCHDOG_RETRY_FOR_S` after the job ends.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from perseus_ext.actuation.watchdog import Report, WatchdogLink, WatchdogMessage, WatchdogOrders, start_watchdog
from perseus_ext.measurement.gpu import GPU, GPUError

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0
RESTORE_ATTEMPTS = 3  # quick attempts per restore; a transient NVML error rarely outlasts them
RESTORE_BACKOFF_S = 0.05  # pause after the first failed attempt, doubled after each one
RESTORE_RETRY_S = 5.0  # while training goes on, how often an unfinished restore is tried again
WATCHDOG_RETRY_FOR_S = 300.0  # how long the watchdog retries a restore handed over at close
WATCHDOG_RETRY_INTERVAL_S = 2.0
POWER_MATCH_W = 0.5  # a power limit read back within this of one this job set is still ours

ErrorNote = Callable[[str, BaseException, str, str], None]  # (kind, error, what failed, what happens now)


class ClockWrites:
    """One GPU's clock and power-limit writes, their restore and the watchdog that backs it."""

    def __init__(self, gpu: GPU, *, live: bool, note_error: ErrorNote, count_error: Callable[[], None]) -> None:
        """live False (dry-run): nothing is ever written, so there is nothing to restore."""
        self.gpu = gpu
        self.live = live
        self._note_error = note_error
        self._count_error = count_error
        self.applied_clock: int | None = None  # the clock in force (dry-run: the one recorded)
        self.clock_dirty = False  # a lock was attempted since the last successful reset
        self.initial_power_limit: float | None = None
        self.power_dirty = False  # a power limit was attempted since the last successful restore
        self.restore_error: str | None = None  # set while a failed restore is unfinished
        self.restore_tried_s = 0.0
        self.watchdog: WatchdogLink | None = None

    def restore_due(self) -> bool:
        """An unfinished restore whose next try is due (the worker tries it while training goes on)."""
        return self.restore_error is not None and time.monotonic() - self.restore_tried_s >= RESTORE_RETRY_S

    def read_initial_power_limit(self) -> None:
        """The power limit before this job, to restore later (None: the GPU's default)."""
        try:
            self.initial_power_limit = self.gpu.power_limit_w()
        except GPUError as err:
            self._note_error("read", err, "could not read the power limit to restore later",
                             "a power limit set later is restored to the GPU's default")

    def start_watchdog(self) -> None:
        spec = self.gpu.restore_spec()
        if spec is None:
            logger.debug("%s: no restore spec, no SIGKILL watchdog needed", self.gpu.name)
            return
        orders = WatchdogOrders(target=spec, power_limit_w=self.initial_power_limit, retry_for_s=WATCHDOG_RETRY_FOR_S,
                                retry_interval_s=WATCHDOG_RETRY_INTERVAL_S, power_match_w=POWER_MATCH_W)
        try:
            process = start_watchdog(orders, os.getpid())
        except OSError as err:
            self._note_error("watchdog", err, "could not start the clock-restoring watchdog",
                             "clocks are not restored if this process is killed with SIGKILL")
            return
        self.watchdog = WatchdogLink(process, lambda err: self._note_error(
            "watchdog", err, "lost the clock-restoring watchdog",
            "clocks are not restored if this process is killed with SIGKILL"))

    def tell_watchdog(self, message: WatchdogMessage) -> None:
        """One report of the watchdog protocol (watchdog.py)."""
        if self.watchdog is not None:
            self.watchdog.tell(message)

    def lock(self, mhz: int) -> None:
        """Lock `mhz`, telling the watchdog before (it may land) and after (it did)."""
        self.clock_dirty = True
        self.tell_watchdog(WatchdogMessage.lock(mhz))
        self.gpu.set_locked_sm_clocks(mhz)
        self.applied_clock = mhz
        self.tell_watchdog(WatchdogMessage.held(mhz))

    def unlock(self) -> None:
        self.gpu.reset_locked_sm_clocks()
        self.applied_clock = None
        self.clock_dirty = False
        self.tell_watchdog(WatchdogMessage(Report.RELEASED))

    def restore_power_limit(self) -> None:
        if self.initial_power_limit is None:
            self.gpu.reset_power_limit()
        else:
            self.gpu.set_power_limit_w(self.initial_power_limit)
        self.power_dirty = False
        self.tell_watchdog(WatchdogMessage(Report.POWER_RELEASED))

    def restore(self) -> bool:
        """Undo every clock and power limit this job set, each call retried a few times; True
        when nothing of ours is left on the GPU. Never raises; an unfinished restore is logged
        (once) as what it is and kept in `restore_error` for close() to hand to the watchdog."""
        gpu = self.gpu
        if not self.live:
            return True
        failures = []
        if self.clock_dirty or self.applied_clock is not None:
            err = _retry(self.unlock)
            if err is not None:
                failures.append(f"could not reset locked clocks ({err})")
        if self.power_dirty:
            err = _retry(self.restore_power_limit)
            if err is not None:
                failures.append(f"could not restore the power limit ({err})")
        self.restore_tried_s = time.monotonic()
        if not failures:
            if self.restore_error is not None:
                logger.warning("perseus-ext: %s: default clocks restored after earlier failures", gpu.name)
                self.restore_error = None
            return True
        first = self.restore_error is None
        self.restore_error = "; ".join(failures)
        self._count_error()
        if first:
            held = (f"locked at {self.applied_clock} MHz" if self.applied_clock is not None
                    else "possibly locked" if self.clock_dirty else "at a power limit perseus-ext set")
            logger.error("perseus-ext: %s: restoring default clocks failed after %d attempts: %s. The GPU "
                         "is still %s; perseus-ext retries every %.0f s while training goes on and %s",
                         gpu.name, RESTORE_ATTEMPTS, self.restore_error, held, RESTORE_RETRY_S,
                         self.fallback_text())
        return False

    def fallback_text(self) -> str:
        if self.watchdog is not None:
            return f"its watchdog (pid {self.watchdog.pid}) keeps retrying for {WATCHDOG_RETRY_FOR_S:.0f} s after the job ends"
        return (f"nothing retries after the job ends: reset it with `nvidia-smi -i {self.gpu.uuid} -rgc` "
                f"(and `-pl <watts>` for the power limit)")

    def stop_watchdog(self, *, hand_over: bool, worker_hung: bool) -> None:
        """Ends the watchdog; `hand_over`: it keeps retrying an unfinished restore."""
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is not None:
            watchdog.stop(hand_over=hand_over, worker_hung=worker_hung, timeout_s=JOIN_TIMEOUT_S)


def _retry(call: Any) -> BaseException | None:
    """Run a restoring device call up to RESTORE_ATTEMPTS times; the last error, None on success."""
    error: BaseException | None = None
    for attempt in range(RESTORE_ATTEMPTS):
        try:
            call()
            return None
        except Exception as err:
            error = err
            if attempt + 1 < RESTORE_ATTEMPTS:
                time.sleep(RESTORE_BACKOFF_S * 2 ** attempt)
    return error
