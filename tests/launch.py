"""``nrl`` commands as the tests run them, and the Ray they share.

Each command runs in a new process, as a user's shell runs it, but forked from the suite's fork
server, which has imported the heavy libraries the command's driver would import again (torch,
transformers, Ray: seconds of every run's start on a small machine). The forked process is made to
look like ``python -m nrl_core.cli ARGS`` started in ``cwd`` with ``env``: that environment, that
working directory first on ``sys.path`` followed by ``PYTHONPATH`` and the interpreter's own
paths, standard output and error to files the caller reads, and the interpreter's exit handlers
run at the end (Ray's shutdown among them). Nothing of the pytest process comes with it: the
server is a fresh interpreter that only imported libraries.

:func:`shared_ray` is one local Ray per pytest process that runs join as a user joins a running
cluster (``RAY_ADDRESS``), instead of each starting and stopping a Ray of its own. Each run is its
own Ray job: its actors are gone when its driver exits, and its workers get their environment
from the run alone (the cluster's own processes start without any variable nrl forwards). Its
workers, and the processes they spawn, are forked from a zygote that has imported torch,
transformers, vLLM, Megatron-Core and nrl's distributions once (tests/zygote.py), so a run's
actors start in a fraction of a second instead of importing for seconds each.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from nrl_core.cluster.ray_cluster import FORWARDED_ENV_NAMES, FORWARDED_ENV_PREFIXES
from nrl_core.testing.distributed import adopt_environment, rank_context, run_as_interpreter
from tests.ray_worker_launcher import SOCKET as ZYGOTE_SOCKET

# The shared Ray's driver. Not nrl's private local Ray: that one keeps to the loopback address, and
# a driver asked to join 127.0.0.1 connects to the machine's address instead (Ray resolves it).
_SHARED_HEAD = """
import sys
import ray
import ray._private.parameter
from nrl_core.cluster.ray_cluster import LOCAL_SYSTEM_CONFIG
if len(sys.argv) > 1:  # workers start through the zygote (tests/zygote.py), set up without Ray's import
    _params = ray._private.parameter.RayParams.__init__
    def _through_zygote(self, *args, **kwargs):
        _params(self, *args, **kwargs)
        self.worker_path, self.setup_worker_path = sys.argv[1], sys.argv[2]
    ray._private.parameter.RayParams.__init__ = _through_zygote
ray.init(address="local", include_dashboard=False, log_to_driver=False, _system_config=dict(LOCAL_SYSTEM_CONFIG))
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the suite closes it
ray.shutdown()
"""
_shared: subprocess.Popen[str] | None = None
_shared_address: str | None = None
_zygote: subprocess.Popen[str] | None = None
_zygote_address: str | None = None
ZYGOTE = Path(__file__).with_name("zygote.py")
LAUNCHER = Path(__file__).with_name("ray_worker_launcher.py")
SETUP_WORKER = Path(__file__).with_name("ray_setup_worker.py")


@functools.cache
def _interpreter_path() -> tuple[str, ...]:
    """``sys.path`` of a bare ``python -c`` (no ``PYTHONPATH``): the standard library and site-packages."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                         capture_output=True, text=True, env=env, check=True).stdout
    return tuple(json.loads(out))


def _run_cli(args: Sequence[str], environ: dict[str, str], cwd: str, base_path: Sequence[str], out: str,
             err: str) -> None:
    """The forked process: become ``python -m nrl_core.cli ARGS`` and exit with its status."""
    adopt_environment(environ)
    if ZYGOTE_SOCKET in environ:
        _start_workers_through(LAUNCHER, SETUP_WORKER)
    os.chdir(cwd)
    python_path = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *python_path, *base_path]
    sys.argv = [str(Path(sys.executable).parent / "nrl"), *args]
    if environ.get("PYTHONWARNINGS"):  # what the interpreter reads at its start
        sys.warnoptions[:] = environ["PYTHONWARNINGS"].split(",")
        warnings._processoptions(sys.warnoptions)  # type: ignore[attr-defined]
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115

    def cli() -> int:
        from nrl_core.cli import main

        return main(list(args))

    run_as_interpreter(cli)


def _start_workers_through(launcher: Path, setup: Path) -> None:
    """Make the Ray this process starts run ``launcher`` in place of Ray's ``default_worker.py``,
    and ``setup`` in place of its ``setup_worker.py`` (tests/ray_setup_worker.py)."""
    import ray._private.parameter

    params = ray._private.parameter.RayParams.__init__

    def through_launcher(self: Any, *args: Any, **kwargs: Any) -> None:
        params(self, *args, **kwargs)
        self.worker_path, self.setup_worker_path = str(launcher), str(setup)

    ray._private.parameter.RayParams.__init__ = through_launcher  # type: ignore[method-assign]


