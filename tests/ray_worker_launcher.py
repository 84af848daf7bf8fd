"""How the shared Ray's workers, and the processes they spawn, start through the worker zygote
(tests/zygote.py): hand the start to the zygote, which forks a process that has already imported
what nrl's workers import; or, when the zygote cannot stand in for a fresh interpreter, start one.

Two commands run this script. Raylet runs it in place of Ray's ``default_worker.py``, with that
script's arguments. A worker's ``multiprocessing`` spawns through it (the zygote sets it as the
executable), with a fresh interpreter's arguments (``-c PROGRAM ...``, vLLM's engine core among
them); every descriptor it inherited is handed on under the same number. It stays alive while the
forked process runs and ends with its exit status, and each of the two ends when the other does, so
whoever started it sees one process. It imports almost nothing: it runs once per process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import sys
from typing import NoReturn

SOCKET = "NRL_TEST_WORKER_ZYGOTE"
#: Variables read once, while the zygote imported its libraries (kernel choice, thread pools, hub
#: paths, start-up hooks): a process whose value differs from the zygote's starts fresh instead.
IMPORT_TIME = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "ATEN_", "MKL_", "ONEDNN_", "DNNL_",
               "KMP_", "GOMP_", "LD_", "PYTHON", "TRITON", "TOKENIZERS", "NRL_TEST_BREAK", "CUDA", "NVIDIA",
               "VLLM_PLUGINS", "VLLM_TARGET_DEVICE")
#: ... except these: the forked process applies the first four itself (tests/zygote.py), Python
#: reads the breakpoint hook when it is called, a preloaded library is compared by what the
#: zygote has loaded, and Inductor reads its cache directory whenever it compiles (nrl's vLLM
#: worker names one per CPU pin, in the process that hosts an engine). vLLM reads its other
#: variables when it uses them, and its logging variables are applied again after the fork.
NOT_COMPARED = ("PYTHONPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS",
                "PYTHONBREAKPOINT", "LD_PRELOAD", "TORCHINDUCTOR_CACHE_DIR")


def import_time_view(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(IMPORT_TIME) and k not in NOT_COMPARED}


def can_fork(environ: dict[str, str], zygote: dict) -> bool:
    """Whether a process with ``environ`` would set up its libraries as the zygote did. A variable
    the zygote's own imports set (vLLM sets some of torch's) may hold the value from before them or
    the one they set: a fresh interpreter importing the same libraries ends at the latter."""
    before, after = import_time_view(zygote["before"]), import_time_view(zygote["after"])
    mine = import_time_view(environ)
    if any(mine.get(key) not in (before.get(key), after.get(key)) for key in set(mine) | set(before) | set(after)):
        return False
    preloaded = [os.path.realpath(p) for p in environ.get("LD_PRELOAD", "").replace(":", " ").split() if p]
    if not set(preloaded) <= set(zygote["loaded"]):
        return False
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return not any(os.path.exists(os.path.join(p, name)) for p in paths
                   for name in ("sitecustomize.py", "usercustomize.py"))


def run_fresh(args: list[str], spawned: bool) -> NoReturn:
    if spawned:  # an interpreter multiprocessing asked for, as it asked
        os.execv(sys.executable, [sys.executable, *args])
    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.origin is not None
    worker = os.path.join(os.path.dirname(spec.origin), "_private", "workers", "default_worker.py")
    os.execv(sys.executable, [sys.executable, worker, *args])


def spawned_program(args: list[str]) -> tuple[str | None, list[str]]:
    """``[-B] -c PROGRAM ARGS`` (what ``multiprocessing`` spawns): PROGRAM and ARGS. Other
    interpreter flags are not handled here: None, and the interpreter starts fresh."""
    flags = args[:1] == ["-B"]
    rest = args[1:] if flags else args
    if rest[:1] != ["-c"] or len(rest) < 2:
        return None, args
    return rest[1], rest[2:]


def inherited_fds() -> list[int]:
    """This process's descriptors above the standard three (the listing's own is gone once listed)."""
    listed = sorted(int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2)
    return [fd for fd in listed if _is_open(fd)]


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def main(args: list[str]) -> None:
    spawn = "--spawn" in args[:1]
    if spawn:
        args = args[1:]
    program, argv = spawned_program(args) if spawn else (None, args)
    if spawn and program is None:
        run_fresh(args, spawn)
    address = os.environ.get(SOCKET)
    if not address:
        run_fresh(args, spawn)
    try:
        with open(address + ".env") as f:
            zygote_environ = json.load(f)
    except OSError:
        run_fresh(args, spawn)
    if not can_fork(dict(os.environ), zygote_environ):
        run_fresh(args, spawn)
    fds = [0, 1, 2, *(inherited_fds() if spawn else ())]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(address)
        request = json.dumps({"argv": argv, "program": program, "env": dict(os.environ), "cwd": os.getcwd(),
                              "launcher": os.getpid(), "fds": fds, "no_bytecode": args[:1] == ["-B"]})
        socket.send_fds(conn, [request.encode()], fds)
        reply = conn.makefile()
        child = int(reply.readline())
    except (OSError, ValueError):
        conn.close()
        run_fresh(args, spawn)
    for fd in fds[3:]:  # the forked process holds them now: its end of a pipe closes when it exits
        os.close(fd)

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, forward)
    status = reply.readline().strip()  # the zygote writes the exit status when it reaps the process
    code = int(status) if status.lstrip("-").isdigit() else 1
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
