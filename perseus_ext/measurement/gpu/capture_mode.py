"""perseus-ext's threads must not break a CUDA graph capture that another thread runs.

A capture begun in CUDA's default "global" mode (the default of `torch.cuda.graph` and of
`torch.cuda.make_graphed_callables`) forbids "potentially unsafe" CUDA calls on *every* thread of
the process while it lasts. `cudaEventQuery` is one: on an NVIDIA H200 (driver 580.159.04, torch
2.11, `benchmarks/gpu_graphs.py`), a thread polling `event.query()` during a global-mode capture
got "operation not permitted when stream is capturing" on each of its 168 queries, and the
capture failed with `cudaErrorStreamCaptureInvalidated`; in "thread_local" mode 165 queries
passed and the capture held. The controller's worker and the device observer poll markers with
`event.query()`, so each sets its own thread's capture interaction mode to "thread_local"
(`cuThreadExchangeStreamCaptureMode`, the driver's per-thread setting; PyTorch's NCCL watchdog
does the same around its event queries): other threads' captures are then ignored by its calls.
The markers it queries are never recorded inside a capture (the runtime's hooks step aside while
one is on), so the queries themselves stay legal. The training thread's mode is left alone.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1  # CUstreamCaptureMode
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_INITIALIZED = 3
_ATTEMPTS_PER_THREAD = 1000  # a thread that starts before CUDA is initialised retries this often

_driver_function: Any = None
_driver_loaded = False
_driver_lock = threading.Lock()
_per_thread = threading.local()


def _exchange_function() -> Any:
    """libcuda's cuThreadExchangeStreamCaptureMode, or None (no NVIDIA driver here)."""
    global _driver_function, _driver_loaded
    if not _driver_loaded:
        with _driver_lock:
            if not _driver_loaded:
                try:
                    _driver_function = ctypes.CDLL("libcuda.so.1").cuThreadExchangeStreamCaptureMode
                except (OSError, AttributeError):
                    _driver_function = None
                _driver_loaded = True
    return _driver_function


def ignore_other_threads_captures() -> bool:
    """Make the calling thread's CUDA calls ignore captures that other threads run (idempotent,
    cheap after the first success, never raises). True once set on this thread; False where
    there is no NVIDIA driver, or CUDA is not initialised yet (a later call retries)."""
    if getattr(_per_thread, "done", False):
        return True
    attempts = getattr(_per_thread, "attempts", 0)
    if attempts >= _ATTEMPTS_PER_THREAD:
        return False
    _per_thread.attempts = attempts + 1
    exchange = _exchange_function()
    if exchange is None:
        _per_thread.attempts = _ATTEMPTS_PER_THREAD
        return False
    mode = ctypes.c_int(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    try:
        status = exchange(ctypes.byref(mode))
    except Exception:  # a broken driver library: nothing to protect
        _per_thread.attempts = _ATTEMPTS_PER_THREAD
        return False
    if status == CUDA_SUCCESS:
        _per_thread.done = True
        return True
    if status != CUDA_ERROR_NOT_INITIALIZED:
        _per_thread.attempts = _ATTEMPTS_PER_THREAD
    return False
