"""SIGKILL safety net: a tiny process that restores GPU clocks when the trainer dies hard, or
when the trainer's own restore failed.

Started by FrequencyController with a pipe on its stdin, over which the trainer reports what it
does to the GPU, one `WatchdogMessage` per line (`encode` on the trainer's side, `parse` on the
watchdog's, so neither side spells the protocol by hand):

    lock <mhz>      about to lock that clock (it may land even if the trainer dies in the call)
    held <mhz>      the lock is in place: this job's only clock now
    released        the trainer unlocked the clocks itself
    power <w>, power-held <w>, power-released    the same for the power limit
    clean           the trainer restored everything: exit
    restore         the trainer is done but its restore failed: take it over

End of input without "clean" (SIGKILL, OOM killer, segfault), or the trainer no longer being our
parent (a forked child may still hold the pipe), means the trainer died. Either way the watchdog
then undoes only what this job set and the GPU *still holds* -- a lock or power limit another job
made since is left alone -- retrying a failing call for `retry_for_s`. It ignores SIGINT/SIGTERM
so a Ctrl-C or job-wide SIGTERM cannot kill it before the trainer is gone.

Usage (internal): python -m perseus_ext.actuation.watchdog '<WatchdogOrders json>' <trainer pid>
The orders cross the process boundary as `WatchdogOrders.to_json()` and are validated back with
`WatchdogOrders.from_json()`: a bad argument is one clear line on stderr and exit status 2.
"""

from __future__ import annotations

import enum
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from perseus_ext.errors import ConfigError
from perseus_ext.measurement.gpu.restore_spec import RestoreSpec

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often the parent pid is re-checked (pipe may be inherited by forked children)
UNKNOWN = object()  # the backend cannot read back the locked clock
BAD_ORDERS_EXIT = 2


class WatchdogOrders(BaseModel):
    """Everything the watchdog needs: the GPU to re-open and how to restore it."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
    target: RestoreSpec
    power_limit_w: float | None = Field(allow_inf_nan=False)  # restore to this; None: the GPU's default
    retry_for_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    retry_interval_s: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    power_match_w: float = Field(default=0.5, ge=0, allow_inf_nan=False)  # a limit this close is ours

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> WatchdogOrders:
        """The orders `to_json` wrote, or a ConfigError naming each bad field."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as err:
            problems = "; ".join(
                f"{'.'.join(str(part) for part in e['loc']) or '(whole)'}: {e['msg']}"
                for e in err.errors(include_url=False))
            raise ConfigError(f"bad watchdog orders ({problems}); they are written by "
                              f"WatchdogOrders.to_json() in the trainer, not by hand") from None


class Report(str, enum.Enum):
    """What a line of the trainer's pipe says (module docstring)."""

    LOCK = "lock"
    HELD = "held"
    RELEASED = "released"
    POWER = "power"
    POWER_HELD = "power-held"
    POWER_RELEASED = "power-released"
    CLEAN = "clean"
    RESTORE = "restore"


CLOCK_REPORTS = frozenset({Report.LOCK, Report.HELD})  # carry a clock (MHz, an integer)
POWER_REPORTS = frozenset({Report.POWER, Report.POWER_HELD})  # carry a power limit (W)


