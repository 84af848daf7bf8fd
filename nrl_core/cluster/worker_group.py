"""A group of Ray actors that together are one distributed worker (N ranks, one process group).

The driver talks to a backend only through a :class:`WorkerGroup`: start N actors, let them form a
``torch.distributed`` group exactly as ``torchrun`` would (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), build the backend's worker class on each, then call methods on
all ranks or one. On the private local Ray the ranks meet through a file store in a private
temporary directory (removed at shutdown) rather than rank 0's TCP store, which would listen on
every interface; on a joined cluster they meet over TCP at rank 0's node.

Failure is the part worth the code. Ranks of one group block in collectives, so when one rank dies
or raises, the others may wait forever, and a plain ``ray.get`` over all ranks would wait with
them. Every call here waits with ``ray.wait`` over all ranks and stops at the first failure; the
others get a short grace period to finish, and a group with a dead or stuck rank is killed. What
reaches the caller is one :class:`~nrl_core.errors.WorkerError` that names the rank
(``<group>[rank r] pid P``) and says what happened: the remote exception type and message, or, for
a process that died, Ray's reason and the last lines it wrote to its logs.

One exception to the wrapping: an :class:`~nrl_core.errors.NrlError` raised by a worker (a
backend refusing a config value) is already a message for the user, so it is re-raised as itself,
same class and message, with the rank in a note; anything else a worker raises is a bug and
arrives as :class:`WorkerRaisedError` carrying the remote traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import ray
from ray import exceptions as rex

from nrl_core.cluster._host import IN_FLIGHT_GROUP, InFlightWorkerHost, WorkerHost
from nrl_core.cluster._logs import tail_lines
from nrl_core.cluster.placement import Placement
from nrl_core.cluster.ray_cluster import actor_runtime_env, init_ray, private_local_ray, worker_env_vars
from nrl_core.device import process_group_backend
from nrl_core.dispatch import Fanout, Gather, dispatch_of
from nrl_core.errors import NrlError, WorkerError, WorkerRaisedError, remote_cause
from nrl_core.plugin_faults import PluginOwner, plugin_fault
from nrl_core.process_groups import DEFAULT_TIMEOUT_S
from nrl_core.timeline import TRACE_DIR_ENV

__all__ = [
    "GroupRank",
    "WorkerGroup",
    "WorkerFutures",
    "WorkerInfo",
    "WorkerDiedError",
    "WorkerRaisedError",
    "WorkerTimeoutError",
    "live_groups",
]

T = TypeVar("T")
logger = logging.getLogger(__name__)

_BACKENDS = ("auto", "gloo", "nccl", "none")
_LOG_LINES = 15


class WorkerDiedError(WorkerError):
    """A worker process ended (exit, kill, out of memory) while the driver needed it."""


class WorkerTimeoutError(WorkerError):
    """A call did not finish within the time the caller allowed."""


@dataclass(frozen=True)
class WorkerInfo:
    """Who and where one rank is, recorded when its actor started."""

    rank: int
    pid: int | None = None
    node_ip: str | None = None
    node_id: str | None = None
    worker_id: str | None = None
    stdout: str | None = None
    stderr: str | None = None
    cuda: bool = False
    gpu_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorkerFutures:
    """Pending results of one call on some ranks; resolve with :meth:`WorkerGroup.get`.

    ``refs`` are plain Ray object references (they can be passed on to other actors) in the order
    of ``ranks``. ``single`` marks a one-rank call whose result is the value, not a list;
    ``gather`` is how :meth:`WorkerGroup.get` gathers the others (:class:`~nrl_core.dispatch.Gather`).
    """

    refs: tuple[ray.ObjectRef, ...]
    ranks: tuple[int, ...]
    what: str
    single: bool = False
    gather: Gather = Gather.LIST


@dataclass(frozen=True)
class GroupRank:
    """One rank of a worker group, as a caller that addresses ranks one by one (refit) names it."""

    group: WorkerGroup
    rank: int

    @property
    def node_id(self) -> str | None:
        return self.group.infos[self.rank].node_id

    def call_async(self, method: Method, *args: Any, **kwargs: Any) -> WorkerFutures:
        return self.group.call_async(method, *args, on=self.rank, **kwargs)

    def call(self, method: Method, *args: Any, **kwargs: Any) -> Any:
        return self.group.call(method, *args, on=self.rank, **kwargs)

    def get(self, futures: WorkerFutures) -> Any:
        return self.group.get(futures)


_REMOTE_HOSTS: dict[bool, Any] = {}
_LIVE: weakref.WeakSet[WorkerGroup] = weakref.WeakSet()


def live_groups() -> list[WorkerGroup]:
    """Every worker group of this driver not yet shut down: whose stacks a watchdog dumps and
    whose actors it kills."""
    return [group for group in list(_LIVE) if not group._closed]


def _remote_host(in_flight: bool = False) -> Any:
    """The host actor class; ``in_flight``: with a second thread for imports that land while the
    actor streams (a Ray actor with concurrency groups runs every call off its main thread, so
    only the groups that need it get one)."""
    if in_flight not in _REMOTE_HOSTS:
        _REMOTE_HOSTS[in_flight] = (ray.remote(concurrency_groups={IN_FLIGHT_GROUP: 1})(InFlightWorkerHost)
                                    if in_flight else ray.remote(WorkerHost))
    return _REMOTE_HOSTS[in_flight]


def _death_reason(exc: BaseException) -> str:
    """Ray's explanation of a death, cut to the part that differs between deaths."""
    if isinstance(exc, rex.OutOfMemoryError):
        return "killed by Ray's memory monitor (out of memory)"
    text = str(exc)
    if "ray.kill" in text:
        return "killed with ray.kill"
    detail = re.search(r"Worker exit detail: (.*?)(?: Some common causes|$)", text, re.S)
    kind = re.search(r"Worker exit type: (\w+)", text)
    parts = [f"exit type {kind.group(1)}" if kind else "", detail.group(1).strip() if detail else ""]
    reason = ": ".join(p for p in parts if p)
    if not reason:
        reason = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return reason


