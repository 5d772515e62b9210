"""FrequencyController on the simulated GPU: ordering, dry-run, fault handling, restore paths."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from runtime_helpers import HandMarker

from perseus_ext.actuation.controller import FrequencyController, open_controller
from perseus_ext.measurement.gpu import GPUError, GPUPermissionError
from perseus_ext.measurement.gpu.sim import SimulatedGPU, read_state_file

REPO = Path(__file__).resolve().parent.parent


class SlowSetGPU(SimulatedGPU):
    """Clock changes take as long as real NVML calls (or longer), to expose blocking."""

    def __init__(self, delay: float, **kwargs) -> None:
        super().__init__("a100_sxm", pace=False, **kwargs)
        self.delay = delay

    def set_locked_sm_clocks(self, mhz: int) -> None:
        time.sleep(self.delay)
        super().set_locked_sm_clocks(mhz)


def test_set_clock_does_not_wait_for_the_device():
    gpu = SlowSetGPU(0.2)
    with FrequencyController(gpu, watchdog=False) as controller:
        start = time.perf_counter()
        controller.set_clock(1200)
        assert time.perf_counter() - start < 0.1  # the 200 ms set happens on the worker
        assert controller.flush(5)
        assert gpu.locked_clock == 1200 and controller.current_clock == 1200


def test_changes_apply_in_order_without_consecutive_duplicates():
    gpu = SimulatedGPU("a100_sxm", pace=False)
    with FrequencyController(gpu, watchdog=False) as controller:
        for mhz in (1200, 1200, 1005, 1005, 1410, 1200):
            controller.set_clock(mhz)
            controller.flush(5)
        controller.reset()
        controller.flush(5)
        controller.set_clock(1200)
        controller.flush(5)
        assert gpu.clock_history == [1200, 1005, 1410, 1200, None, 1200]
    assert gpu.clock_history[-1] is None and gpu.locked_clock is None  # restored on close


def test_a_lagging_worker_skips_superseded_targets():
    gpu = SlowSetGPU(0.05)
    with FrequencyController(gpu, watchdog=False) as controller:
        targets = [1410 - 15 * i for i in range(20)]
        for mhz in targets:
            controller.set_clock(mhz)
        controller.flush(10)
        applied = [c for c in gpu.clock_history if c is not None]
        assert applied[-1] == targets[-1]
        assert applied == [c for c in targets if c in applied]  # a subsequence, in order
        assert controller.stale_skipped == len(targets) - len(applied) > 0


def applied_within(gpu: SimulatedGPU, mhz: int, timeout_s: float) -> float | None:
    """Seconds until `mhz` is in the GPU's clock history, None if not within `timeout_s`."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if mhz in gpu.clock_history:
            return time.perf_counter() - start
        time.sleep(0.001)
    return None


def test_a_change_held_back_gives_way_to_a_later_one_that_falls_due():
    """A delay planned from timings that no longer hold (the last gap between iterations was an
    inline solve) never holds up the changes queued behind it: the held change is stale."""
    gpu = SimulatedGPU("a100_sxm", pace=False)
    with FrequencyController(gpu, watchdog=False) as controller:
        controller.set_clock(900, at=HandMarker(time.perf_counter()), after_s=30.0)
        later = HandMarker()
        controller.set_clock(1200, at=later)
        time.sleep(0.05)
        assert gpu.clock_history == []  # neither is due yet
        later.reach()
        assert applied_within(gpu, 1200, 2.0) is not None
        assert gpu.clock_history == [1200] and controller.stale_skipped == 1


def test_a_held_change_goes_out_once_the_device_reaches_its_bound():
    gpu = SimulatedGPU("a100_sxm", pace=False)
    with FrequencyController(gpu, watchdog=False) as controller:
        bound = HandMarker()
        controller.set_clock(900, at=HandMarker(time.perf_counter()), after_s=30.0, by=bound)
        time.sleep(0.05)
        assert gpu.clock_history == []
        bound.reach()
        assert applied_within(gpu, 900, 2.0) is not None
        assert controller.issue_delay.typical_s < 0.1  # late from the bound, not from 30 s


