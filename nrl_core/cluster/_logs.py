"""The last lines a worker wrote, for error messages about workers that died.

Ray points every worker process's stdout and stderr at ``worker-<id>-<job>-<pid>.{out,err}`` in
its session's log directory; the host records those paths when it starts. A dead process cannot
be asked anything, so the driver reads the files itself (they are on the driver's machine for a
local Ray; on another node only the path can be given).
"""

from __future__ import annotations

import os

__all__ = ["tail_lines"]

# Lines Ray writes into worker logs to attribute output to actors and tasks; noise for a human.
_RAY_MARKERS = (":actor_name:", ":task_name:", ":job_id:")
_READ_BYTES = 64 * 1024


def _tail(path: str, n: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _READ_BYTES))
            data = f.read()
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    if size > _READ_BYTES and lines:
        lines = lines[1:]  # the first line is probably cut
    kept = [line.rstrip() for line in lines if line.strip() and not line.startswith(_RAY_MARKERS)]
    return kept[-n:]


def tail_lines(stdout: str | None, stderr: str | None, n: int = 15) -> list[str]:
    """Up to ``n`` last lines of stdout then up to ``n`` of stderr (tracebacks go there), as
    ``out| ...`` / ``err| ...``; empty when neither file is readable from here."""
    out = [f"out| {line}" for line in _tail(stdout, n)] if stdout else []
    err = [f"err| {line}" for line in _tail(stderr, n)] if stderr else []
    return out + err
