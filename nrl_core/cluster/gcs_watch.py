"""Noticing that the private local Ray lost its GCS or its raylet, and leaving nothing of it running.

The GCS is Ray's control store. When it dies, actors that are already running keep answering the
driver, so a run goes on; but the first call that needs the GCS (removing a placement group,
starting a worker) blocks for Ray's reconnect timeout, 60 s, before Ray aborts the process, and
the raylet's agents outlive the driver by as long. The raylet runs the node: without it the
actors again keep answering for a while (a run of 10 steps ended with exit 0, one of 40 failed
32 steps later, blaming the policy worker). A GCS or raylet that is stopped (SIGSTOP, a
debugger) is no better, and Ray's own shutdown then waits on it for minutes. So for the Ray it started, the driver watches both processes: a thread polls them,
and when one is gone, or frozen for :data:`FROZEN_S`, records why (:func:`cluster_failure`) and
interrupts the main thread with a real signal (:mod:`nrl_core.interrupt`: a ``KeyboardInterrupt``,
which Ray's blocking calls honour; ``_thread.interrupt_main`` alone would not wake a thread
blocked in a system call). The CLI
prints that reason as its one-line error, and :func:`kill_ray_processes` SIGKILLs every process of
the local Ray, the node's own and all their descendants (a dead raylet orphans its agents and
workers; they ignore SIGTERM while waiting for the GCS).

The main thread may not take the interrupt: a Ray call that waits on the GCS in C++ checks for
signals only when Ray's own timeout aborts the whole process (exit 1, 60 s later). So when the
interrupt is not acknowledged (:func:`stop_watching`) within :data:`GRACE_S`, the watcher ends the
process itself through ``on_unheeded``, which Ray would have done anyway, later and less clearly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from nrl_core import interrupt
from nrl_core.stacks import process_state
from nrl_core.suspects import STATES
from nrl_core.suspects import descendants as _descendants

__all__ = ["FROZEN_S", "cluster_failure", "frozen", "kill_ray_processes", "stop_watching", "watch_local_ray"]

POLL_S = 0.25
GRACE_S = 10.0
#: A GCS or raylet stopped (SIGSTOP, a debugger) this long is frozen. Uninterruptible I/O (``D``)
#: is not counted: a healthy raylet can sit in it for seconds under write throttling or NFS.
FROZEN_S = 5.0
FROZEN_STATES = {letter: STATES[letter] for letter in ("T", "t")}

_failure: str | None = None
_stop: threading.Event | None = None


def cluster_failure() -> str | None:
    """Why the watched local Ray cannot go on (one line), or None while it is healthy."""
    return _failure


def watch_local_ray(processes: Sequence[tuple[str, subprocess.Popen[Any]]], *, is_connected: Callable[[], bool],
                    on_unheeded: Callable[[str], None]) -> None:
    """Poll ``processes`` (the GCS and the raylet this driver started, each with how a message
    names it) from a daemon thread. ``is_connected()`` tells a death from a shutdown in progress
    (Ray disconnects before it stops its processes). ``on_unheeded(reason)`` runs on the watcher's
    thread when the main thread has not called :func:`stop_watching` within :data:`GRACE_S` of the
    interrupt; it is expected to end the process."""
    global _failure, _stop
    interrupt.install()  # the main thread is interrupted whatever SIGINT does in this process
    stop_watching()
    _failure = None
    _stop = stop = threading.Event()

    def watch() -> None:
        global _failure
        frozen_since: dict[int, float] = {}
        while not stop.wait(POLL_S):
            how = _why_gone_or_frozen(processes, frozen_since)
            if how is None:
                continue
            if stop.is_set() or not is_connected():
                return
            _failure = (f"cluster: the local Ray's {how}; the run cannot continue without it (complete "
                        "checkpoints are intact: rerun to resume)")
            interrupt.interrupt()
            if not stop.wait(GRACE_S):
                on_unheeded(_failure)
            return

    threading.Thread(target=watch, name="nrl-gcs-watch", daemon=True).start()


def _why_gone_or_frozen(processes: Sequence[tuple[str, subprocess.Popen[Any]]],
                        frozen_since: dict[int, float]) -> str | None:
    """``<name> <what happened>`` for the first of ``processes`` that died, or that has been
    stopped for :data:`FROZEN_S` (``frozen_since`` keeps when each was first seen so); None while
    all run."""
    now = time.monotonic()
    for name, process in processes:
        code = process.poll()
        if code is not None:
            return f"{name} " + (f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}")
        state = process_state(process.pid)
        if state not in FROZEN_STATES:
            frozen_since.pop(process.pid, None)
        elif now - frozen_since.setdefault(process.pid, now) >= FROZEN_S:
            return f"{name} is {FROZEN_STATES[state]} (state {state}) for {FROZEN_S:.0f} s"
    return None


def frozen(processes: Sequence[subprocess.Popen[Any]]) -> bool:
    """Whether any of ``processes`` is stopped now: Ray's graceful shutdown would wait on it (for
    minutes), so its processes are killed instead."""
    return any(process.poll() is None and process_state(process.pid) in FROZEN_STATES for process in processes)


def stop_watching() -> None:
    """Stop the watcher; after a GCS death this acknowledges the interrupt (the caller handles it)."""
    global _stop
    if _stop is not None:
        _stop.set()
        _stop = None


def kill_ray_processes(node: Any) -> list[int]:
    """SIGKILL the processes of a local Ray ``node`` (Ray's ``_global_node``) and every descendant
    of them; returns the pids signalled. The tree is read before anything dies, since a dead
    parent's children are re-parented and could no longer be found."""
    roots = [info.process.pid for infos in node.all_processes.values() for info in infos]
    pids = roots + _descendants(roots)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return pids
