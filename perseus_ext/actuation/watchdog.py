"""SIGKILL safety net: a tiny process that restores GPU clocks when the trainer dies hard.

Started by FrequencyController with a pipe on its stdin. A clean shutdown writes "clean" and
closes the pipe; any other end of the trainer (SIGKILL, OOM killer, segfault) closes the pipe
without it, or re-parents this process, and the watchdog then unlocks the clocks and puts the
power limit back. It ignores SIGINT/SIGTERM so that a Ctrl-C or job-wide SIGTERM cannot kill it
before the trainer is gone.

Usage (internal): python -m perseus_ext.actuation.watchdog '<restore spec json>' <trainer pid>
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
from typing import Any

POLL_S = 0.5  # how often the parent pid is re-checked (pipe may be inherited by forked children)


def wait_for_trainer(stdin_fd: int, trainer_pid: int) -> bool:
    """Block until the trainer ends; True if it ended cleanly (said "clean" before closing)."""
    received = b""
    while True:
        readable, _, _ = select.select([stdin_fd], [], [], POLL_S)
        if readable:
            chunk = os.read(stdin_fd, 64)
            if not chunk:
                return received.strip() == b"clean"
            received += chunk
        elif os.getppid() != trainer_pid:
            return False  # trainer died while a forked child still holds the pipe open


def restore(spec: dict[str, Any]) -> list[str]:
    """Reset locked clocks and the power limit on the GPU `spec` names; returns problems."""
    from perseus_ext.measurement.gpu import open_restore_target

    problems = []
    try:
        gpu = open_restore_target(spec)
    except Exception as err:
        return [f"could not open the GPU: {err}"]
    try:
        gpu.reset_locked_sm_clocks()
    except Exception as err:
        problems.append(f"could not reset locked clocks: {err}")
    power_limit = spec.get("power_limit_w")
    try:
        if power_limit is None:
            gpu.reset_power_limit()
        elif gpu.power_limit_w() != power_limit:
            gpu.set_power_limit_w(power_limit)
    except Exception as err:
        problems.append(f"could not restore the power limit: {err}")
    gpu.close()
    return problems


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    spec = json.loads(argv[0])
    trainer_pid = int(argv[1])
    if wait_for_trainer(sys.stdin.fileno(), trainer_pid):
        return 0
    problems = restore(spec)
    where = spec.get("uuid") or spec.get("state_file")
    if problems:
        print(f"perseus-ext watchdog: trainer {trainer_pid} died; restoring {where} failed: "
              + "; ".join(problems), file=sys.stderr)
        return 1
    print(f"perseus-ext watchdog: trainer {trainer_pid} died; restored default clocks on {where}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