def test_close_restores_clock_and_power_limit_and_is_idempotent():
    gpu = SimulatedGPU("a100_sxm", pace=False)
    gpu.set_power_limit_w(450)  # what the admin had before the run
    controller = FrequencyController(gpu, watchdog=False)
    controller.set_clock(1005)
    controller.set_power_limit(300)
    controller.flush(5)
    assert gpu.locked_clock == 1005 and gpu.power_limit_w() == 300
    controller.close()
    controller.close()
    assert gpu.locked_clock is None and gpu.power_limit_w() == 450
    controller.set_clock(1200)  # after close: ignored, never raises
    assert gpu.locked_clock is None and controller.dropped_count == 1


def test_exception_in_training_step_restores_clocks():
    gpu = SimulatedGPU("a100_sxm", pace=False)
    with pytest.raises(RuntimeError, match="step failed"):
        with FrequencyController(gpu, watchdog=False) as controller:
            controller.set_clock(1005)
            controller.flush(5)
            raise RuntimeError("step failed")
    assert gpu.locked_clock is None


def test_explicit_dry_run_records_but_never_touches_the_gpu():
    gpu = SimulatedGPU("a100_sxm", pace=False)
    with FrequencyController(gpu, dry_run=True) as controller:
        for mhz in (1200, 1200, 1005):
            controller.set_clock(mhz)
        controller.reset()
        controller.set_clock(1005)
        controller.set_power_limit(300)
        assert controller.flush(0.1)
    assert controller.dry_run_log == [1200, 1005, 1005]
    assert controller.dry_run_power_limits == [300.0]
    assert gpu.clock_history == [] and gpu.power_limit_w() == 500


def test_missing_privilege_means_one_warning_and_dry_run(caplog):
    gpu = SimulatedGPU("a100_sxm", pace=False, privileged=False)
    with caplog.at_level(logging.WARNING):
        controller = FrequencyController(gpu)
        controller.set_clock(1200)
        controller.close()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "SYS_ADMIN" in messages[0] and "DRY-RUN" in messages[0]
    assert controller.dry_run and controller.dry_run_log == [1200]
    with pytest.raises(GPUPermissionError, match="strict"):
        FrequencyController(gpu, strict=True)


@pytest.mark.parametrize("call", ["set_locked_sm_clocks", "set_power_limit_w"])
def test_device_failure_is_counted_logged_once_and_falls_back_to_default(call, caplog):
    gpu = SimulatedGPU("a100_sxm", pace=False)
    controller = FrequencyController(gpu, watchdog=False)
    controller.set_clock(1200)
    controller.flush(5)
    gpu.inject_fault(call, times=None)
    with caplog.at_level(logging.WARNING):
        controller.set_power_limit(300) if call == "set_power_limit_w" else controller.set_clock(1005)
        controller.flush(5)
        for mhz in (1100, 1300):
            controller.set_clock(mhz)
            controller.flush(5)
    assert controller.error_count >= 1 and controller.disabled_reason
    assert isinstance(controller.last_error, GPUError)
    assert gpu.locked_clock is None  # default clocks
    assert controller.dropped_count == 2
    messages = [r.getMessage() for r in caplog.records]
    assert messages and len(set(messages)) == len(messages)  # each kind of failure logged once
    assert controller.error_count == len(messages)
    controller.close()


def test_probe_failure_is_dry_run_or_strict_error():
    gpu = SimulatedGPU("a100_sxm", pace=False)
    gpu.inject_fault("can_set_clocks", times=None)
    controller = FrequencyController(gpu)
    assert controller.dry_run and controller.error_count == 1
    with pytest.raises(GPUError):
        FrequencyController(gpu, strict=True)


