"""Every process's Python stack, on request, even while the process is stuck.

A process calls :func:`install_stack_dump` once (every worker host at start, the driver when its
watchdog starts): from then on ``SIGUSR1`` makes :mod:`faulthandler` write every thread's stack
to the process's own stack file, from C, so a thread blocked inside a collective or a system call
still answers. :func:`dump_processes` signals processes of this machine and copies what each
wrote into the run's log directory; a process that does not answer is named with its state (a
process in uninterruptible I/O, state ``D``, cannot even be killed). ``py-spy``, when it is
installed, adds each process's native stack, or, for a stopped process, which answers no signal,
its Python stack.

A process with a GPU also keeps PyTorch's NCCL flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``,
set to 2000 entries unless the user set it, before any process group exists) and runs a thread
that, when asked through a request file beside its stack file, writes the recorder's dump
(``torch._C._distributed_c10d._dump_nccl_trace``, or ``_dump_fr_trace`` where that is the name)
into the run's stack directory: the collectives each rank issued, and which it is still in. That
thread runs Python, so it answers only while the stuck call has released the GIL (NCCL waits do).
Without a GPU none of this happens.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = ["SIGNAL", "StackTarget", "answers_stack_signal", "dump_flight_recorder", "dump_processes", "install_stack_dump",
           "process_start_time", "process_state", "py_spy", "stack_file"]

SIGNAL = signal.SIGUSR1
_installed: IO[str] | None = None
#: The flight recorder's ring buffer size: the NCCL name, and the one newer PyTorch reads too.
FLIGHT_RECORDER_ENV = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")
FLIGHT_RECORDER_ENTRIES = "2000"


def stack_file(pid: int) -> Path:
    """Where process ``pid`` writes its stacks when signalled (on its own machine)."""
    return Path(tempfile.gettempdir()) / f"nrl-stacks-{os.getuid()}" / f"{pid}.txt"


def process_start_time(pid: int) -> float | None:
    """When process ``pid`` of this machine started (seconds since the epoch), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def answers_stack_signal(pid: int) -> bool:
    """Whether ``pid`` has the stack handler, so that ``SIGUSR1`` dumps its stacks instead of killing
    it: its stack file exists and was opened after the process started. A file older than the
    process was left by a dead process whose pid the kernel has given to another one."""
    started = process_start_time(pid)
    try:
        opened = stack_file(pid).stat().st_mtime
    except OSError:
        return False
    return started is not None and opened + 1.0 >= started  # btime has a resolution of one second


def install_stack_dump() -> Path:
    """Make ``SIGUSR1`` dump this process's threads into :func:`stack_file`; idempotent."""
    global _installed
    path = stack_file(os.getpid())
    if _installed is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _installed = open(path, "w")  # truncates what a dead process with this pid left
        faulthandler.register(SIGNAL, file=_installed, all_threads=True, chain=False)
        if has_gpu():
            _start_flight_recorder(path)
    return path


