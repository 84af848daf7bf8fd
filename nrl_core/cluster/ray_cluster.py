"""Starting or joining the Ray cluster every nrl worker lives in.

One entry point, :func:`init_ray`, so that a laptop run, a CI job and a multi-node job differ only
in configuration: by default a private local Ray bound to the loopback address (nothing listens on
the network, no dashboard; worker groups on it rendezvous through a file store in a private
directory and keep gloo on loopback, see :func:`private_local_ray`); with ``cluster.ray_address``
or ``RAY_ADDRESS`` an existing cluster (``ray start --head`` on the first node, ``ray start
--address`` on the others) is joined instead, and groups rendezvous over TCP.

Workers are separate processes that do not inherit the driver's ``sys.path`` or shell, so the
environment variables they need (``PYTHONPATH``, engine knobs such as ``VLLM_*``, thread counts)
are forwarded explicitly: a local Ray's processes start with them in their environment, a joined
cluster gets them through the job's ``runtime_env``, and an actor whose environment differs from
what its Ray already has carries its own (:func:`actor_runtime_env`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import ray
from ray._private import ray_constants, services
from ray._private.node import Node
from ray._private.state import GlobalState

from nrl_core.cluster.gcs_watch import cluster_failure, frozen, kill_ray_processes, stop_watching, watch_local_ray
from nrl_core.env_vars import environment
from nrl_core.errors import NrlError
from nrl_core.timeline import mark

__all__ = ["actor_runtime_env", "cluster_failure", "init_ray", "private_local_ray", "shutdown_ray", "worker_env_vars",
           "FORWARDED_ENV_PREFIXES", "FORWARDED_ENV_NAMES"]

log = logging.getLogger(__name__)

#: Driver environment variables whose name starts with one of these reach every worker.
FORWARDED_ENV_PREFIXES: tuple[str, ...] = (
    "NRL_",
    "VLLM_",
    "HF_",
    "TRANSFORMERS_",
    "TORCH_",
    "NCCL_",
    "GLOO_",
    "TORCHINDUCTOR_",
)
#: ... and so do these exact names.
FORWARDED_ENV_NAMES: tuple[str, ...] = (
    "PYTHONPATH",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
    "PYTORCH_CUDA_ALLOC_CONF",
    "CUDA_LAUNCH_BLOCKING",
    # the numerical path (docs/testing.md): which of their kernels torch, MKL and oneDNN may use
    "ATEN_CPU_CAPABILITY",
    "MKL_CBWR",
    "ONEDNN_MAX_CPU_ISA",
)
#: Ray settings of the local Ray nrl starts. Nothing reads Ray's metrics here (no dashboard, no
#: Prometheus). The raylet connects to its own object store's socket while another thread of it
#: is still creating that socket; when it loses that race (often, on 2 cores) it retries only after
#: ``raylet_client_connect_timeout_milliseconds``, 1 s by default, and ``ray.init`` takes a second
#: longer. Retrying every 20 ms (as many times as needed for the same 10 s in all) removes that.
LOCAL_SYSTEM_CONFIG: Mapping[str, Any] = {
    "enable_metrics_collection": False,
    "raylet_client_connect_timeout_milliseconds": 20,
    "raylet_client_num_connect_attempts": 500,
}
#: Ray prestarts one idle worker process per advertised CPU when the first driver connects, and an
#: actor without a ``runtime_env`` of its own takes one of them instead of waiting ~1 s for a new
#: process (see :func:`actor_runtime_env`). A run's first actors are a handful, so on a machine
#: with more CPUs than this the rest would idle at ~45 MiB each: there nothing is prestarted.
PRESTART_MAX_CPUS = 8
# Ray assigns devices per actor through this one; forwarding the driver's would defeat that.
_NEVER_FORWARD = frozenset({"CUDA_VISIBLE_DEVICES"})
#: How often a shutting-down local Ray's GCS and raylet are checked for being stopped.
SHUTDOWN_POLL_S = 0.1
# The GCS address of the loopback-only Ray this process started (None: it started none).
_private_gcs: str | None = None
# The worker environment that Ray's processes inherited when this process started it.
_inherited_env: dict[str, str] | None = None


def worker_env_vars(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables workers get: the forwarded subset of ``os.environ`` plus ``extra``.

    ``PYTHONPATH`` also gains the driver's working directory, so modules importable from where the
    job was launched (``python -m my_experiment``) are importable in the workers too.
    """
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _NEVER_FORWARD and (k in FORWARDED_ENV_NAMES or k.startswith(FORWARDED_ENV_PREFIXES))
    }
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    cwd = os.getcwd()
    if cwd not in paths:
        paths.append(cwd)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update({str(k): str(v) for k, v in (extra or {}).items()})
    return env


def _ray_address(cluster_cfg: Mapping[str, Any]) -> str | None:
    for value in (cluster_cfg.get("ray_address"), os.environ.get("RAY_ADDRESS")):
        if value is not None and str(value).strip():
            return str(value).strip()
    return None


