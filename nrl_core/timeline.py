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
"""

from __future__ import annotations

import json
import os
import sys
import time

__all__ = ["ENV", "mark", "pss_kib"]

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
