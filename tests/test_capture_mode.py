"""perseus-ext's threads set their CUDA stream-capture interaction mode to "thread_local", so
their marker queries cannot break a global-mode CUDA graph capture in the training thread
(measured on an H200: a thread polling event.query() during a global-mode capture invalidated
it; benchmarks/gpu_graphs.py). The driver call is faked here: this machine has no NVIDIA driver."""

from __future__ import annotations

import ctypes
import threading

import pytest
from runtime_helpers import HandMarker

from perseus_ext.actuation.controller import FrequencyController
from perseus_ext.measurement.gpu.sim import SimulatedGPU
from perseus_ext.measurement.gpu import capture_mode


class FakeExchange:
    """cuThreadExchangeStreamCaptureMode: records (thread name, mode asked) and answers `status`."""

    def __init__(self, status: int = 0) -> None:
        self.status = status
        self.calls: list[tuple[str, int]] = []

    def __call__(self, mode_pointer) -> int:
        mode = ctypes.cast(mode_pointer, ctypes.POINTER(ctypes.c_int)).contents
        self.calls.append((threading.current_thread().name, mode.value))
        if self.status == 0:
            mode.value = 0  # the previous mode: global
        return self.status


@pytest.fixture
def driver(monkeypatch):
    fake = FakeExchange()
    monkeypatch.setattr(capture_mode, "_driver_function", fake)
    monkeypatch.setattr(capture_mode, "_driver_loaded", True)
    return fake


def in_fresh_thread(function):
    result = []
    thread = threading.Thread(target=lambda: result.append(function()), name="probe")
    thread.start()
    thread.join(5)
    return result[0]


def test_the_controllers_worker_and_observer_ignore_other_threads_captures(driver):
    marker = HandMarker()
    with FrequencyController(SimulatedGPU("a100_sxm"), dry_run=True, watchdog=False, handle_signals=False) as controller:
        controller.set_clock(1200, at=marker)
        controller.observe(marker, "iteration 0")
        marker.reach()
        assert controller.flush(5)
    threads = {name for name, _ in driver.calls}
    assert threads == {"perseus-clock-controller", "perseus-device-observer"}
    assert {mode for _, mode in driver.calls} == {capture_mode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL}
    assert len(driver.calls) == 2  # once per thread: later calls are a thread-local check
    assert threading.current_thread().name not in threads  # the training thread keeps its mode


def test_a_thread_that_starts_before_cuda_is_initialised_retries(driver):
    driver.status = capture_mode.CUDA_ERROR_NOT_INITIALIZED

    def twice() -> tuple[bool, bool, bool]:
        first = capture_mode.ignore_other_threads_captures()
        driver.status = 0
        return first, capture_mode.ignore_other_threads_captures(), capture_mode.ignore_other_threads_captures()

    assert in_fresh_thread(twice) == (False, True, True)
    assert len(driver.calls) == 2


def test_another_driver_error_gives_up_on_that_thread(driver):
    driver.status = 999
    assert in_fresh_thread(lambda: [capture_mode.ignore_other_threads_captures() for _ in range(3)]) == [False] * 3
    assert len(driver.calls) == 1


def test_without_an_nvidia_driver_nothing_is_called_and_nothing_raises(monkeypatch):
    monkeypatch.setattr(capture_mode, "_driver_loaded", False)
    monkeypatch.setattr(capture_mode.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(name)))
    assert in_fresh_thread(capture_mode.ignore_other_threads_captures) is False
    assert capture_mode._driver_function is None