def _use_token_auth_if_available() -> None:
    """Present the cluster token when there is one and the user did not choose a mode.

    ``ray start --head`` enables token authentication by default and keeps the token in
    ``~/.ray/auth_token``; Ray 2.60's ``ray.init(address=...)`` does not look for it unless
    ``RAY_AUTH_MODE=token`` is set, and the connection is refused. Ray's own helper for the
    clusters it starts sets that variable and refreshes its native config, which reads the
    environment only when refreshed; without the helper (another Ray version) nothing is changed.
    """
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


@contextlib.contextmanager
def _private_head() -> Iterator[None]:
    """Start a head node for this process alone: loopback only, without the services nobody can use.

    On Linux Ray resolves a loopback ``_node_ip_address`` to the machine's network address (so
    other nodes could join); its single-machine mode, which Ray itself uses on macOS and Windows
    and exposes as ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, keeps the loopback address. The flag is
    read from a module constant at call time, so it is switched only around the start.

    ``ray.init`` also starts the autoscaler's monitor and the dashboard's API server, which
    ``include_dashboard=False`` only trims (``ray start`` has ``--no-monitor``; ``ray.init`` no
    switch for either). A private Ray on one machine never scales and takes no jobs, and
    ``ray.init`` waits about a second for the API server to come up; skipping both saves that and
    ~130 MiB of two Python processes. Worker logs reach the driver through the log monitor, which
    stays.

    Once it has started the raylet, ``ray.init`` waits for it to register with the GCS through a
    call that, while the node is not there yet, sleeps a fixed second before it asks again (Ray's
    ``GlobalStateAccessor::GetNode``). The raylet registers about a second after its start, so
    the driver often oversleeps by most of that second; here it asks every 20 ms first
    (:func:`_get_node_promptly`).
    """
    saved = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    saved_monitor, saved_api_server = Node.start_monitor, Node.start_api_server
    saved_get_node = services.get_node
    ray_constants.ENABLE_RAY_CLUSTER = False
    Node.start_monitor = lambda self: None  # type: ignore[method-assign]
    Node.start_api_server = lambda self, **kwargs: None  # type: ignore[method-assign]
    services.get_node = _get_node_promptly(saved_get_node)
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
        Node.start_monitor, Node.start_api_server = saved_monitor, saved_api_server  # type: ignore[method-assign]
        services.get_node = saved_get_node


def _get_node_promptly(get_node: Callable[[str, str], Any], timeout_s: float = 30.0,
                       interval_s: float = 0.02) -> Callable[[str, str], Any]:
    """``get_node`` once the GCS lists ``node_id`` as alive, polling the node table every
    ``interval_s`` (a call that returns at once) for up to ``timeout_s``; ``get_node`` itself then
    answers without its one-second sleep, and reports a node that never came as before."""

    def wait_then_get(gcs_address: str, node_id: str) -> Any:
        deadline = time.monotonic() + timeout_s
        with _gcs_state(gcs_address) as state:
            while time.monotonic() < deadline and not _node_alive(state, node_id):
                time.sleep(interval_s)
        return get_node(gcs_address, node_id)

    return wait_then_get


@contextlib.contextmanager
def _gcs_state(gcs_address: str) -> Iterator[GlobalState]:
    """A connection to the GCS at ``gcs_address`` for reading its tables, closed on exit."""
    state = GlobalState()
    state._initialize_global_state(services._get_gcs_client_options(gcs_address))
    try:
        yield state
    finally:
        state.disconnect()


def _node_alive(state: GlobalState, node_id: str) -> bool:
    """Whether the GCS behind ``state`` lists the node ``node_id`` (hex) as alive."""
    return any(node.get("NodeID") == node_id and node.get("Alive") for node in state.node_table())