def nrl(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
        timeout: float = 900.0, join_shared_ray: bool = False,
        own_ray_from_zygote: bool = False) -> subprocess.CompletedProcess[str]:
    """``nrl ARGS`` in a new process (see the module docstring), like ``subprocess.run(..., capture_output=True,
    text=True)``; ``env`` replaces the environment (default: this process's). With ``join_shared_ray``
    the command joins :func:`shared_ray` unless ``env`` names a ``RAY_ADDRESS`` (empty: a Ray of its
    own). With ``own_ray_from_zygote``, a Ray the command starts itself forks its workers from the
    worker zygote, as the shared Ray does: for runs that need a Ray of their own (to count what is
    left of it) but neither kill, freeze nor measure its workers. A command still running after
    ``timeout`` seconds is killed and raises :class:`subprocess.TimeoutExpired`."""
    environ = dict(os.environ if env is None else env)
    if join_shared_ray and "RAY_ADDRESS" not in environ:
        environ["RAY_ADDRESS"] = shared_ray()
    if own_ray_from_zygote and not environ.get("RAY_ADDRESS"):
        environ[ZYGOTE_SOCKET] = _start_zygote()
    directory = str(Path(cwd or os.getcwd()).resolve())
    with tempfile.TemporaryDirectory(prefix="nrl-cli-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        process = rank_context().Process(target=_run_cli, args=(list(args), environ, directory, _interpreter_path(),
                                                                out, err), name="nrl")
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(["nrl", *args], timeout, Path(out).read_text(), Path(err).read_text())
        return subprocess.CompletedProcess(["nrl", *args], process.exitcode, Path(out).read_text(errors="replace"),
                                           Path(err).read_text(errors="replace"))


def shared_ray() -> str:
    """The address of this pytest process's shared local Ray, started at the first call and
    stopped when the process exits. Its own processes get none of the variables nrl forwards to
    workers (``NRL_*``, ``VLLM_*``, ``PYTHONPATH``, ...): each run's workers get those from the run."""
    global _shared, _shared_address
    if _shared is not None and _shared.poll() is None:
        assert _shared_address is not None
        return _shared_address
    env = {k: v for k, v in os.environ.items()
           if not (k in FORWARDED_ENV_NAMES or k.startswith(FORWARDED_ENV_PREFIXES) or k == "RAY_ADDRESS")}
    head = [sys.executable, "-c", _SHARED_HEAD]
    try:
        env[ZYGOTE_SOCKET] = _start_zygote()
        head += [str(LAUNCHER), str(SETUP_WORKER)]
    except RuntimeError as exc:  # slower, not wrong: Ray starts its own workers
        warnings.warn(f"{exc}; the shared Ray's workers start as fresh interpreters", stacklevel=2)
    _shared = subprocess.Popen(head, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                               cwd=tempfile.gettempdir())
    assert _shared.stdout is not None
    address = _shared.stdout.readline().strip()
    if not address:
        raise RuntimeError(f"the shared Ray did not start (exit {_shared.wait()})")
    _shared_address = address
    atexit.register(_stop_shared_ray, _shared)
    return address


@contextlib.contextmanager
def driving_the_shared_ray() -> Iterator[str]:
    """This pytest process as a driver of :func:`shared_ray` (``RAY_ADDRESS`` set within the block),
    for tests that build worker groups in process: ``init_ray`` joins it as a job joins a cluster,
    so their actors start from the zygote, and they end when the block disconnects. Any
    connection this process had to another Ray is closed first."""
    from nrl_core.cluster import shutdown_ray

    shutdown_ray()
    saved = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = shared_ray()
    try:
        yield os.environ["RAY_ADDRESS"]
    finally:
        shutdown_ray()
        if saved is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = saved


def _start_zygote() -> str:
    """Start this pytest process's worker zygote (tests/zygote.py), unless it runs; returns its
    socket's path."""
    global _zygote, _zygote_address
    if _zygote is not None and _zygote.poll() is None and _zygote_address is not None:
        return _zygote_address
    address = os.path.join(tempfile.mkdtemp(prefix="nrl-zygote-"), "socket")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    _zygote = subprocess.Popen([sys.executable, str(ZYGOTE), address, json.dumps(list(_interpreter_path()))],
                               stdout=subprocess.PIPE, text=True, env=env, cwd=tempfile.gettempdir(),
                               preexec_fn=_die_with_parent)
    assert _zygote.stdout is not None
    if _zygote.stdout.readline().strip() != "ready":
        _zygote.kill()
        raise RuntimeError(f"the worker zygote did not start (exit {_zygote.wait()})")
    atexit.register(_stop_zygote, _zygote)
    _zygote_address = address
    return address


def _die_with_parent() -> None:
    """In the zygote before it starts: end with this pytest process, even when it is killed."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _stop_zygote(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def shared_ray_pids() -> set[int]:
    """The processes of this pytest process's shared Ray (its helper and everything under it), for
    tests that count the processes a Ray of their own started."""
    if _shared is None or _shared.poll() is not None:
        return set()
    import psutil

    pids: set[int] = set()
    for root in (_shared, _zygote):
        if root is None:
            continue
        try:
            helper = psutil.Process(root.pid)
            pids |= {helper.pid, *(child.pid for child in helper.children(recursive=True))}
        except psutil.NoSuchProcess:
            pass
    return pids


def _stop_shared_ray(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
