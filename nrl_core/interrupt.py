"""Interrupting the driver's main thread from a watcher thread (the watchdog, the GCS watch).

Why not SIGINT alone: a job started in the background (``nrl train ... &`` in a script, or under
a CI runner) inherits SIGINT ignored, and libraries install SIGINT handlers of their own; either
leaves a blocked main thread blocked. So the driver installs a handler for a signal of its own,
:data:`SIGNAL`, in its main thread; delivered with ``pthread_kill`` it wakes a thread blocked in
a system call, as SIGINT would, and raises :class:`Interrupted`, a ``KeyboardInterrupt``.
"""

from __future__ import annotations

import _thread
import signal
import threading
from typing import Any

SIGNAL = signal.SIGUSR2


class Interrupted(KeyboardInterrupt):
    """A watcher thread interrupted the main thread (the watcher says why)."""


def _raise(signum: int, frame: Any) -> None:
    raise Interrupted("interrupted by the driver's watcher")


def install() -> bool:
    """Handle :data:`SIGNAL` from now on; False (nothing done) off the main thread, where Python
    cannot install handlers."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(SIGNAL) is not _raise:
        signal.signal(SIGNAL, _raise)
    return True


def interrupt(thread_id: int | None = None) -> None:
    """Interrupt ``thread_id`` (the main thread's by default): with :data:`SIGNAL` when its handler
    is installed, else with SIGINT when Python's own handler takes it, else by setting Python's
    pending-interrupt flag (which does not wake a blocking system call)."""
    target = thread_id or threading.main_thread().ident or 0
    if signal.getsignal(SIGNAL) is _raise:
        signal.pthread_kill(target, SIGNAL)
    elif signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.pthread_kill(target, signal.SIGINT)
    else:
        _thread.interrupt_main()