def init_ray(cluster_cfg: Mapping[str, Any] | None = None) -> None:
    """Connect this process to Ray; a no-op when it already is.

    ``cluster_cfg`` is the ``cluster`` config section. Keys read here (all optional):
    ``ray_address`` (join that cluster; ``RAY_ADDRESS`` works too), ``num_cpus`` / ``num_gpus``
    (what a *local* Ray advertises; default: what the machine has), ``env_vars`` (extra variables
    for every worker), ``log_to_driver`` (stream worker output to this terminal, default true) and
    ``logging_level`` (Ray's own driver-side logging, default ``warning``).

    Ray only schedules by these numbers; workers ask for fractions of a CPU (see
    :mod:`nrl_core.cluster.placement`), so a 2-core machine can host more workers than cores.
    """
    global _private_gcs, _inherited_env
    if ray.is_initialized():
        return
    mark("ray_init_start")
    cfg: Mapping[str, Any] = cluster_cfg or {}
    env_vars = worker_env_vars(cfg.get("env_vars"))
    common: dict[str, Any] = {
        "log_to_driver": bool(cfg.get("log_to_driver", True)),
        "logging_level": cfg.get("logging_level", "warning"),
        "namespace": cfg.get("namespace"),
    }
    address = _ray_address(cfg)
    try:
        if address is not None:
            log.info("joining the Ray cluster at %s", address)
            _use_token_auth_if_available()
            ray.init(address=address, runtime_env={"env_vars": env_vars}, **common)
            mark("ray_init_end")
            return
        num_cpus = int(cfg.get("num_cpus") or os.cpu_count() or 1)
        num_gpus = cfg.get("num_gpus")
        with _private_head(), environment(env_vars):
            ray.init(
                address="local",  # never attach to someone else's `ray start` by accident
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                num_cpus=num_cpus,
                num_gpus=None if num_gpus is None else int(num_gpus),
                _system_config={**LOCAL_SYSTEM_CONFIG, "prestart_worker_first_driver": num_cpus <= PRESTART_MAX_CPUS},
                **common,
            )
        _private_gcs = ray.get_runtime_context().gcs_address
        _inherited_env = env_vars
        node = ray._private.worker._global_node
        gcs, raylet = _control_plane(node)
        watch_local_ray([(f"GCS (gcs_server pid {gcs.pid})", gcs),
                         (f"raylet (raylet pid {raylet.pid}, node {node.node_id[:12]} at {node.node_ip_address})", raylet)],
                        is_connected=ray.is_initialized, on_unheeded=_exit_after_cluster_failure)
        mark("ray_init_end")
    except ConnectionError as exc:
        where = "cluster.ray_address" if cfg.get("ray_address") else "RAY_ADDRESS"
        raise NrlError(
            f"{where}: cannot connect to a Ray cluster at '{address}' ({exc}); start one with "
            "`ray start --head` or unset it to run on a local Ray"
        ) from exc


def actor_runtime_env(env_vars: Mapping[str, str]) -> dict[str, Any] | None:
    """The ``runtime_env`` that gives an actor the environment ``env_vars`` (from
    :func:`worker_env_vars`): None when the private local Ray's processes already have exactly it.

    The local Ray :func:`init_ray` starts inherits the worker environment, so an actor asking for
    the same one needs no ``runtime_env``, and only such an actor can take a worker Ray prestarted
    (Ray matches workers to tasks by runtime environment). Anything that differs since (a variable
    set after the start, a group's own ``env_vars``, another working directory) goes in one.
    """
    if private_local_ray() and dict(env_vars) == _inherited_env:
        return None
    return {"env_vars": dict(env_vars)}


def private_local_ray() -> bool:
    """Whether this process is connected to the loopback-only Ray :func:`init_ray` started: every
    worker is on this machine, so worker groups rendezvous without listening on the network."""
    return ray.is_initialized() and _private_gcs is not None and _private_gcs == ray.get_runtime_context().gcs_address


def _control_plane(node: Any) -> list[Any]:
    """The GCS and raylet processes (``subprocess.Popen``) of a local Ray ``node``."""
    return [info.process for kind in (ray_constants.PROCESS_TYPE_GCS_SERVER, ray_constants.PROCESS_TYPE_RAYLET)
            for info in node.all_processes.get(kind, [])]


def _exit_after_cluster_failure(reason: str) -> None:
    """The end of a process whose main thread did not take the watcher's interrupt after the GCS or
    the raylet died or froze: it sits in a Ray call that Ray itself would abort (or wait in for
    ever). Print the CLI's one-line error, kill the local Ray, exit 2."""
    print(f"error: {reason}", file=sys.stderr, flush=True)
    kill_ray_processes(ray._private.worker._global_node)
    os._exit(2)


def shutdown_ray() -> None:
    """Disconnect from Ray (and stop the local Ray if this process started it). Idempotent.

    After the local Ray lost its GCS or raylet (:func:`~nrl_core.cluster.gcs_watch.cluster_failure`),
    or while either is stopped (SIGSTOP, a debugger), its processes are killed outright: a graceful
    stop would wait on them for minutes. A stop can land just before or during the shutdown (the
    kernel stops a busy process only when it next runs), so the control plane is watched until
    the shutdown returns, not checked once.
    """
    global _private_gcs, _inherited_env
    private = private_local_ray()
    _private_gcs = _inherited_env = None
    stop_watching()
    node = ray._private.worker._global_node if private else None
    if node is not None and cluster_failure() is not None:
        _kill_local_ray(node)
    if not ray.is_initialized():
        return
    done = threading.Event()
    if node is not None:
        threading.Thread(target=_kill_if_frozen_until, args=(node, done), name="nrl-shutdown-watch",
                         daemon=True).start()
    try:
        ray.shutdown()
    finally:
        done.set()


def _kill_local_ray(node: Any) -> None:
    killed = kill_ray_processes(node)
    log.info("killed the %d processes of the local Ray: its GCS or raylet died or is frozen", len(killed))


def _kill_if_frozen_until(node: Any, done: threading.Event) -> None:
    """While Ray shuts down, kill its local processes as soon as the GCS or the raylet is seen
    stopped (Ray's own stop would wait on it); returns when ``done`` is set."""
    processes = _control_plane(node)
    while not done.is_set():
        if frozen(processes):
            _kill_local_ray(node)
            return
        done.wait(SHUTDOWN_POLL_S)
