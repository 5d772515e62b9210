"""Fault injection on the restore paths: failing resets, the watchdog hand-over, clock ownership
between jobs, and SIGTERM while the main thread is blocked in a collective."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from perseus_ext.actuation import restore as restore_module
from perseus_ext.actuation.controller import FrequencyController
from perseus_ext.actuation.watchdog import Claims, WatchdogOrders, restore, restore_once
from perseus_ext.errors import ConfigError
from perseus_ext.measurement.gpu import NVMLRestoreSpec, SimRestoreSpec, ZeusdRestoreSpec
from perseus_ext.measurement.gpu.sim import SimulatedGPU, read_state_file

REPO = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(REPO))


def _state(path: Path) -> dict:
    return read_state_file(path)


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(restore_module, "RESTORE_BACKOFF_S", 0.0)
    monkeypatch.setattr(restore_module, "RESTORE_RETRY_S", 0.0)
    monkeypatch.setattr(restore_module, "WATCHDOG_RETRY_FOR_S", 10.0)
    monkeypatch.setattr(restore_module, "WATCHDOG_RETRY_INTERVAL_S", 0.1)


# --------------------------------------------------------------------------- failing restores
def test_a_transient_reset_failure_is_retried(fast_retries, caplog):
    gpu = SimulatedGPU("a100_sxm", pace=False)
    controller = FrequencyController(gpu, watchdog=False)
    controller.set_clock(210)  # communication_clock "min": the worst clock to be stuck at
    controller.flush(5)
    gpu.inject_fault("reset_locked_sm_clocks", times=restore_module.RESTORE_ATTEMPTS - 1)
    with caplog.at_level(logging.WARNING):
        controller.close()
    assert gpu.locked_clock is None and controller.restore_error is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_failed_restore_is_reported_as_such_and_retried_while_training_goes_on(fast_retries, caplog):
    gpu = SimulatedGPU("a100_sxm", pace=False)
    controller = FrequencyController(gpu, watchdog=False)
    controller.set_clock(1410)
    controller.flush(5)
    gpu.inject_fault("set_locked_sm_clocks", times=1)
    gpu.inject_fault("reset_locked_sm_clocks", times=restore_module.RESTORE_ATTEMPTS)
    with caplog.at_level(logging.WARNING):
        controller.set_clock(1005)  # fails; so do all quick attempts to unlock
        controller.flush(5)
    assert controller.disabled_reason and controller.restore_error
    assert gpu.locked_clock == 1410
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "still locked at 1410 MHz" in errors[0] and "nvidia-smi" in errors[0]
    assert "training continues at default clocks" not in caplog.text
    controller.set_clock(1200)  # dropped, but the worker retries the restore on its next wake-up
    controller.flush(5)
    assert gpu.locked_clock is None and controller.restore_error is None
    assert "restored after earlier failures" in caplog.text
    controller.close()


def test_an_unfinished_restore_is_handed_to_the_watchdog(fast_retries, tmp_path, caplog):
    state = tmp_path / "gpu.json"
    gpu = SimulatedGPU("a100_sxm", pace=False, state_file=state)
    controller = FrequencyController(gpu)
    controller.set_clock(1005)
    controller.set_power_limit(300)
    controller.flush(5)
    watchdog = controller.writes.watchdog.process
    gpu.inject_fault("reset_locked_sm_clocks", times=None)  # only in this process
    with caplog.at_level(logging.ERROR):
        controller.close()
    assert controller.restore_error and "could not reset locked clocks" in controller.restore_error
    assert f"watchdog (pid {watchdog.pid}) keeps retrying" in caplog.text
    assert watchdog.wait(10) == 0  # the watchdog's own GPU handle works: it restores, then ends
    assert _state(state)["locked_sm_clock"] is None and _state(state)["power_limit_w"] == 500


# --------------------------------------------------------------------------- ownership
def _spec(state: Path, **extra) -> WatchdogOrders:
    return WatchdogOrders(target=SimRestoreSpec(preset="a100_sxm", state_file=str(state)), power_limit_w=450.0, **extra)


def _lock_as_another_job(state: Path, mhz: int, watts: float | None = None) -> None:
    other = SimulatedGPU("a100_sxm", pace=False, state_file=state)
    other.set_locked_sm_clocks(mhz)
    if watts is not None:
        other.set_power_limit_w(watts)


@pytest.mark.parametrize("now_locked, ours, restored", [
    (1005, {1005}, True),  # still what this job set: undo it
    (1200, {1005}, False),  # another job locked the GPU since: leave it
    (1200, {1005, 1200}, True),  # a lock this job was setting when it died
])
def test_the_watchdog_undoes_only_what_the_gpu_still_holds_of_its_job(tmp_path, now_locked, ours, restored):
    state = tmp_path / "gpu.json"
    _lock_as_another_job(state, now_locked, watts=300 if restored else 350)
    finished, notes = restore_once(_spec(state), Claims(set(ours), {300.0}))
    assert finished
    after = _state(state)
    if restored:
        assert after["locked_sm_clock"] is None and after["power_limit_w"] == 450
    else:
        assert after["locked_sm_clock"] == now_locked and after["power_limit_w"] == 350
        assert any("another job" in note for note in notes)


def test_a_gpu_nobody_claims_is_never_touched(tmp_path):
    state = tmp_path / "gpu.json"
    _lock_as_another_job(state, 1200)
    assert restore_once(_spec(state), Claims()) == (True, [])
    assert _state(state)["locked_sm_clock"] == 1200


def test_the_watchdog_retries_and_checks_ownership_before_every_attempt(tmp_path):
    """The GPU is unreachable at first (an unreadable state file stands for a failing driver);
    by the time it answers, another job has locked it: the watchdog must leave that lock."""
    state = tmp_path / "gpu.json"
    state.write_text("{broken")
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "perseus_ext.actuation.watchdog",
         _spec(state, retry_for_s=20, retry_interval_s=0.1).to_json(), str(os.getpid())],
        stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
    )
    watchdog.stdin.write(b"lock 1005\nheld 1005\nrestore\n")
    watchdog.stdin.close()
    time.sleep(0.5)
    assert watchdog.poll() is None  # still retrying
    state.unlink()
    _lock_as_another_job(state, 1200)
    assert watchdog.wait(10) == 0
    assert _state(state)["locked_sm_clock"] == 1200
    assert b"another job set it" in watchdog.stderr.read()


def test_the_watchdog_gives_up_after_its_retry_window_and_says_so(tmp_path):
    state = tmp_path / "gpu.json"
    state.write_text("{broken")
    finished, notes = restore(_spec(state, retry_for_s=0.3, retry_interval_s=0.1), Claims({1005}))
    assert not finished and len(notes) >= 2 and "could not open the GPU" in notes[0]


# --------------------------------------------------------------------------- SIGTERM while blocked
BLOCKED_TRAINER = textwrap.dedent(
    """
    import os, sys, datetime
    import torch, torch.distributed as dist
    from perseus_ext.measurement.gpu.sim import SimulatedGPU
    from perseus_ext.actuation.controller import FrequencyController

    rank, port, state = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    gpu = SimulatedGPU("a100_sxm", state_file=state.format(rank=rank), pace=False)
    controller = FrequencyController(gpu)
    controller.set_clock(1005)
    controller.flush(5)
    print("ready", flush=True)
    if rank == 1:
        sys.stdin.readline()  # the peer that never joins: the test ends it
    else:
        dist.all_reduce(torch.zeros(1))  # blocked in gloo's C++ wait, for up to 300 s
    """
)


def test_sigterm_while_blocked_in_a_collective_restores_clocks_and_ends_the_process(tmp_path):
    from runtime_helpers import free_port as _free_port

    port = str(_free_port())
    state = str(tmp_path / "gpu{rank}.json")
    ranks = [subprocess.Popen([sys.executable, "-c", BLOCKED_TRAINER, str(rank), port, state],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=dict(ENV, OMP_NUM_THREADS="1"), text=True) for rank in (0, 1)]
    try:
        for process in ranks:
            assert process.stdout.readline().strip() == "ready", process.stderr.read()
        blocked = ranks[0]
        time.sleep(1.0)  # well inside the all_reduce
        assert _state(Path(state.format(rank=0)))["locked_sm_clock"] == 1005
        sent = time.monotonic()
        blocked.send_signal(signal.SIGTERM)
        assert blocked.wait(15) == -signal.SIGTERM  # ends as SIGTERM's default action would
        assert time.monotonic() - sent < 10
        assert _state(Path(state.format(rank=0)))["locked_sm_clock"] is None  # restored, not by the watchdog
        assert "restoring GPU clocks from the signal watcher" in blocked.stderr.read()
    finally:
        for process in ranks:
            process.kill()
            process.wait()


HELD_LOCK_TRAINER = textwrap.dedent(
    """
    import os, signal, sys, threading
    from perseus_ext.actuation import exit_guard

    lock = threading.Lock()  # e.g. a controller's change queue, taken by the training thread

    class Controller:
        restore_error = None
        closed = False

        def close(self):  # idempotent, as a controller's (atexit closes again)
            with lock:  # the restore needs what the interrupted main thread holds
                if not self.closed:
                    self.closed = True
                    print("restored", flush=True)

    class Runtime:
        def interrupted(self, signal_name, clocks_restored):
            print(f"summary: {signal_name} {clocks_restored}", flush=True)

    controller, runtime = Controller(), Runtime()
    exit_guard.register(controller, handle_signals=True)
    exit_guard.on_interrupt(runtime)
    with lock:
        os.kill(os.getpid(), int(sys.argv[1]))  # the handler runs before the lock is released
        for _ in range(1000):
            pass
    """
)


@pytest.mark.parametrize("signum", [signal.SIGINT])
def test_a_signal_while_the_main_thread_holds_a_lock_the_restore_needs_restores_once_it_is_released(signum):
    """Python runs the handler in the main thread between two bytecodes, possibly inside a
    locked region; a restore run right there waited for ever (a hang at Ctrl-C). The restore
    runs on its own thread: the handler waits a bounded time, KeyboardInterrupt unwinds and
    releases the lock, and the restore and the summary follow before the process ends."""
    started = time.monotonic()
    process = subprocess.run([sys.executable, "-c", HELD_LOCK_TRAINER, str(int(signum))], capture_output=True,
                             text=True, env=ENV, timeout=30,  # SIGINT not inherited ignored (a background shell's)
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert time.monotonic() - started < 30
    assert process.returncode != 0 and "KeyboardInterrupt" in process.stderr, process.stderr[-2000:]
    assert process.stdout.splitlines() == ["restored", f"summary: {signal.Signals(signum).name} True"], process.stdout


# --------------------------------------------------------------------------- the orders across the boundary
@pytest.mark.parametrize("target", [
    SimRestoreSpec(preset="a100_sxm", state_file="/tmp/gpu.json"),
    NVMLRestoreSpec(uuid="GPU-bbbb"),
    ZeusdRestoreSpec(gpu_id=1, reader=NVMLRestoreSpec(uuid="GPU-bbbb"), socket_path="/run/zeusd.sock"),
    ZeusdRestoreSpec(gpu_id=0, reader=SimRestoreSpec(preset="h100", state_file="/tmp/g.json"), host_port="127.0.0.1:4938"),
])
def test_the_watchdog_orders_cross_the_process_boundary_as_the_same_typed_object(target):
    orders = WatchdogOrders(target=target, power_limit_w=None, retry_for_s=300.0, retry_interval_s=2.0)
    back = WatchdogOrders.from_json(orders.to_json())
    assert back == orders and type(back.target) is type(target)


@pytest.mark.parametrize("text, named", [
    ('{"target": {"backend": "sim", "preset": "a100_sxm"}, "power_limit_w": null}', "target.sim.state_file"),
    ('{"target": {"backend": "rocm", "uuid": "x"}, "power_limit_w": null}', "target"),
    ('{"target": {"backend": "nvml", "uuid": "GPU-a"}, "power_limit_w": "450"}', "power_limit_w"),
    ('{"target": {"backend": "nvml", "uuid": "GPU-a"}, "power_limit_w": null, "retry_interval_s": 0}',
     "retry_interval_s"),
    ('{"target": {"backend": "zeusd", "gpu_id": 0, "reader": {"backend": "nvml", "uuid": "GPU-a"}}, '
     '"power_limit_w": null}', "exactly one"),
    ('{"target": {"backend": "nvml", "uuid": "GPU-a", "token": "secret"}, "power_limit_w": null}', "token"),
    ("{broken", "(whole)"),
])
def test_bad_watchdog_orders_are_a_clear_error_naming_the_field(text, named):
    with pytest.raises(ConfigError, match="bad watchdog orders") as caught:
        WatchdogOrders.from_json(text)
    assert named in str(caught.value)


@pytest.mark.parametrize("argv", [['{"target": {"backend": "sim"}}', "123"], ["{broken", "123"],
                                  [_spec(Path("/tmp/x.json")).to_json(), "not-a-pid"], []])
def test_the_watchdog_process_refuses_bad_orders_in_one_line_without_a_traceback(argv):
    done = subprocess.run([sys.executable, "-m", "perseus_ext.actuation.watchdog", *argv],
                          stdin=subprocess.DEVNULL, capture_output=True, env=ENV, timeout=60)
    assert done.returncode == 2
    assert done.stderr.decode().startswith("perseus-ext watchdog: ") and b"Traceback" not in done.stderr
