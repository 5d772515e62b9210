"""Process-wide clock restore on normal exit and on SIGINT/SIGTERM, even while the main thread
is blocked.

Why a watcher thread besides the signal handler: Python runs signal handlers only in the main
thread, between bytecodes. A rank blocked inside a C call -- a gloo or NCCL collective waiting
for a dead peer, a CUDA synchronize -- would run the handler only when that call returns, which
may be the collective's timeout (minutes) or never, and the GPU stays locked meanwhile. Python's
C-level handler also writes the signal number to the wakeup fd; a daemon thread reads it, gives
the main thread a moment to handle the signal itself, and otherwise restores every controller
from its own thread (NVML calls release the GIL, and the blocked main thread holds no lock the
restore needs). If the signal's previous disposition was the default (terminate), the watcher
then ends the process the way the signal would have. A Python handler of the application
(KeyboardInterrupt, checkpoint-on-SIGTERM) must run in the main thread: the watcher re-delivers
the signal to it, so a blocking call that the kernel did not interrupt (it gave the signal to
another thread, e.g. OpenBLAS's, which perseus-ext cannot make block it) returns and the handler
runs now; a call that cannot be interrupted runs it when it returns.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import threading
import time
import weakref
from typing import Any, Protocol

from perseus_ext.background import start_background

logger = logging.getLogger(__name__)

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
MAIN_THREAD_GRACE_S = 0.5  # how long the main thread gets to run the handler itself
# How long the main thread's handler waits for the restore it started on its own thread before
# the signal goes on: the restore may need a lock the interrupted main thread holds.
RESTORE_WAIT_S = 5.0


class Closable(Protocol):
    def close(self) -> None: ...


_live: "weakref.WeakSet[Any]" = weakref.WeakSet()
_previous_handlers: dict[int, Any] = {}
_registry_lock = threading.Lock()
_received: dict[int, int] = {}  # signal -> deliveries the watcher has seen
_handled: dict[int, int] = {}  # signal -> times the main-thread handler ran
_echoes: dict[int, int] = {}  # signal -> re-deliveries to the main thread the watcher will read back
_watcher: threading.Thread | None = None
_interrupt_hooks: "weakref.WeakSet[Any]" = weakref.WeakSet()  # told after an interrupt restored the clocks


class InterruptHook(Protocol):
    def interrupted(self, signal_name: str, clocks_restored: bool) -> None: ...


def on_interrupt(target: InterruptHook) -> None:
    """Call `target.interrupted(...)` when SIGINT/SIGTERM arrives, after every controller has
    restored its clocks (the runtime writes its summary and says so); held weakly."""
    _interrupt_hooks.add(target)


def forget_interrupt(target: InterruptHook) -> None:
    _interrupt_hooks.discard(target)


def _restore_and_report(signum: int) -> None:
    """Restore every controller, then tell the interrupt hooks whether all of them did."""
    controllers = list(_live)
    close_all()
    restored = all(getattr(controller, "restore_error", None) is None for controller in controllers)
    for target in list(_interrupt_hooks):
        try:
            target.interrupted(signal.Signals(signum).name, restored)
        except Exception:  # the process is ending: what failed is logged, the signal goes on
            logger.exception("perseus-ext: reporting the interruption failed")


def close_all() -> None:
    """Restore every live controller of this process (atexit, signal and watcher path)."""
    for controller in list(_live):
        try:
            controller.close()
        except Exception:  # close() never raises; a last resort must not either
            logger.debug("perseus-ext: closing %r failed", controller, exc_info=True)


def register(controller: Closable, handle_signals: bool) -> None:
    """Restore `controller` at exit; with `handle_signals`, also on SIGINT/SIGTERM."""
    with _registry_lock:
        _live.add(controller)
        if not handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for signum in HANDLED_SIGNALS:
            if signum in _previous_handlers:
                continue
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN or previous is None:
                continue  # ignored (or set outside Python): do not make it fatal
            _previous_handlers[signum] = previous
            signal.signal(signum, _on_signal)
        if _previous_handlers:
            _start_watcher()


def unregister(controller: Closable) -> None:
    """Forget a closed controller; the last one hands the signals back (main thread only)."""
    _live.discard(controller)
    if _live or threading.current_thread() is not threading.main_thread():
        return
    with _registry_lock:
        for signum, previous in list(_previous_handlers.items()):
            if signal.getsignal(signum) is _on_signal:
                signal.signal(signum, previous)
            del _previous_handlers[signum]


def _on_signal(signum: int, frame: Any) -> None:
    """Restore clocks first, then let the signal do what it did before (usually: end us).

    The handler runs between two bytecodes of the main thread, which may hold a lock at that
    moment (a controller's change queue, the simulated device's): a restore that needs it would
    wait for ever on the thread that holds it. So the restore runs on a thread of its own, which
    the handler waits for at most `RESTORE_WAIT_S`; past that the signal goes on, the main
    thread's unwinding (KeyboardInterrupt) releases the lock, and the restore finishes then (a
    non-daemon thread: the interpreter waits for it, and every wait inside it is bounded)."""
    _handled[signum] = _handled.get(signum, 0) + 1
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    restoring = threading.Thread(target=_restore_and_report, args=(signum,), name="perseus-signal-restore")
    restoring.start()
    restoring.join(RESTORE_WAIT_S)
    if callable(previous):
        previous(signum, frame)
    else:  # SIG_DFL: re-deliver with the default action
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _start_watcher() -> None:
    """Route signal numbers to a watcher thread through Python's wakeup fd (main thread only).
    An application that already uses the wakeup fd (an asyncio loop) keeps it: then only the
    handler path remains."""
    global _watcher
    if _watcher is not None and _watcher.is_alive():
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (ValueError, OSError) as err:
        logger.debug("perseus-ext: no signal wakeup fd (%s); signals are handled in the main thread only", err)
        os.close(read_fd)
        os.close(write_fd)
        return
    if previous != -1:
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return
    _watcher = start_background(
        threading.Thread(target=_watch, args=(read_fd,), name="perseus-signal-watcher", daemon=True)
    )


def _watch(read_fd: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum in HANDLED_SIGNALS and signum in _previous_handlers:
                if _echoes.get(signum, 0) > 0:  # our own re-delivery, not a new signal
                    _echoes[signum] -= 1
                    continue
                _received[signum] = _received.get(signum, 0) + 1
                _act_if_main_thread_is_stuck(signum, _received[signum])


def _act_if_main_thread_is_stuck(signum: int, delivery: int) -> None:
    deadline = time.monotonic() + MAIN_THREAD_GRACE_S
    while time.monotonic() < deadline:
        if _handled.get(signum, 0) >= delivery:
            return  # the main thread ran the handler: it restores and ends the process itself
        time.sleep(0.01)
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    logger.warning("perseus-ext: %s arrived while the main thread is blocked; restoring GPU clocks "
                   "from the signal watcher", signal.Signals(signum).name)
    _restore_and_report(signum)
    if previous is signal.SIG_DFL:
        _die_by(signum)
    else:
        _wake_main_thread(signum)


def _wake_main_thread(signum: int) -> None:
    """Deliver `signum` to the main thread itself, so that its blocking call returns (EINTR)
    and the application's handler runs. CPython runs a handler once for deliveries that arrive
    before it runs, so the handler does not run twice for one signal."""
    _echoes[signum] = _echoes.get(signum, 0) + 1
    try:
        signal.pthread_kill(threading.main_thread().ident, signum)
    except (OSError, ValueError, AttributeError):  # no such thread any more, or no pthread_kill
        _echoes[signum] -= 1


def _die_by(signum: int) -> None:
    """End the process as the signal's default action would (status: killed by `signum`)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal(ctypes.c_int(signum), ctypes.c_void_p(0))  # SIG_DFL, from any thread
        os.kill(os.getpid(), signum)
        time.sleep(1.0)  # delivery is asynchronous
    except (OSError, AttributeError):
        pass
    os._exit(128 + signum)


atexit.register(close_all)
