"""Every process's Python stack, on request, even while the process is stuck.

A process calls :func:`install_stack_dump` once (every worker host at start, the driver when its
watchdog starts): from then on ``SIGUSR1`` makes :mod:`faulthandler` write every thread's stack
to the process's own stack file, from C, so a thread blocked inside a collective or a system call
still answers. :func:`dump_processes` signals processes of this machine and copies what each
wrote into the run's log directory; a process that does not answer is named with its state (a
process in uninterruptible I/O, state ``D``, cannot even be killed). ``py-spy``, when it is
installed, adds each process's native stack.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Sequence

__all__ = ["SIGNAL", "StackTarget", "install_stack_dump", "stack_file", "dump_processes", "process_state"]

SIGNAL = signal.SIGUSR1
_installed: IO[str] | None = None


def stack_file(pid: int) -> Path:
    """Where process ``pid`` writes its stacks when signalled (on its own machine)."""
    return Path(tempfile.gettempdir()) / f"nrl-stacks-{os.getuid()}" / f"{pid}.txt"


def install_stack_dump() -> Path:
    """Make ``SIGUSR1`` dump this process's threads into :func:`stack_file`; idempotent."""
    global _installed
    path = stack_file(os.getpid())
    if _installed is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _installed = open(path, "w")  # truncates what a dead process with this pid left
        faulthandler.register(SIGNAL, file=_installed, all_threads=True, chain=False)
    return path


def process_state(pid: int) -> str | None:
    """The one-letter state of a process of this machine (``R``, ``S``, ``D``...), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@dataclass(frozen=True)
class StackTarget:
    """A process whose stack is wanted: ``label`` names its file, ``local`` says it runs here."""

    label: str
    pid: int
    local: bool = True


def dump_processes(targets: Sequence[StackTarget], dest: Path, wait_s: float = 5.0) -> dict[str, str]:
    """Signal every target, wait up to ``wait_s`` for their dumps and write each into
    ``dest/<label>.txt``; returns what happened to each label (``written`` or why not)."""
    dest.mkdir(parents=True, exist_ok=True)
    status: dict[str, str] = {}
    started: dict[str, tuple[StackTarget, int]] = {}
    for target in targets:
        path = stack_file(target.pid)
        if not target.local:
            status[target.label] = "on another node: its stack file is there"
        elif not path.exists():  # no handler: SIGUSR1's default action would kill it
            status[target.label] = "gone" if process_state(target.pid) is None else "no stack handler installed"
        else:
            try:
                offset = path.stat().st_size
                os.kill(target.pid, SIGNAL)
                started[target.label] = (target, offset)
            except ProcessLookupError:
                status[target.label] = "gone"
    deadline = time.monotonic() + wait_s
    while started and time.monotonic() < deadline:
        time.sleep(0.2)
        for label, (target, offset) in list(started.items()):
            if _settled(stack_file(target.pid), offset):
                (dest / f"{label}.txt").write_bytes(_read_from(stack_file(target.pid), offset))
                status[label] = "written"
                del started[label]
    for label, (target, _) in started.items():
        state = process_state(target.pid)
        status[label] = ("gone" if state is None else f"no answer (state {state}"
                         f"{': uninterruptible I/O, it cannot be killed either' if state == 'D' else ''})")
    _native_stacks([t for t in targets if t.local and status.get(t.label) != "gone"], dest)
    return status


def _settled(path: Path, offset: int) -> bool:
    """The dump after ``offset`` has started and stopped growing."""
    first = path.stat().st_size
    if first <= offset:
        return False
    time.sleep(0.05)
    return path.stat().st_size == first


def _read_from(path: Path, offset: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read()


def _native_stacks(targets: Sequence[StackTarget], dest: Path) -> None:
    """``py-spy dump --native`` of each target into ``<label>.native.txt``, where py-spy exists."""
    spy = shutil.which("py-spy")
    if spy is None:
        return
    for target in targets:
        try:
            out = subprocess.run([spy, "dump", "--native", "--pid", str(target.pid)], capture_output=True,
                                 text=True, timeout=30)
            (dest / f"{target.label}.native.txt").write_text(out.stdout + out.stderr)
        except (OSError, subprocess.TimeoutExpired) as exc:
            (dest / f"{target.label}.native.txt").write_text(f"py-spy failed: {exc}\n")