@dataclass(frozen=True)
class WatchdogMessage:
    """One report from the trainer to its watchdog: `report`, and the clock (MHz) or power
    limit (W) it is about where it is about one."""

    report: Report
    value: int | float | None = None

    def __post_init__(self) -> None:
        if self.report in CLOCK_REPORTS and not (isinstance(self.value, int) and not isinstance(self.value, bool)):
            raise ValueError(f"a {self.report.value!r} report needs a clock in MHz, got {self.value!r}")
        if self.report in POWER_REPORTS and not isinstance(self.value, float):
            raise ValueError(f"a {self.report.value!r} report needs a power limit in W, got {self.value!r}")
        if self.report not in CLOCK_REPORTS | POWER_REPORTS and self.value is not None:
            raise ValueError(f"a {self.report.value!r} report carries no value, got {self.value!r}")

    @classmethod
    def lock(cls, mhz: int) -> WatchdogMessage:
        return cls(Report.LOCK, int(mhz))

    @classmethod
    def held(cls, mhz: int) -> WatchdogMessage:
        return cls(Report.HELD, int(mhz))

    @classmethod
    def power(cls, watts: float) -> WatchdogMessage:
        return cls(Report.POWER, float(watts))

    @classmethod
    def power_held(cls, watts: float) -> WatchdogMessage:
        return cls(Report.POWER_HELD, float(watts))

    def encode(self) -> str:
        """The line the trainer writes (without its newline): "held 1005", "power 300.0", "clean"."""
        return self.report.value if self.value is None else f"{self.report.value} {self.value}"

    @classmethod
    def parse(cls, line: str) -> WatchdogMessage:
        """The message `encode` wrote; ValueError for anything else (a garbled line)."""
        word, _, value = line.strip().partition(" ")
        report = Report(word)
        if report in CLOCK_REPORTS:
            return cls(report, int(value))
        if report in POWER_REPORTS:
            return cls(report, float(value))
        if value:
            raise ValueError(f"a {word!r} report carries no value, got {value!r}")
        return cls(report)


ENDINGS = frozenset({Report.CLEAN, Report.RESTORE})  # the trainer's last word


class Ending(str, enum.Enum):
    """How the trainer's watch ended."""

    CLEAN = "clean"  # it restored everything
    RESTORE = "restore"  # it handed an unfinished restore over
    DIED = "died"  # end of input without a last word, or it is no longer our parent


@dataclass
class Claims:
    """What this job may have left on the GPU, from the trainer's reports."""

    clocks: set[int] = field(default_factory=set)
    power_limits: set[float] = field(default_factory=set)

    def note(self, message: WatchdogMessage) -> None:
        report = message.report
        if report is Report.LOCK:
            self.clocks.add(message.value)
        elif report is Report.HELD:
            self.clocks = {message.value}
        elif report is Report.RELEASED:
            self.clocks = set()
        elif report is Report.POWER:
            self.power_limits.add(message.value)
        elif report is Report.POWER_HELD:
            self.power_limits = {message.value}
        elif report is Report.POWER_RELEASED:
            self.power_limits = set()

    @property
    def empty(self) -> bool:
        return not self.clocks and not self.power_limits


def wait_for_trainer(stdin_fd: int, trainer_pid: int, claims: Claims | None = None) -> Ending:
    """Follow the trainer's reports until it ends: clean, restore (hand-over) or died."""
    claims = claims if claims is not None else Claims()
    pending = b""
    while True:
        readable, _, _ = select.select([stdin_fd], [], [], POLL_S)
        if readable:
            chunk = os.read(stdin_fd, 4096)
            if not chunk:
                return Ending.DIED  # a partial last line is no "clean"
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                try:
                    message = WatchdogMessage.parse(raw.decode(errors="replace"))
                except ValueError:
                    continue  # a garbled line: keep what was known
                if message.report in ENDINGS:
                    return Ending(message.report.value)
                claims.note(message)
        elif os.getppid() != trainer_pid:
            return Ending.DIED  # trainer died while a forked child still holds the pipe open


def restore_once(orders: WatchdogOrders, claims: Claims) -> tuple[bool, list[str]]:
    """One attempt to undo `claims` on the GPU `orders` names: (finished, notes). Finished means
    nothing of ours is left (restored, already default, or since taken over by another job)."""
    from perseus_ext.measurement.gpu import GPUNotSupportedError, open_restore_target

    try:
        gpu = open_restore_target(orders.target)
    except Exception as err:
        return False, [f"could not open the GPU: {err}"]
    notes: list[str] = []
    finished = True
    try:
        if claims.clocks:
            try:
                current: Any = gpu.locked_sm_clock()
            except GPUNotSupportedError:
                current = UNKNOWN  # cannot tell: resetting is what this job owes
            if current is None:
                claims.clocks = set()
            elif current is not UNKNOWN and current not in claims.clocks:
                notes.append(f"left the lock at {current} MHz alone: another job set it")
                claims.clocks = set()
            else:
                gpu.reset_locked_sm_clocks()
                claims.clocks = set()
                notes.append("reset locked clocks")
        if claims.power_limits:
            current_w = gpu.power_limit_w()
            if not any(abs(current_w - ours) <= orders.power_match_w for ours in claims.power_limits):
                notes.append(f"left the power limit of {current_w:g} W alone: another job set it")
            elif orders.power_limit_w is None:
                gpu.reset_power_limit()
                notes.append("reset the power limit")
            else:
                gpu.set_power_limit_w(orders.power_limit_w)
                notes.append(f"restored the power limit to {orders.power_limit_w:g} W")
            claims.power_limits = set()
    except Exception as err:
        finished = False
        notes.append(f"failed: {err}")
    finally:
        gpu.close()
    return finished, notes


