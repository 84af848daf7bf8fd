"""Start-up timeline marks: where the seconds before a run's first step go.

``mark(event)`` appends one JSON line ``{"t": <unix time>, "pid": ..., "event": ...}`` to the file
that ``NRL_TIMELINE`` names, and does nothing when it is unset (a dictionary look-up per call).
The variable starts with ``NRL_``, so Ray forwards it to every worker
(:data:`nrl_core.cluster.ray_cluster.FORWARDED_ENV_PREFIXES`) and marks from the driver and the
actors land in one file; ``benchmarks/startup_profile.py`` sets it and prints the timeline.
Once torch is imported, a mark also records the process's torch intra-op threads and the CPUs it
may run on (``threads``, ``cpus``), and every mark the process's proportional set size
(``pss_mib``: its memory with shared pages divided among the processes sharing them, from
:func:`pss_kib`; about 10 ms per GB mapped, so only while a timeline is recorded). Lines are short
single ``write`` calls on a file opened for appending, so processes do not interleave within a line.

The run's own timeline is :class:`Trace`: every phase of every step as a complete event in the
Chrome/Perfetto trace format (``<log_dir>/trace.json``), on by default (``watchdog.trace``); the
driver opens it with :func:`start_trace` and phases record into it through :func:`span`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

__all__ = ["ENV", "Trace", "mark", "pss_kib", "span", "start_trace", "stop_trace"]

ENV = "NRL_TIMELINE"


def mark(event: str, **fields: object) -> None:
    """Record that ``event`` happened now in this process (extra ``fields`` go into the line)."""
    path = os.environ.get(ENV)
    if not path:
        return
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(os, "sched_getaffinity"):  # what this process computes with now
        fields = {"threads": torch.get_num_threads(), "cpus": len(os.sched_getaffinity(0)), **fields}
    pss = pss_kib()
    if pss is not None:
        fields = {**fields, "pss_mib": pss >> 10}
    line = json.dumps({"t": time.time(), "pid": os.getpid(), "event": event, **fields}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def pss_kib(pid: int | str = "self") -> int | None:
    """Proportional set size of process ``pid`` in KiB (``/proc/<pid>/smaps_rollup``); None where
    it cannot be read (the process is gone, or no such file on this OS)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class Trace:
    """A JSON array of trace events written as they happen: ``[`` at open, one event per line
    after it, ``]`` at :meth:`close`. Perfetto and ``chrome://tracing`` also open the file of a
    run that is still going (or was killed), whose closing bracket is missing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "w")
        self._file.write("[\n")
        self._separator = ""
        self._lock = threading.Lock()

    def span(self, name: str, start_s: float, seconds: float, *, pid: int | None = None, tid: str = "driver",
             **args: object) -> None:
        """A complete event (``"ph": "X"``): ``name`` ran ``seconds`` from unix time ``start_s``."""
        event = {"name": name, "ph": "X", "ts": round(start_s * 1e6), "dur": round(seconds * 1e6),
                 "pid": os.getpid() if pid is None else pid, "tid": tid}
        if args:
            event["args"] = args
        line = self._separator + json.dumps(event)
        with self._lock:
            if self._file.closed:
                return
            self._file.write(line)
            self._file.flush()
            self._separator = ",\n"

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write("\n]\n")
                self._file.close()


_trace: Trace | None = None


def start_trace(path: Path) -> Trace:
    """Open the run's trace; :func:`span` records into it until :func:`stop_trace`."""
    global _trace
    stop_trace()
    _trace = Trace(path)
    return _trace


def stop_trace() -> None:
    global _trace
    if _trace is not None:
        _trace.close()
        _trace = None


def span(name: str, start_s: float, seconds: float, **args: object) -> None:
    """Record a phase in the run's trace, if one is open (a global look-up otherwise)."""
    if _trace is not None:
        _trace.span(name, start_s, seconds, **args)
