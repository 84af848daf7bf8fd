"""The one Ray actor class behind every worker group.

A host is a plain process wrapper: it reports who and where it is (so the driver can name it and
find its log files if it dies), joins ``torch.distributed``, and only then builds the real worker
class from its import path. Keeping backends as plain classes (``Cls(**kwargs, rank=, world_size=)``)
means they also run under ``torchrun`` without Ray, and Ray never has to import them on the driver.
"""

from __future__ import annotations

import collections
import functools
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from nrl_core.device import uses_nccl
from nrl_core.long_lived import freeze_at_exit, long_lived_objects
from nrl_core.refit.endpoints import RefitEndpoints
from nrl_core.stacks import install_stack_dump
from nrl_core.timeline import WorkerSpans, mark

__all__ = ["WorkerHost", "InFlightWorkerHost", "IN_FLIGHT_GROUP"]

IN_FLIGHT_GROUP = "nrl_in_flight"
"""The Ray concurrency group (one thread of its own per host) where a refit's import runs while the
host's main thread is still streaming generations: in-flight weight updates."""

_CALL_HISTORY = 256


def _fd_target(fd: int) -> str | None:
    """The file a descriptor writes to (Ray points a worker's stdout/stderr at its log files)."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return target if target.startswith("/") else None


def _traced(method: Callable[..., Any], label: Callable[..., str] | None = None) -> Callable[..., Any]:
    """``method`` recording a span of each call into the run's trace, when there is one, named
    after the method or ``label(*args)``."""

    @functools.wraps(method)
    def traced(self: WorkerHost, *args: Any, **kwargs: Any) -> Any:
        if self._spans is None:
            return method(self, *args, **kwargs)
        wall, start = time.time(), time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._spans.record(method.__name__ if label is None else label(*args), wall, time.perf_counter() - start)

    return traced


def _in_flight(method: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``method`` as the host endpoint ``name``, run in :data:`IN_FLIGHT_GROUP`'s thread beside
    whatever the host is running (a generation that the import lands in)."""

    def beside(self: WorkerHost, *args: Any, **kwargs: Any) -> Any:
        device = getattr(self, "_cuda_device", None)
        if device is not None:  # the current CUDA device is per thread: this one starts at device 0
            import torch

            torch.cuda.set_device(device)
        return method(self, *args, **kwargs)

    beside.__name__ = beside.__qualname__ = name
    beside.__doc__ = method.__doc__
    # its dispatch declaration, not __wrapped__: Ray would take the wrapped method's (default) group
    beside.__dict__.update({k: v for k, v in method.__dict__.items() if k != "__wrapped__"})
    import ray

    return ray.method(concurrency_group=IN_FLIGHT_GROUP)(beside)