def restore(orders: WatchdogOrders, claims: Claims) -> tuple[bool, list[str]]:
    """Retry `restore_once` every `retry_interval_s` for up to `retry_for_s` seconds."""
    deadline = time.monotonic() + orders.retry_for_s
    notes: list[str] = []
    while True:
        finished, attempt_notes = restore_once(orders, claims)
        notes += attempt_notes
        if finished or time.monotonic() >= deadline:
            return finished, notes
        time.sleep(orders.retry_interval_s)


def start_watchdog(orders: WatchdogOrders, trainer_pid: int) -> subprocess.Popen[bytes]:
    """Start the watchdog of `trainer_pid` with the trainer's report pipe on its stdin, detached
    from the job's process group (`setsid`), so a Ctrl-C or job-wide signal to the job cannot kill
    it before the trainer."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)  # the watchdog imports this very copy of perseus_ext
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-m", "perseus_ext.actuation.watchdog", orders.to_json(), str(trainer_pid)],
        stdin=subprocess.PIPE, start_new_session=True, env=env,
    )


class WatchdogLink:
    """The trainer's end of the pipe: one line per thing it does to the GPU (module doc)."""

    def __init__(self, process: subprocess.Popen[bytes],
                 on_lost: Callable[[OSError], None]) -> None:
        """on_lost: called once if the pipe breaks (the watchdog died): no SIGKILL safety net."""
        assert process.stdin is not None
        self.process = process
        self._fd: int | None = process.stdin.fileno()
        self._on_lost = on_lost

    @property
    def pid(self) -> int:
        return self.process.pid

    def tell(self, message: WatchdogMessage) -> None:
        """An atomic pipe write of a few bytes; never raises."""
        fd = self._fd
        if fd is None:
            return
        try:
            os.write(fd, f"{message.encode()}\n".encode())
        except OSError as err:
            self._fd = None
            self._on_lost(err)

    def stop(self, *, hand_over: bool, worker_hung: bool, timeout_s: float) -> None:
        """Say "clean", or hand an unfinished restore over ("restore": the watchdog retries after
        the trainer is gone). The pipe stays open while a hung worker might still write to it."""
        self.tell(WatchdogMessage(Report.RESTORE if hand_over else Report.CLEAN))
        self._fd = None
        if worker_hung:
            return
        try:
            assert self.process.stdin is not None
            self.process.stdin.close()
            if not hand_over:
                self.process.wait(timeout_s)
        except (OSError, subprocess.TimeoutExpired) as err:
            logger.debug("watchdog did not stop cleanly: %s", err)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        if len(argv) != 2:
            raise ConfigError(f"expected 2 arguments (orders JSON, trainer pid), got {len(argv)}")
        orders = WatchdogOrders.from_json(argv[0])
        if not argv[1].isdigit():
            raise ConfigError(f"trainer pid {argv[1]!r} is not a process id")
        trainer_pid = int(argv[1])
    except ConfigError as err:
        print(f"perseus-ext watchdog: {err}", file=sys.stderr)
        return BAD_ORDERS_EXIT
    claims = Claims()
    ending = wait_for_trainer(sys.stdin.fileno(), trainer_pid, claims)
    if ending is Ending.CLEAN or claims.empty:
        return 0
    finished, notes = restore(orders, claims)
    where = orders.target.describe()
    why = "died" if ending is Ending.DIED else "could not restore its GPU"
    summary = "; ".join(dict.fromkeys(notes)) or "nothing to do"
    print(f"perseus-ext watchdog: trainer {trainer_pid} {why}; on {where}: {summary}"
          + ("" if finished else " -- GIVING UP, the GPU may still be locked"), file=sys.stderr)
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