def has_gpu() -> bool:
    """Whether this process may use a GPU: ``CUDA_VISIBLE_DEVICES`` names one (Ray sets it for an
    actor with GPUs, empty for one without), or, unset, the machine has an NVIDIA device."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return visible.strip() not in ("", "-1")
    return os.path.exists("/dev/nvidiactl")


def _flight_recorder_request(pid: int) -> Path:
    """Where the driver asks process ``pid`` for its flight recorder's dump (the file holds the
    destination path); ``.fr-ready`` beside it says the process answers such requests."""
    return stack_file(pid).with_suffix(".fr-request")


def _start_flight_recorder(path: Path) -> None:
    for name in FLIGHT_RECORDER_ENV:  # read when the first NCCL process group is made: before it
        os.environ.setdefault(name, FLIGHT_RECORDER_ENTRIES)
    request = _flight_recorder_request(os.getpid())
    request.unlink(missing_ok=True)
    threading.Thread(target=_answer_flight_recorder_requests, args=(request,), name="nrl-flight-recorder",
                     daemon=True).start()
    path.with_suffix(".fr-ready").touch()


def _answer_flight_recorder_requests(request: Path, poll_s: float = 0.5) -> None:
    while True:
        time.sleep(poll_s)
        try:
            dest = Path(request.read_text().strip())
        except OSError:
            continue
        if not dest.name:
            continue  # the driver writes requests whole (a rename), but be sure
        dump = dump_flight_recorder()
        partial = dest.with_name(dest.name + ".part")
        partial.write_bytes(dump if dump is not None else b"")  # empty: this PyTorch has no recorder
        os.replace(partial, dest)
        request.unlink(missing_ok=True)


def dump_flight_recorder() -> bytes | None:
    """PyTorch's flight recorder dump of this process (a pickle: ``pickle.loads`` it, or read it
    with ``torch.distributed.flight_recorder``'s analyzer); None where this PyTorch has none."""
    if "torch" not in sys.modules:  # a process that never imported torch has no process group
        return None
    try:
        from torch._C import _distributed_c10d as c10d
    except Exception:  # one built without distributed
        return None
    for name in ("_dump_nccl_trace", "_dump_fr_trace"):
        fn = getattr(c10d, name, None)
        if fn is not None:
            try:
                return bytes(fn())
            except Exception:  # no NCCL process group here, or nothing recorded
                continue
    return None


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
        elif not answers_stack_signal(target.pid):  # no handler: SIGUSR1's default action would kill it
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
    _flight_recorders([t for t in targets if t.local and status.get(t.label) != "gone"], dest, wait_s, status)
    _native_stacks([t for t in targets if t.local and status.get(t.label) != "gone"], dest)
    return status


def _flight_recorders(targets: Sequence[StackTarget], dest: Path, wait_s: float, status: dict[str, str]) -> None:
    """Ask each target that keeps a flight recorder (a GPU process) for its dump, into
    ``dest/<label>.nccl_trace.pkl``; notes in ``status`` whether it came."""
    asked: dict[str, Path] = {}
    for target in targets:
        if stack_file(target.pid).with_suffix(".fr-ready").exists():
            out = dest / f"{target.label}.nccl_trace.pkl"
            request = _flight_recorder_request(target.pid)
            request.with_name(request.name + ".part").write_text(f"{out}\n")
            os.replace(request.with_name(request.name + ".part"), request)  # whole, or not at all
            asked[target.label] = out
    deadline = time.monotonic() + wait_s
    while asked and time.monotonic() < deadline:
        time.sleep(0.1)
        for label, out in list(asked.items()):
            if out.exists():
                what = "NCCL flight recorder dumped" if out.stat().st_size else "no flight recorder in this PyTorch"
                status[label] = f"{status.get(label, '')}; {what}".lstrip("; ")
                del asked[label]
    for label in asked:
        status[label] = f"{status.get(label, '')}; NCCL flight recorder: no answer (its thread needs the GIL)".lstrip("; ")


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


def py_spy() -> str | None:
    """The ``py-spy`` on ``PATH``, or the one installed beside this interpreter (a virtual
    environment's, run without activating it); None where there is none."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if os.access(beside, os.X_OK) else None)


def _native_stacks(targets: Sequence[StackTarget], dest: Path, deadline_s: float = 30.0) -> None:
    """``py-spy dump --native`` of each target into ``<label>.native.txt``, where py-spy exists,
    all at once within ``deadline_s``. A stopped or traced process cannot be paused for its
    native stack, and pausing one in uninterruptible I/O can leave it stopped: their Python stack
    is read without pausing them (``--nonblocking``) instead."""
    spy = py_spy()
    if spy is None:
        return
    running: list[tuple[StackTarget, subprocess.Popen[str] | OSError]] = []
    for target in targets:
        how = ["--nonblocking"] if process_state(target.pid) in ("T", "t", "D") else ["--native"]
        try:
            running.append((target, subprocess.Popen([spy, "dump", *how, "--pid", str(target.pid)], text=True,
                                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
        except OSError as exc:
            running.append((target, exc))
    end = time.monotonic() + deadline_s
    for target, spying in running:
        if isinstance(spying, OSError):
            (dest / f"{target.label}.native.txt").write_text(f"py-spy failed: {spying}\n")
            continue
        try:
            out, _ = spying.communicate(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            spying.kill()
            out, _ = spying.communicate()
            out = f"{out or ''}py-spy gave no stack within {deadline_s:.0f} s\n"
        (dest / f"{target.label}.native.txt").write_text(out or "")
