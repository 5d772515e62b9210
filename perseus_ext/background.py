"""Background threads that leave SIGINT and SIGTERM to the main thread.

Linux delivers a signal sent to a process to any one of its threads that does not block it.
When a helper thread takes SIGINT, CPython only notes it: a main thread asleep in a blocking
call (`time.sleep`, a lock, a collective) is not woken, and the Python handler (KeyboardInterrupt,
an application's checkpoint-on-SIGTERM) runs only when that call returns, minutes later or
never. `tests/test_controller.py` caught a trainer that ignored Ctrl-C this way about once in
60 runs. Every thread perseus-ext starts therefore blocks both signals, from its first
instruction: it is started while the starting thread blocks them, and inherits that mask.
"""

from __future__ import annotations

import signal
import threading

MAIN_THREAD_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


def start_background(thread: threading.Thread) -> threading.Thread:
    """Start `thread` (not yet started) with `MAIN_THREAD_SIGNALS` blocked in it; returns it.

    A signal that arrives while the starting thread blocks them stays pending and is delivered
    as soon as the mask is restored, so none is lost. Without `pthread_sigmask` (Windows, where
    only the main thread takes signals) the thread is simply started.
    """
    if not hasattr(signal, "pthread_sigmask"):
        thread.start()
        return thread
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, MAIN_THREAD_SIGNALS)
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return thread
