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
driver opens it with :func:`start_trace` and phases record into it through :func:`span`. Every
worker records a span per call it serves (:class:`WorkerSpans`, one JSON line per call in its own
file under ``trace.d/``, whose path reaches the workers as ``$NRL_TRACE_DIR``); the watchdog's
monitor thread merges those files into the trace every few seconds and at the end, one Perfetto
row (pid) per rank.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

__all__ = ["ENV", "TRACE_DIR_ENV", "Trace", "WorkerSpans", "mark", "merge_workers", "pss_kib", "span", "start_trace", "stop_trace"]

ENV = "NRL_TIMELINE"
TRACE_DIR_ENV = "NRL_TRACE_DIR"


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
        self.worker_dir = path.parent / f"{path.stem}.d"
        self.worker_dir.mkdir(exist_ok=True)
        for stale in self.worker_dir.glob("*.jsonl"):  # a previous run in the same log directory
            stale.unlink()
        self._offsets: dict[Path, int] = {}

    def span(self, name: str, start_s: float, seconds: float, *, pid: int | None = None, tid: str = "driver",
             **args: object) -> None:
        """A complete event (``"ph": "X"``): ``name`` ran ``seconds`` from unix time ``start_s``."""
        event = {"name": name, "ph": "X", "ts": round(start_s * 1e6), "dur": round(seconds * 1e6),
                 "pid": os.getpid() if pid is None else pid, "tid": tid}
        if args:
            event["args"] = args
        self._write([event])

    def _write(self, events: list[dict[str, object]], lines: list[str] | None = None) -> None:
        """Append ``events`` and ready-made event ``lines`` as one write."""
        text = ",\n".join([json.dumps(event) for event in events] + (lines or []))
        if not text:
            return
        with self._lock:
            if self._file.closed:
                return
            self._file.write(self._separator + text)
            self._file.flush()
            self._separator = ",\n"

    def merge_workers(self) -> int:
        """Append the spans the workers wrote since the last merge; returns how many. Each
        worker file ``<group>-rank<r>-pid<p>.jsonl`` becomes its own row, named after the rank
        (about 3 µs a span: the lines are rewritten as text, not parsed as JSON)."""
        named: list[dict[str, object]] = []
        lines: list[str] = []
        for path in sorted(self.worker_dir.glob("*.jsonl")):
            offset = self._offsets.get(path)
            try:
                with open(path, "rb") as f:
                    f.seek(offset or 0)
                    data = f.read()
            except OSError:
                continue
            complete = data[: data.rfind(b"\n") + 1]  # a line being written is taken next time
            self._offsets[path] = (offset or 0) + len(complete)
            tid, _, pid_text = path.stem.rpartition("-pid")
            pid = int(pid_text)
            if offset is None:
                group, _, rank = tid.rpartition("-rank")
                named.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{group} rank {rank}"}})
                named.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": int(rank) + 1}})
            for line in complete.decode(errors="replace").splitlines():
                try:  # ["name", start_s, seconds], as WorkerSpans.record writes it
                    name, times = line[2:-1].split('", ', 1)
                    start_s, seconds = times.split(", ")
                    lines.append(f'{{"name": "{name}", "ph": "X", "ts": {round(float(start_s) * 1e6)}, '
                                 f'"dur": {round(float(seconds) * 1e6)}, "pid": {pid}, "tid": "{tid}"}}')
                except ValueError:
                    continue
        self._write(named, lines)
        return len(lines)

    def close(self) -> None:
        self.merge_workers()
        with self._lock:
            if not self._file.closed:
                self._file.write("\n]\n")
                self._file.close()


class WorkerSpans:
    """A worker's side of the trace: one ``[method, start_s, seconds]`` JSON line per call it
    served, appended to its own file (a single unbuffered ``write``, a few microseconds)."""

    def __init__(self, directory: str, group: str, rank: int) -> None:
        self.path = Path(directory) / f"{group}-rank{rank}-pid{os.getpid()}.jsonl"
        self._fd: int | None = None

    @classmethod
    def from_env(cls, group: str, rank: int) -> WorkerSpans | None:
        directory = os.environ.get(TRACE_DIR_ENV)
        return cls(directory, group, rank) if directory else None

    def record(self, name: str, start_s: float, seconds: float) -> None:
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.write(self._fd, f'["{name}", {start_s:.6f}, {seconds:.6f}]\n'.encode())
        except OSError:  # the log directory went away: the trace is not worth failing a call for
            pass


_trace: Trace | None = None


def start_trace(path: Path) -> Trace:
    """Open the run's trace; :func:`span` records into it until :func:`stop_trace`."""
    global _trace
    stop_trace()
    _trace = Trace(path)
    os.environ[TRACE_DIR_ENV] = str(_trace.worker_dir)  # workers started from now on record into it
    return _trace


def stop_trace() -> None:
    global _trace
    if _trace is not None:
        os.environ.pop(TRACE_DIR_ENV, None)
        _trace.close()
        _trace = None


def span(name: str, start_s: float, seconds: float, **args: object) -> None:
    """Record a phase in the run's trace, if one is open (a global look-up otherwise)."""
    if _trace is not None:
        _trace.span(name, start_s, seconds, **args)


def merge_workers() -> None:
    """Merge the workers' new spans into the run's trace, if one is open (the watchdog's monitor
    thread does, every few seconds, off the driver's path)."""
    if _trace is not None:
        _trace.merge_workers()
