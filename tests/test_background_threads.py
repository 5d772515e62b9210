"""perseus-ext's threads leave SIGINT and SIGTERM to the main thread (perseus_ext/background.py).

Which thread takes a signal sent to the process is the kernel's choice; a helper thread that
takes SIGINT leaves a main thread asleep in a blocking call uninterrupted, and Ctrl-C does
nothing until that call returns. The tests read each thread's blocked-signal mask from
/proc, so they do not depend on the kernel's choice.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from perseus_ext.background import start_background

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")

# Prints {thread name: [SIGINT blocked, SIGTERM blocked]} for every thread alive while a
# controller runs on a simulated GPU with a computation in flight and the frontier LP walks.
PROBE = r"""
import json, signal, sys, threading
from perseus_ext.actuation.controller import FrequencyController
from perseus_ext.data import shipped_profile
from perseus_ext.measurement.gpu.sim import SimulatedGPU
from perseus_ext.planning import relaxation
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import one_f_one_b
from perseus_ext.planning.solver import solve_frontier

def blocked(native_id):
    try:
        status = open(f"/proc/self/task/{native_id}/status").read()
    except FileNotFoundError:  # the thread ended since threading.enumerate()
        return None
    mask = int(status.split("SigBlk:")[1].split()[0], 16)
    return [bool(mask >> (s - 1) & 1) for s in (signal.SIGINT, signal.SIGTERM)]

# A helper thread counts as blocking a signal only if it did at every look; the main thread
# is looked at only by itself (while it starts a thread it blocks them for a moment).
def snapshot(into):
    for thread in threading.enumerate():
        mask = blocked(thread.native_id)
        if mask is None or (thread is threading.main_thread()) != (threading.current_thread() is thread):
            continue
        into[thread.name] = [a and b for a, b in zip(into.get(thread.name, mask), mask)]

seen = {}
walk = relaxation.AnchorWalk._solve
def solve_and_look(self, lp, k):
    snapshot(seen)
    return walk(self, lp, k)
relaxation.AnchorWalk._solve = solve_and_look

gpu = SimulatedGPU("a100_sxm", state_file=sys.argv[1], pace=True)  # a device running in real time
controller = FrequencyController(gpu)  # handles SIGINT/SIGTERM: starts the signal watcher
gpu.open_timeline().launch("forward", 0.5)  # the simulated device's engine thread runs it
controller.set_clock(1005)
controller.flush(5)
solve_frontier(one_f_one_b(8, 4), load_profile(shipped_profile("gpt3-175b-a100_sxm")), 80.0)
snapshot(seen)
controller.close()
print(json.dumps(seen))
"""


def test_every_thread_perseus_starts_blocks_sigint_and_sigterm(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "gpu.json")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    masks = json.loads(result.stdout.strip().splitlines()[-1])
    assert masks.pop("MainThread") == [False, False]  # the main thread takes them
    names = set(masks)
    for expected in ("perseus-clock-controller", "perseus-device-observer",
                     "perseus-signal-watcher", "perseus-sim-device", "frontier-lp-walk"):
        assert expected in names, sorted(names)
    assert all(mask == [True, True] for mask in masks.values()), masks


def test_start_background_blocks_only_in_the_new_thread():
    seen: dict[str, set[int]] = {}

    def look() -> None:
        seen["thread"] = set(signal.pthread_sigmask(signal.SIG_BLOCK, []))

    before = set(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    thread = start_background(threading.Thread(target=look))
    thread.join(10)
    assert {signal.SIGINT, signal.SIGTERM} <= seen["thread"]
    assert set(signal.pthread_sigmask(signal.SIG_BLOCK, [])) == before  # the caller's mask is back