def test_open_controller_with_unopenable_gpu_records_only(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    controller = open_controller("nvml")
    controller.set_clock(1200)
    assert controller.dry_run and controller.gpu is None and controller.dry_run_log == [1200]
    assert "PERSEUS_GPU=sim" in str(controller.last_error)
    with pytest.raises(GPUError, match="strict mode: no GPU"):
        FrequencyController(None, strict=True)
    live = open_controller("sim:a40?pace=0", watchdog=False)
    assert not live.dry_run and live.gpu.name.startswith("NVIDIA A40")
    live.close()


def test_set_clock_is_safe_from_many_threads():
    gpu = SimulatedGPU("a100_sxm", pace=False)
    with FrequencyController(gpu, watchdog=False) as controller:
        threads = [
            threading.Thread(target=lambda c=c: [controller.set_clock(c) for _ in range(200)])
            for c in (1200, 1005, 1410)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert controller.flush(5)
        assert controller.error_count == 0 and gpu.locked_clock in (1200, 1005, 1410)


# ----------------------------------------------------------------------------- process exits
TRAINER = textwrap.dedent(
    """
    import faulthandler, os, signal, sys, time
    # A trainer in a terminal gets KeyboardInterrupt on SIGINT, whatever the test runner inherited
    # (CI harnesses may start us with SIGINT ignored, which the controller rightly leaves alone).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung exit shows where (exit_status)
    from perseus_ext.measurement.gpu.sim import SimulatedGPU
    from perseus_ext.actuation.controller import FrequencyController

    mode, state = sys.argv[1], sys.argv[2]
    gpu = SimulatedGPU("a100_sxm", state_file=state, pace=False)
    controller = FrequencyController(gpu, watchdog=mode.startswith("sigkill"))
    controller.set_clock(1005)
    controller.set_power_limit(300)
    controller.flush(5)
    if mode == "sigkill-with-child":
        child = os.fork()
        if child == 0:
            time.sleep(60)  # a forked worker (e.g. a DataLoader) still holds the watchdog pipe
            os._exit(0)
        print("child", child, flush=True)
    print("ready", flush=True)
    sys.stdin.readline()  # the test checks the locked clocks first, then lets us go on
    if mode == "normal-exit":
        sys.exit(0)  # no close(): atexit has to restore
    if mode == "exception":
        raise RuntimeError("training crashed")
    if mode == "signal-to-another-thread":  # the kernel may give a process's signal to any
        import threading                    # thread that does not block it (OpenBLAS's, say)
        def take_sigint():
            time.sleep(0.3)  # the main thread is asleep by then
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        threading.Thread(target=take_sigint, daemon=True).start()
    time.sleep(60)
    """
)


def _start_trainer(mode: str, state: Path) -> tuple[subprocess.Popen, int | None]:
    """Start a trainer that locked 1005 MHz / 300 W; returns it and the pid of its fork, if any."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    process = subprocess.Popen(
        [sys.executable, "-c", TRAINER, mode, str(state)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )
    child = None
    line = process.stdout.readline().split()
    if line[:1] == ["child"]:
        child = int(line[1])
        line = process.stdout.readline().split()
    assert line == ["ready"], process.stderr.read()
    state_now = read_state_file(state)
    assert state_now["locked_sm_clock"] == 1005 and state_now["power_limit_w"] == 300
    assert process.stdin is not None
    process.stdin.write("go\n")
    process.stdin.flush()
    return process, child


def exit_status(process: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """The trainer's exit status; a trainer still running after `timeout_s` fails the test with
    every thread's stack (a hang on exit is a defect, and a rare one needs its stacks)."""
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        process.kill()
        _, stderr = process.communicate()
        pytest.fail(f"the trainer did not exit within {timeout_s} s; its threads:\n{stderr[-8000:]}")


def _assert_restored(state: Path, timeout: float = 0.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        current = read_state_file(state)
        restored = current["locked_sm_clock"] is None and current["power_limit_w"] == 500
        if restored or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert restored, current


@pytest.mark.parametrize("mode", ["normal-exit", "exception"])
def test_exit_paths_restore_clocks(mode, tmp_path):
    state = tmp_path / "gpu.json"
    process, _ = _start_trainer(mode, state)
    try:
        assert exit_status(process) == (0 if mode == "normal-exit" else 1)
    finally:
        process.kill()  # no-op once it has exited
    _assert_restored(state)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signals_restore_clocks_then_end_the_process(signum, tmp_path):
    state = tmp_path / "gpu.json"
    process, _ = _start_trainer("signal", state)
    process.send_signal(signum)
    try:
        assert exit_status(process) != 0  # the signal still ends the process as before
    finally:
        process.kill()
    _assert_restored(state)


def test_a_sigint_taken_by_another_thread_still_interrupts_the_sleeping_main_thread(tmp_path):
    """The kernel gave Ctrl-C to a thread that is not perseus-ext's; the main thread sleeps on.
    The watcher restores the clocks and re-delivers the signal to the main thread, whose
    KeyboardInterrupt ends the process now, not when its 60 s sleep is over."""
    state = tmp_path / "gpu.json"
    process, _ = _start_trainer("signal-to-another-thread", state)
    try:
        assert exit_status(process, timeout_s=20) != 0
        assert "KeyboardInterrupt" in process.stderr.read()
    finally:
        process.kill()
    _assert_restored(state)


@pytest.mark.parametrize("mode", ["sigkill", "sigkill-with-child"])
def test_watchdog_restores_clocks_after_sigkill(mode, tmp_path):
    state = tmp_path / "gpu.json"
    process, child = _start_trainer(mode, state)
    process.kill()
    process.wait(30)
    try:
        _assert_restored(state, timeout=10)
    finally:
        if child is not None:  # the orphaned fork sleeps on; end it
            os.kill(child, signal.SIGKILL)


def test_watchdog_tells_a_clean_close_a_hand_over_and_a_death_apart():
    from perseus_ext.actuation.watchdog import Ending, wait_for_trainer

    for message, ending in ((b"lock 1005\nheld 1005\nclean\n", Ending.CLEAN), (b"held 1005\nrestore\n", Ending.RESTORE),
                            (b"", Ending.DIED), (b"garbage", Ending.DIED), (b"held 1005\ncle", Ending.DIED),
                            (b"held x\nclean 3\nrestore\n", Ending.RESTORE)):  # garbled lines are skipped
        read_end, write_end = os.pipe()
        os.write(write_end, message)
        os.close(write_end)
        assert wait_for_trainer(read_end, os.getppid()) is ending
        os.close(read_end)
    read_end, write_end = os.pipe()  # pipe still open, but the "trainer" is not our parent
    assert wait_for_trainer(read_end, trainer_pid=-1) is Ending.DIED
    os.close(read_end)
    os.close(write_end)


def test_watchdog_claims_follow_the_trainers_reports():
    from perseus_ext.actuation.watchdog import Claims, Report, WatchdogMessage

    claims = Claims()
    for message in (WatchdogMessage.lock(1005), WatchdogMessage.held(1005), WatchdogMessage.lock(1200),
                    WatchdogMessage.power(300)):
        claims.note(message)
    assert claims.clocks == {1005, 1200} and claims.power_limits == {300.0}  # 1200 may have landed
    for message in (WatchdogMessage.held(1200), WatchdogMessage.power_held(300.0)):
        claims.note(message)
    assert claims.clocks == {1200} and claims.power_limits == {300.0}
    for report in (Report.RELEASED, Report.POWER_RELEASED):
        claims.note(WatchdogMessage(report))
    assert claims.empty


def test_watchdog_messages_are_the_lines_the_protocol_has_always_had():
    """The oracle is the protocol's text (watchdog.py's docstring), written out literally."""
    from perseus_ext.actuation.watchdog import Report, WatchdogMessage

    lines = {WatchdogMessage.lock(1005): "lock 1005", WatchdogMessage.held(1005): "held 1005",
             WatchdogMessage(Report.RELEASED): "released", WatchdogMessage.power(300): "power 300.0",
             WatchdogMessage.power_held(250.5): "power-held 250.5",
             WatchdogMessage(Report.POWER_RELEASED): "power-released", WatchdogMessage(Report.CLEAN): "clean",
             WatchdogMessage(Report.RESTORE): "restore"}
    assert {message.report for message in lines} == set(Report)  # every report of the protocol
    for message, line in lines.items():
        assert message.encode() == line and WatchdogMessage.parse(line) == message
    for garbled in ("lock", "lock 10.5", "held x", "power", "clean 3", "unlock 1005", ""):
        with pytest.raises(ValueError):
            WatchdogMessage.parse(garbled)
    with pytest.raises(ValueError, match="needs a clock in MHz"):
        WatchdogMessage(Report.HELD, 1005.0)