def _current_cuda_device() -> int | None:
    """The CUDA device this thread works on, once torch has initialised CUDA here; else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_device())


def _traced_stream(method: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """:func:`_traced` for a generator method (a streaming Ray call): the span lasts until it ends."""

    @functools.wraps(method)
    def traced(self: WorkerHost, *args: Any, **kwargs: Any) -> Iterator[Any]:
        wall, start = time.time(), time.perf_counter()
        try:
            yield from method(self, *args, **kwargs)
        finally:
            if self._spans is not None:
                self._spans.record(method.__name__, wall, time.perf_counter() - start)

    return traced


class _BucketSpans:
    """A refit source whose ``export_weights`` records a ``refit_bucket`` span per bucket, from
    asking for it until the next ask (exporting it and sending it); everything else is the source's."""

    def __init__(self, source: Any, spans: WorkerSpans) -> None:
        self._source, self._spans = source, spans

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def export_weights(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        wall, start = time.time(), time.perf_counter()
        for bucket in self._source.export_weights(*args, **kwargs):
            yield bucket
            now = time.perf_counter()
            self._spans.record("refit_bucket", wall, now - start)
            wall, start = wall + (now - start), now


class WorkerHost(RefitEndpoints):
    """Hosts one rank of a worker group inside a Ray actor process.

    It also carries the refit endpoints (:class:`~nrl_core.refit.endpoints.RefitEndpoints`), so a
    training rank can export weights to, or host, a generation engine, and a generation rank can
    receive them.
    """

    def __init__(self, group_name: str, rank: int, world_size: int) -> None:
        # Line buffering, so the last thing a worker prints before it dies is in its log file.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
            except (AttributeError, ValueError):
                pass
        mark("actor_start", group=group_name, rank=rank)
        install_stack_dump()  # SIGUSR1 writes every thread's stack, even while a call is stuck
        freeze_at_exit()
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.worker: Any = None
        self._calls: collections.deque[str] = collections.deque(maxlen=_CALL_HISTORY)
        self._spans = WorkerSpans.from_env(group_name, rank)  # the run's trace.json, when it has one

    def nrl_trace_into(self, directory: str | None) -> None:
        """Record this actor's spans into ``directory`` from now on (None: not at all): the driver
        opened or closed its run's trace after this actor started."""
        self._spans = WorkerSpans(directory, self.group_name, self.rank) if directory else None

    def record_call(self, what: str) -> None:
        self._calls.append(what)

    def call_history(self) -> list[str]:
        """The names of the last worker methods this actor ran, oldest first: the order in which
        the driver drove it (tests assert the colocated memory hand-off with it)."""
        return list(self._calls)

    def describe(self) -> dict[str, Any]:
        """Identity and log locations, captured at start while the process is surely alive."""
        import ray

        ctx = ray.get_runtime_context()
        try:
            import torch

            cuda = bool(torch.cuda.is_available())
        except Exception:  # torch missing or broken CUDA: a CPU worker
            cuda = False
        return {
            "pid": os.getpid(),
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ctx.get_node_id(),
            "worker_id": ctx.get_worker_id(),
            "stdout": _fd_target(1),
            "stderr": _fd_target(2),
            "cuda": cuda,
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def free_port(self) -> int:
        """A TCP port free on this node right now, for the rendezvous store rank 0 will host."""
        from nrl_core.net import free_port

        return free_port("")

    def setup_distributed(self, backend: str, env: dict[str, str], timeout_s: float, *, init_method: str = "env://",
                          loopback: bool = False) -> None:
        """Set the torchrun-style variables and, unless ``backend`` is ``none``, join the group.

        ``init_method`` is ``env://`` (rank 0's TCP store at ``MASTER_ADDR:MASTER_PORT``) or, when
        every rank is on this machine, a ``file://`` store that listens nowhere; ``loopback`` then
        also keeps gloo's own connections on the loopback interface (unless the user chose one
        with ``GLOO_SOCKET_IFNAME``), so the group opens no port on the network.
        """
        os.environ.update(env)
        if backend == "none":
            return
        import torch
        import torch.distributed as dist

        if loopback and "lo" in {name for _, name in socket.if_nameindex()}:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

        if uses_nccl(backend):
            # Ray usually exposes exactly this actor's GPU(s); index by local rank only otherwise.
            visible = torch.cuda.device_count()
            torch.cuda.set_device(0 if visible == 1 else int(env["LOCAL_RANK"]) % max(visible, 1))
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        mark("process_group_joined", group=self.group_name, rank=self.rank)

    def preload(self, modules: list[str]) -> list[str]:
        """Import ``modules`` now, before the worker is built, while the driver is still busy with
        its own start-up; returns the ones that failed. A class path (``pkg.mod:Class``) also
        imports the modules the class names in ``lazy_imports``. A failure is not raised here: the
        worker's own import reports it, where it has its context."""
        import importlib

        from nrl_core.contracts import import_object

        mark("preload_start", group=self.group_name, rank=self.rank)
        failed = []
        with long_lived_objects(freeze=False):  # construct() collects and freezes once, after the build
            pending = list(modules)
            while pending:
                name = pending.pop(0)
                try:
                    if ":" in name:
                        pending[:0] = list(getattr(import_object(name), "lazy_imports", ()))
                    else:
                        importlib.import_module(name)
                except Exception:
                    failed.append(name)
        mark("preloaded", group=self.group_name, rank=self.rank, failed=len(failed))
        return failed

    def construct(self, worker_cls: str, init_kwargs: dict[str, Any]) -> None:
        """Import the worker class and build it for this rank."""
        from nrl_core.contracts import import_object
        from nrl_core.plugins import PluginManager

        # This process's plugins (NRL_PLUGINS too) load before the worker exists, as in the driver:
        # a plugin module may register what the worker builds (a model class) when it is imported.
        self.plugins = PluginManager()
        self.plugins.load()
        mark("worker_import_start", worker=worker_cls, rank=self.rank)
        with long_lived_objects():
            cls = import_object(worker_cls)
            mark("worker_build_start", worker=worker_cls, rank=self.rank)
            self.worker = cls(**init_kwargs, rank=self.rank, world_size=self.world_size)
        self._cuda_device = _current_cuda_device()
        mark("worker_built", worker=worker_cls, rank=self.rank)

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``worker.<method>(*args, **kwargs)``."""
        return self._run(method, args, kwargs)

    def _run(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.record_call(method)
        return getattr(self.worker, method)(*args, **kwargs)

    _run = _traced(_run, lambda method, *_: method)  # a span named after the worker method

    def nrl_refit_source(self) -> Any:
        source = super().nrl_refit_source()
        return source if self._spans is None or source is None else _BucketSpans(source, self._spans)

    # The refit endpoints the orchestrator calls directly: each a span on this rank's row too...
    nrl_refit_export = _traced(RefitEndpoints.nrl_refit_export)
    nrl_refit_import = _traced(RefitEndpoints.nrl_refit_import)
    nrl_refit_export_streamed = _traced(RefitEndpoints.nrl_refit_export_streamed)
    nrl_refit_import_streamed = _traced(RefitEndpoints.nrl_refit_import_streamed)
    nrl_refit_receive = _traced(RefitEndpoints.nrl_refit_receive)
    nrl_refit_local = _traced(RefitEndpoints.nrl_refit_local)
    nrl_refit_send = _traced_stream(RefitEndpoints.nrl_refit_send)
    # ... and a colocated engine's generation calls.
    nrl_generation_call = _traced(RefitEndpoints.nrl_generation_call, lambda method, *_: f"generation.{method}")
    nrl_generate_sharded = _traced(RefitEndpoints.nrl_generate_sharded)
    nrl_generate_groups = _traced_stream(RefitEndpoints.nrl_generate_groups)

    def call_packed(self, method: str, packed: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        """:meth:`call` with arguments stored once in the object store for all ranks."""
        args, kwargs = packed
        return self._run(method, args, kwargs)

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(worker)`` here (tests and one-off inspection)."""
        return fn(self.worker)

    def teardown(self) -> None:
        """Let the worker release what it holds, then leave the process group."""
        shutdown = getattr(self.worker, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self.worker = None
        from nrl_core.refit.transports import release_refit_groups

        release_refit_groups()  # NCCL communicators live until destroyed
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # the process is killed right after; a failed goodbye changes nothing
            pass


class InFlightWorkerHost(WorkerHost):
    """The host of engines that take refits while they generate (in-flight weight updates): Ray
    runs these imports (and the question of what a rank imports) in :data:`IN_FLIGHT_GROUP`'s
    thread, beside the stream. A Ray actor with a concurrency group runs every call off the
    process's main thread, so only these hosts have one."""

    nrl_refit_import_in_flight = _in_flight(WorkerHost.nrl_refit_import, "nrl_refit_import_in_flight")
    nrl_refit_receive_in_flight = _in_flight(WorkerHost.nrl_refit_receive, "nrl_refit_receive_in_flight")
    nrl_refit_wants_in_flight = _in_flight(WorkerHost.nrl_refit_wants, "nrl_refit_wants_in_flight")