Method = str | Callable[..., Any]
"""What to call on a worker or host: a function of its class or Protocol (``TrainingWorker.train``,
``WorkerHost.nrl_refit_local``), so a call site names a method that exists and a rename reaches it,
or its name as a string (a backend's own extension method)."""


def group_backend(requested: str, cuda: bool) -> str:
    """The backend string the ranks join with: ``auto`` (with CUDA on every rank) and ``nccl`` give
    :func:`~nrl_core.device.process_group_backend`'s ``cpu:gloo,cuda:nccl``, so the same group
    carries the CPU tensors of object collectives and checkpoints; ``auto`` without CUDA is gloo."""
    if requested == "nccl" or (requested == "auto" and cuda):
        return process_group_backend(cuda=True)
    return "gloo" if requested == "auto" else requested


def method_name(method: Method) -> str:
    return method if isinstance(method, str) else method.__name__


class WorkerGroup:
    """``num_workers`` ranks of ``worker_cls`` (an import path, ``"pkg.mod:Class"``) on Ray.

    Each rank is built as ``Cls(**init_kwargs, rank=r, world_size=n)`` after the ranks joined a
    ``torch.distributed`` group: ``distributed_backend`` ``auto`` picks ``cpu:gloo,cuda:nccl`` when
    every actor sees CUDA and gloo otherwise (:func:`group_backend`); ``none`` skips the group
    (engines that form their own). Without a ``placement`` each actor asks Ray for ``num_cpus_per_worker`` (default 0, so CPUs can be
    oversubscribed) and ``num_gpus_per_worker``. ``env_vars`` are added to the workers' environment
    on top of what :func:`~nrl_core.cluster.worker_env_vars` forwards from the driver.

    ``preload`` names modules every actor imports as its first call, or worker classes whose
    ``lazy_imports`` come with them (:meth:`WorkerHost.preload`).
    With ``start=False`` the constructor only creates the actors and sends them that call, and
    returns at once; :meth:`start` then joins the process group and builds the workers (with
    ``init_kwargs`` given there, if not here), so the caller can do its own start-up meanwhile.

    ``collective_timeout_s`` is the process group's timeout (the run's ``distributed_timeout_minutes``,
    :mod:`nrl_core.process_groups`). After one rank fails, the others get ``error_grace_s`` to finish
    their part of the call; ranks still running then are taken to be blocked on the failed one, and
    the group is killed.
    """

    def __init__(
        self,
        worker_cls: str,
        num_workers: int,
        *,
        name: str,
        init_kwargs: dict[str, Any] | None = None,
        env_vars: dict[str, str] | None = None,
        placement: Placement | None = None,
        distributed_backend: str = "auto",
        num_cpus_per_worker: float = 0.0,
        num_gpus_per_worker: float = 0.0,
        start_timeout_s: float = 300.0,
        collective_timeout_s: float = DEFAULT_TIMEOUT_S,
        error_grace_s: float = 3.0,
        preload: Sequence[str] = (),
        start: bool = True,
        in_flight: bool = False,
        owner: PluginOwner | None = None,
        fault_log_dir: str | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"worker group '{name}' needs at least one worker, got {num_workers}")
        if distributed_backend not in _BACKENDS:
            raise ValueError(f"distributed_backend must be one of {_BACKENDS}, got '{distributed_backend}'")
        if placement is not None and placement.num_workers < num_workers:
            raise ValueError(
                f"worker group '{name}': placement has {placement.num_workers} bundles for {num_workers} workers"
            )
        init_ray()
        self.name = name
        self.worker_cls = worker_cls
        self.world_size = num_workers
        self.placement = placement
        self.error_grace_s = error_grace_s
        self.backend = distributed_backend
        self.master_addr: str | None = None
        self.master_port: int | None = None
        self.rendezvous_dir: str | None = None
        self._infos: list[WorkerInfo] = [WorkerInfo(rank=r) for r in range(num_workers)]
        self._actors: list[Any] = []
        self._closed = False
        self._broken: str | None = None
        self._started = False
        self._init_kwargs = init_kwargs
        self._timeouts = (start_timeout_s, collective_timeout_s)
        self.dp_leads: tuple[int, ...] = tuple(range(num_workers))  # where Fanout.DP calls go
        self._waiting: dict[int, tuple[str, set[int]]] = {}  # calls the driver waits on: ranks not yet done
        self._trace_dir = os.environ.get(TRACE_DIR_ENV)  # where the actors record their spans (forwarded)
        self.in_flight = in_flight  # the hosts take imports beside a stream (WorkerHost.nrl_refit_import_in_flight)
        self.owner = owner  # the plugin whose worker class this is: what it raises is that plugin's fault
        self._fault_log_dir = fault_log_dir
        _LIVE.add(self)
        with self._closed_on_error():
            self._launch(env_vars or {}, num_cpus_per_worker, num_gpus_per_worker, list(preload))
        if start:
            self.start()

    @contextlib.contextmanager
    def _closed_on_error(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self._kill_actors()
            self._remove_rendezvous()
            self._closed = True
            raise

    # ------------------------------------------------------------------ start-up

    def _actor_options(self, rank: int, env_vars: Mapping[str, str], cpus: float, gpus: float) -> dict[str, Any]:
        opts: dict[str, Any] = {"max_restarts": 0, "max_task_retries": 0}
        if self.placement is not None:
            opts.update(self.placement.actor_options(rank))
        else:
            opts.update(num_cpus=cpus, num_gpus=gpus)
        # Forwarded again per group (not only at init_ray) so a Ray the user started still gets them.
        runtime_env = actor_runtime_env(worker_env_vars(env_vars))
        if runtime_env is not None:
            opts["runtime_env"] = runtime_env
        return opts

    def _launch(self, env_vars: Mapping[str, str], cpus: float, gpus: float, preload: list[str]) -> None:
        host = _remote_host(self.in_flight)
        n = self.world_size
        self._actors = [
            host.options(**self._actor_options(r, env_vars, cpus, gpus)).remote(self.name, r, n) for r in range(n)
        ]
        if preload:  # not awaited: describe() queues behind it, and a failed import is the worker's to report
            for actor in self._actors:
                actor.preload.remote(preload)

    def start(self, init_kwargs: dict[str, Any] | None = None) -> None:
        """Join the ranks' process group and build the worker on each (``Cls(**init_kwargs, rank=,
        world_size=)``); what the constructor does unless it was given ``start=False``."""
        if self._started or self._closed:
            raise WorkerError(f"worker group '{self.name}' is {'shut down' if self._closed else 'already started'}")
        self._started = True
        with self._closed_on_error():
            self._start(init_kwargs if init_kwargs is not None else self._init_kwargs or {}, *self._timeouts)

    def _start(self, init_kwargs: dict[str, Any], start_timeout_s: float, collective_timeout_s: float) -> None:
        n = self.world_size
        described = self._collect(self._on_all("start-up", lambda a, r: a.describe.remote()), start_timeout_s, starting=True)
        self._infos = [
            WorkerInfo(
                rank=r,
                pid=d["pid"],
                node_ip=d["node_ip"],
                node_id=d["node_id"],
                worker_id=d["worker_id"],
                stdout=d["stdout"],
                stderr=d["stderr"],
                cuda=d["cuda"],
                gpu_ids=tuple(d["gpu_ids"]),
            )
            for r, d in enumerate(described)
        ]
        logger.info("%s: %s", self.name, ", ".join(f"rank {i.rank} pid {i.pid} on {i.node_ip}" for i in self._infos))
        self.backend = group_backend(self.backend, cuda=all(i.cuda for i in self._infos))
        # Rank 0 hosts the rendezvous store, so the port must be free on *its* node.
        self.master_addr = self._infos[0].node_ip or "127.0.0.1"
        self.master_port = int(self._collect(self._on_ranks([0], "free-port discovery", lambda a, r: a.free_port.remote()))[0])
        local_rank: list[int] = []
        per_node: dict[str | None, int] = {}
        for info in self._infos:
            local_rank.append(per_node.get(info.node_id, 0))
            per_node[info.node_id] = local_rank[-1] + 1
        envs = [
            {
                "RANK": str(r),
                "WORLD_SIZE": str(n),
                "LOCAL_RANK": str(local_rank[r]),
                "LOCAL_WORLD_SIZE": str(per_node[self._infos[r].node_id]),
                "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port),
            }
            for r in range(n)
        ]
        backend = self.backend
        init_method = "env://"
        if backend != "none" and private_local_ray():
            self.rendezvous_dir = tempfile.mkdtemp(prefix="nrl-rendezvous-")
            init_method = f"file://{self.rendezvous_dir}/store"
        local = init_method != "env://"
        what = "setting the rank environment" if backend == "none" else f"joining the {backend} process group"
        self._collect(self._on_all(what, lambda a, r: a.setup_distributed.remote(
            backend, envs[r], collective_timeout_s, init_method=init_method, loopback=local)))
        self._collect(
            self._on_all(f"constructing {self.worker_cls}", lambda a, r: a.construct.remote(self.worker_cls, init_kwargs))
        )

    # ------------------------------------------------------------------ dispatch

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise WorkerError(f"worker group '{self.name}' was stopped after a failure: {self._broken}")
        if self._closed:
            raise WorkerError(f"worker group '{self.name}' is shut down")
        if not self._started:
            raise WorkerError(f"worker group '{self.name}' is not started: call start() first")

    def _on_all(self, what: str, submit: Callable[[Any, int], ray.ObjectRef]) -> WorkerFutures:
        return self._on_ranks(range(self.world_size), what, submit)

    def _on_ranks(self, ranks: Sequence[int], what: str, submit: Callable[[Any, int], ray.ObjectRef]) -> WorkerFutures:
        """Submit ``submit(actor, rank)`` for each rank; ``what`` names the call in error messages."""
        self._follow_trace()
        refs = tuple(submit(self._actors[r], r) for r in ranks)
        return WorkerFutures(refs, tuple(ranks), what)

    def _follow_trace(self) -> None:
        """Tell the actors where the run's trace records worker spans when that changed since
        they last heard (a group launched before the run's watchdog opened its trace, e.g. the
        policy ``nrl train`` starts early); Ray runs the message before the call that follows."""
        trace_dir = os.environ.get(TRACE_DIR_ENV)
        if trace_dir != self._trace_dir:
            self._trace_dir = trace_dir
            for actor in self._actors:
                actor.nrl_trace_into.options(enable_task_events=False).remote(trace_dir)

    def call_async(self, method: Method, *args: Any, on: int | Sequence[int] | None = None,
                   per_rank_args: Sequence[tuple[Any, ...]] | None = None, **kwargs: Any) -> WorkerFutures:
        """Start ``method(*args, **kwargs)`` on the ranks its :func:`~nrl_core.dispatch.dispatch`
        declaration names (every rank when undeclared); resolve with :meth:`get`.

        ``method`` is a worker method (a Protocol function such as ``TrainingWorker.train``, or a
        name) or one of the host's own endpoints (``WorkerHost.nrl_refit_export``). ``on`` picks
        the ranks instead: one rank (its answer is the value) or several (gathered as declared).
        ``per_rank_args`` gives each of those ranks its own positional arguments."""
        self._check_usable()
        declared = dispatch_of(method)
        if declared.fanout is Fanout.STREAM:
            raise ValueError(f"{method_name(method)}() is streamed: call it with WorkerGroup.stream")
        single = isinstance(on, int) or (on is None and declared.fanout is Fanout.RANK0)
        ranks = self._ranks_for(declared.fanout, on)
        name = method_name(method)
        what = f"{name}()"
        if per_rank_args is not None:
            if len(per_rank_args) != len(ranks):
                raise ValueError(f"worker group '{self.name}': {name}() goes to {len(ranks)} ranks; got "
                                 f"{len(per_rank_args)} argument tuples")
            per_rank = dict(zip(ranks, per_rank_args))
            submit = self._submitter(method, lambda r: (tuple(per_rank[r]), kwargs))
        elif (args or kwargs) and len(ranks) > 1 and self._host_method(method) is None:
            packed = ray.put((args, kwargs))  # a batch stored once for all ranks
            submit = self._submitter(method, lambda r: None, packed=packed)
        else:
            submit = self._submitter(method, lambda r: (args, kwargs))
        futures = self._on_ranks(ranks, what, submit)
        return WorkerFutures(futures.refs, futures.ranks, what, single=single, gather=declared.gather)

    def call(self, method: Method, *args: Any, on: int | Sequence[int] | None = None,
             per_rank_args: Sequence[tuple[Any, ...]] | None = None, **kwargs: Any) -> Any:
        """:meth:`call_async`, then :meth:`get`: the answers gathered as the method declares."""
        return self.get(self.call_async(method, *args, on=on, per_rank_args=per_rank_args, **kwargs))

    def stream(self, method: Method, *args: Any, on: int = 0, backpressure: int | None = None,
               **kwargs: Any) -> Iterator[Any]:
        """Call a generator endpoint of the host on one rank and yield its items as they arrive
        (at most ``backpressure`` unread); a rank that dies or raises ends the stream with the same
        one-line error as any other call."""
        self._check_usable()
        name = self._host_method(method)
        if name is None:
            raise ValueError(f"{method_name(method)}(): only the host's generator endpoints are streamed")
        options: dict[str, Any] = {"num_returns": "streaming", "enable_task_events": False}
        if backpressure is not None:
            options["_generator_backpressure_num_objects"] = backpressure
        self._follow_trace()
        stream = getattr(self._actors[on], name).options(**options).remote(*args, **kwargs)
        what = f"{name}()"
        unanswered = {on}
        key = id(unanswered)
        self._waiting[key] = (what, unanswered)
        try:
            for ref in stream:
                yield ray.get(ref)
        except Exception as exc:  # every Ray and remote error ends up here
            err = self._error(what, [(on, exc)], [])
            if _is_death(exc):
                self._broken = str(err).splitlines()[0]
            raise err from None
        finally:
            del self._waiting[key]

    def get(self, futures: WorkerFutures, timeout_s: float | None = None) -> Any:
        """Wait for ``futures`` and gather them: in rank order, the first, the non-None ones or
        nothing, as the method declared (the value for a one-rank call).

        Raises :class:`WorkerError` subclasses as the module docstring describes; never waits on a
        dead rank. ``timeout_s`` bounds the wait (then :class:`WorkerTimeoutError`; the group is
        left running, the call may still finish).
        """
        results = self._collect(futures, timeout_s)
        if futures.single:
            return results[0]
        if futures.gather is Gather.FIRST:
            return results[0]
        if futures.gather is Gather.SHARDS:
            return [r for r in results if r is not None]
        if futures.gather is Gather.NONE:
            return None
        return results

    def endpoint(self, rank: int) -> GroupRank:
        """One rank of this group as an endpoint of a weight transfer (:func:`nrl_core.refit.refit`)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"worker group '{self.name}' has ranks 0..{self.world_size - 1}, not {rank}")
        return GroupRank(self, rank)

    def _ranks_for(self, fanout: Fanout, on: int | Sequence[int] | None) -> list[int]:
        if on is None:
            return {Fanout.RANK0: [0], Fanout.DP: list(self.dp_leads)}.get(fanout, list(range(self.world_size)))
        ranks = [on] if isinstance(on, int) else list(on)
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad:
            raise ValueError(f"worker group '{self.name}' has ranks 0..{self.world_size - 1}, not {bad}")
        return ranks

    @staticmethod
    def _host_method(method: Method) -> str | None:
        """The name of ``method`` when it is one of the host actor's own endpoints (the in-flight
        host's class has them all)."""
        if callable(method) and getattr(InFlightWorkerHost, method.__name__, None) is method:
            return method.__name__
        return None

    def _submitter(self, method: Method, arguments: Callable[[int], tuple[tuple[Any, ...], dict[str, Any]] | None],
                   packed: Any = None) -> Callable[[Any, int], ray.ObjectRef]:
        host = self._host_method(method)
        if host is not None:  # object refs among the arguments reach the endpoint resolved
            if not self.in_flight and not hasattr(WorkerHost, host):
                raise ValueError(f"worker group '{self.name}': {host}() needs hosts launched with in_flight=True")
            return lambda actor, r: getattr(actor, host).options(enable_task_events=False).remote(
                *arguments(r)[0], **arguments(r)[1])
        name = method_name(method)
        if packed is not None:
            return lambda actor, r: actor.call_packed.remote(name, packed)
        return lambda actor, r: actor.call.remote(name, *arguments(r))

    # ------------------------------------------------------------------ errors

    def label(self, rank: int) -> str:
        """How messages name a rank: ``<group>[rank r] pid P``."""
        pid = self._infos[rank].pid
        return f"{self.name}[rank {rank}] pid {pid if pid is not None else 'unknown'}"

    @property
    def infos(self) -> list[WorkerInfo]:
        """Identity of every rank (pid, node, log files), in rank order."""
        return list(self._infos)

    @property
    def actors(self) -> list[Any]:
        """The Ray actor handles in rank order, for code that passes them on (e.g. weight transfer)."""
        return list(self._actors)

    def pending_calls(self) -> list[tuple[str, list[int]]]:
        """The calls the driver is waiting on in this group, each with the ranks that have not
        answered yet (read from another thread by the watchdog)."""
        return [(what, sorted(ranks)) for what, ranks in list(self._waiting.values())]

    def _collect(self, futures: WorkerFutures, timeout_s: float | None = None, *, starting: bool = False) -> list[Any]:
        unanswered = set(futures.ranks)
        key = id(unanswered)
        self._waiting[key] = (futures.what, unanswered)
        try:
            return self._wait_for(futures, unanswered, timeout_s, starting=starting)
        finally:
            del self._waiting[key]

    def _wait_for(self, futures: WorkerFutures, unanswered: set[int], timeout_s: float | None, *, starting: bool) -> list[Any]:
        rank_of = dict(zip(futures.refs, futures.ranks))
        results: dict[int, Any] = {}
        failures: list[tuple[int, BaseException]] = []  # in the order they were seen
        pending = list(futures.refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def take(ready: list[ray.ObjectRef]) -> None:
            for ref in ready:
                unanswered.discard(rank_of[ref])
                try:
                    results[rank_of[ref]] = ray.get(ref)
                except Exception as exc:  # every Ray and remote error ends up here
                    failures.append((rank_of[ref], exc))

        while pending and not failures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                ranks = sorted(rank_of[ref] for ref in pending)
                if starting:
                    self._kill_actors()
                    raise WorkerTimeoutError(
                        f"{self.name}: ranks {ranks} did not start within {timeout_s:.0f} s; Ray has "
                        f"{ray.available_resources()} free (are there enough CPUs/GPUs for the placement?)"
                    )
                raise WorkerTimeoutError(f"{self.name}: ranks {ranks} did not finish {futures.what} within {timeout_s} s")
            take(ready)
        if not failures:
            return [results[r] for r in futures.ranks]
        if pending:  # the others may be blocked on the failed rank; give them a moment
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=self.error_grace_s)
            take(ready)
        stuck = sorted(rank_of[ref] for ref in pending)
        err = self._error(futures.what, failures, stuck)
        if stuck or any(_is_death(e) for _, e in failures):  # not a WorkerDiedError a worker raised
            self._broken = str(err).splitlines()[0]
            self._kill_actors()
        raise err

    def _error(self, what: str, failures: list[tuple[int, BaseException]], stuck: list[int]) -> NrlError:
        dead = {r for r, e in failures if _is_death(e)}
        rank, exc = next(((r, e) for r, e in failures if r in dead), failures[0])
        others = [f"rank {r} {'died' if r in dead else 'raised ' + type(remote_cause(e)).__name__}" for r, e in failures if r != rank]
        if stuck:
            others.append(f"ranks {stuck} were still running after {self.error_grace_s:.0f} s and were stopped")
        suffix = f" (also: {'; '.join(others)})" if others else ""
        if dead:
            info = self._infos[rank]
            where = f" on {info.node_ip}" if info.node_ip else ""
            lines = tail_lines(info.stdout, info.stderr, _LOG_LINES)
            if lines:
                logs = f"\nlast log lines ({info.stdout or info.stderr}):\n" + "\n".join(f"  {line}" for line in lines)
            elif info.stdout:
                logs = f"\nits logs are at {info.stdout} and {info.stderr}{where}"
            else:
                logs = "\nit died before reporting where its logs are"
            died = WorkerDiedError(f"{self.label(rank)} died{where} during {what}: {_death_reason(exc)}{suffix}{logs}")
            died.__cause__ = exc
            return died
        if isinstance(exc, rex.RayTaskError):
            cause = remote_cause(exc)
            if isinstance(cause, NrlError):
                cause.add_note(f"raised in {self.label(rank)} during {what}{suffix}")
                return cause
            if self.owner is not None and not self.owner.is_core:
                return plugin_fault(self.owner, f"{_class_name(self.worker_cls)}.{what.removesuffix('()')} on rank "
                                                f"{rank}{suffix}", exc, self._fault_log_dir)
            message = str(cause).strip().splitlines()
            first = message[0] if message else ""
            raised = WorkerRaisedError(
                f"{self.label(rank)}: {what} raised {type(cause).__name__}: {first}{suffix}"
            )
            # Ray's str() of the error is the remote traceback (its dual-class wrapper drops the field).
            raised.remote_traceback = getattr(exc, "traceback_str", None) or str(exc)
            raised.__cause__ = cause
            return raised
        err = WorkerError(f"{self.label(rank)}: {what} failed: {type(exc).__name__}: {exc}{suffix}")
        err.__cause__ = exc
        return err

    # ------------------------------------------------------------------ shutdown

    def _kill_actors(self) -> None:
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead, or Ray already shut down
                pass

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Let each rank release its resources (``worker.shutdown()`` if it has one, then leave the
        process group), then kill the actors. Safe to call twice and after a failure."""
        if self._closed:
            return
        self._closed = True
        if self._actors and self._started and self._broken is None and ray.is_initialized():
            refs = [actor.teardown.remote() for actor in self._actors]
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if ray.is_initialized():
            self._kill_actors()
        self._remove_rendezvous()

    def _remove_rendezvous(self) -> None:
        if self.rendezvous_dir is not None:
            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)
            self.rendezvous_dir = None

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "broken" if self._broken else "shut down" if self._closed else "running"
        return f"WorkerGroup({self.name!r}, {self.worker_cls!r}, world_size={self.world_size}, {state})"


_DEATHS: tuple[type[BaseException], ...] = tuple(
    t
    for t in (
        getattr(rex, "RayActorError", None),
        getattr(rex, "WorkerCrashedError", None),
        getattr(rex, "OutOfMemoryError", None),
        getattr(rex, "NodeDiedError", None),
    )
    if isinstance(t, type)
)


def _class_name(worker_path: str) -> str:
    """The worker class's own name from its import path (an adapted older plugin's path ends in it too)."""
    return re.split(r"[:.]", worker_path)[-1]


def _is_death(exc: BaseException) -> bool:
    """The rank's process is gone (as opposed to a method that raised, whatever it raised)."""
    return isinstance(exc, _DEATHS) and not isinstance(exc, rex.RayTaskError)


