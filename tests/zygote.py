"""A zygote for the shared Ray's workers: one process per shared Ray that imports, once, what nrl's
workers import (torch, transformers, vLLM, Megatron-Core and nrl's worker modules; not Ray, see
PRELOAD), then forks a worker, or a process a worker spawns, for each start that
``tests/ray_worker_launcher.py`` hands it.

Every Ray worker is otherwise a new interpreter that spends seconds of CPU importing the same
libraries before it does anything; on the suite's 2-core machine, for a run that trains two steps of
a tiny model, those imports are most of its CPU. A forked worker starts where a fresh one would be
after its imports: it takes the launcher's arguments, environment, working directory, standard
streams and ``sys.path`` (``PYTHONPATH`` first), and runs Ray's ``default_worker.py`` as
``__main__``. The launcher falls back to a fresh interpreter whenever a variable read at import time
differs (tests/ray_worker_launcher.py), so a worker never runs with libraries set up for another
environment. A run with a Ray of its own that only counts what the run leaves forks its workers
here too (``own_ray_from_zygote`` in tests/launch.py); tests that kill, freeze or measure their Ray's
workers start Ray's own.
"""

from __future__ import annotations

import fcntl
import functools
import importlib
import json
import os
import runpy
import select
import shlex
import signal
import socket
import sys
import threading
import types
from pathlib import Path

from nrl_core.testing.distributed import adopt_environment, run_as_interpreter

LAUNCHER = Path(__file__).with_name("ray_worker_launcher.py")

#: What the forked workers find imported. A module that starts a thread at import cannot be here
#: (the zygote must fork with one thread), nor Ray: its native config reads a worker's job from the
#: environment once, when it loads, so each worker imports Ray itself. vLLM's Ray executor, which
#: nrl does not use, is left as vLLM leaves it without Ray.
PRELOAD = ("torch", "torch.distributed", "transformers", "vllm.entrypoints.llm", "megatron.core",
           "nrl_backend_dtensor.worker", "nrl_backend_megatron.worker", "nrl_gen_vllm.worker")


def serve(address: str, base_path: list[str]) -> None:
    environ = dict(os.environ)  # as the workers' launchers will compare it: before imports change it
    sys.path[:] = base_path  # a worker's paths, not this script's directory (tests/vllm would be vllm)
    sys.modules["ray"] = None  # type: ignore[assignment]  # an import of Ray fails here (see PRELOAD)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - its workers import it themselves, and report it
            print(f"worker zygote: {name} not preloaded: {exc!r}", file=sys.stderr, flush=True)
    del sys.modules["ray"]
    if any(name == "ray" or name.startswith("ray.") for name in sys.modules):
        raise RuntimeError("the worker zygote imported Ray; its workers could not join their job")
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise RuntimeError(f"the worker zygote has {threads} threads after its imports; it forks with one only")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    with open("/proc/self/maps") as maps:  # the libraries a worker's LD_PRELOAD may name (launcher)
        paths = {line.split()[-1] for line in maps if ".so" in line}
    loaded = sorted(os.path.realpath(p) for p in paths if p.startswith("/"))
    Path(address + ".env").write_text(json.dumps({"before": environ, "after": dict(os.environ), "loaded": loaded}))
    spawner = Path(address).with_name("python")  # what the forked workers' multiprocessing runs
    spawner.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(LAUNCHER))} --spawn \"$@\"\n")
    spawner.chmod(0o755)
    signal.signal(signal.SIGCHLD, _reap)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 256)
        request = json.loads(message)
        sys.stdout.flush()
        sys.stderr.flush()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # reaped only once registered
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            run_as_interpreter(functools.partial(_become, request, fds, base_path, str(spawner)))
        for fd in fds:
            os.close(fd)
        _launchers[pid] = conn
        try:
            conn.sendall(f"{pid}\n".encode())
        except OSError:
            pass  # the launcher is gone; the process ends with it (_end_with)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})


#: The connection to each forked process's launcher, which waits for its exit status.
_launchers: dict[int, socket.socket] = {}


def _reap(_signum: int, _frame: object) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = _launchers.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # the launcher is gone
            conn.close()


def _become(request: dict, fds: list[int], base_path: list[str], spawner: str) -> None:
    """In the forked child: become the process the launcher would have started, ``python
    default_worker.py ARGS`` or ``python -c PROGRAM ARGS``, with its descriptors, environment,
    directory and paths; its own ``multiprocessing`` spawns through the zygote too."""
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for other in _launchers.values():
        other.close()
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1024) for fd in fds]  # clear of the targets
    for fd in fds:
        os.close(fd)
    for target, fd in zip(request["fds"], moved):
        os.dup2(fd, target)  # inheritable, as an interpreter's inherited descriptors are
        os.close(fd)
    environ = request["env"]
    adopt_environment(environ)
    os.chdir(request["cwd"])
    unbuffered = bool(environ.get("PYTHONUNBUFFERED"))
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stdout.reconfigure(write_through=unbuffered)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr.reconfigure(write_through=True)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    if environ.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:  # read at import; vLLM's CPU worker sets it for its engine core
        inductor.cpp.dynamic_threads = environ.get("TORCHINDUCTOR_CPP_DYNAMIC_THREADS", "0") == "1"
    if "vllm.logger" in sys.modules:  # configured at import from the zygote's VLLM_LOGGING_*
        sys.modules["vllm.envs"].disable_envs_cache()
        sys.modules["vllm.logger"]._configure_vllm_root_logger()
    import numpy

    numpy.random.seed()  # a fresh interpreter seeds from the OS; the zygote's state is shared
    _end_with(request["launcher"])
    sys.dont_write_bytecode = bool(request.get("no_bytecode"))
    import multiprocessing

    multiprocessing.set_executable(spawner)
    python_path = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if request["program"] is not None:
        sys.path[:] = ["", *python_path, *base_path]
        sys.argv = ["-c", *request["argv"]]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(request["program"], "<string>", "exec"), main.__dict__)  # noqa: S102
    else:
        import ray

        worker = os.path.join(os.path.dirname(ray.__file__), "_private", "workers", "default_worker.py")
        sys.path[:] = [os.path.dirname(worker), *python_path, *base_path]
        sys.argv = [worker, *request["argv"]]
        runpy.run_path(worker, run_name="__main__")


def _end_with(launcher: int) -> None:
    """Die with the launcher, the process Raylet started and may kill in this worker's stead."""
    pidfd = os.pidfd_open(launcher)

    def watch() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="zygote-launcher-watch", daemon=True).start()


if __name__ == "__main__":
    serve(sys.argv[1], json.loads(sys.argv[2]))
