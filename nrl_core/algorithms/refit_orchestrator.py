"""``refit()``: move the training side's current weights into the generation side.

It works the same whether source and sink are local objects (one process) or Ray actors (the
training and the generation workers in their own processes): the transport is chosen by where
they are and where the weights live (same process -> ``in_process``; on the CPU, same node ->
``shared_memory``, otherwise ``broadcast`` over gloo; between GPUs, on one node or across nodes,
``broadcast`` over NCCL, device to device) unless the config names one (``policy.refit.transport``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from nrl_core.contracts import REFIT_DEVICES
from nrl_core.errors import ConfigError
from nrl_core.plugins import PluginManager, get_plugin_manager
from nrl_core.refit.buckets import manifest_bytes
from nrl_core.refit.endpoints import STREAM_BACKPRESSURE, ExportedWeights, names_of, refit_local, slices_of
from nrl_core.refit.plan import DEFAULT_PLAN, RefitPlan
from nrl_core.refit.report import RefitReport, combine_reports
from nrl_core.refit.transports import PLACEMENTS, RefitSession, TransportChoice, broadcast_backend

TRANSPORT_KEY = "policy.refit.transport"
PIPELINED_TRANSPORT = "shared_memory"
"""The transport a pipelined refit runs over: its handles are small files' names, safe to publish
on the channel (a plugin transport's handles might be Ray references, which a file cannot carry)."""
DEFAULT_WAIT_S = 600.0
"""How long a pipelined refit's sinks wait for the source's next bucket when no timeout is given."""


def choose_transport(placement: str, override: str | None = None,
                     plugins: PluginManager | None = None, device: str = "cpu") -> TransportChoice:
    """The transport for ``placement`` with the weights on ``device`` (``cpu`` or ``cuda``):
    ``override`` if given (checked against the placements it works in; a transport named in the
    config is used on any device), else the registered transport of highest priority whose
    placements and devices include these (among ``plugins``'; this process's when None)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement '{placement}'; one of {', '.join(PLACEMENTS)}")
    if device not in REFIT_DEVICES:
        raise ValueError(f"unknown device '{device}'; one of {', '.join(REFIT_DEVICES)}")
    registry = (plugins or get_plugin_manager()).refit_transports()
    where = f"when training and generation are {placement.replace('_', ' ')}"
    if override:
        spec = registry.get(override, TRANSPORT_KEY)
        if placement not in spec.placements:
            raise ConfigError(TRANSPORT_KEY, f"transport '{override}' cannot be used {where} (it works "
                                             f"{', '.join(spec.placements)}); remove the key to choose automatically")
        return TransportChoice(spec.name, spec.transport, spec.collective)
    for spec in sorted(registry, key=lambda spec: -spec.priority):
        if placement in spec.placements and device in spec.devices:
            return TransportChoice(spec.name, spec.transport, spec.collective)
    raise ConfigError(TRANSPORT_KEY, f"no installed refit transport works {where} with weights on {device} "
                                     f"(installed: {', '.join(registry.names()) or 'none'})")


def placement_of(source: Any, sinks: Sequence[Any]) -> tuple[str, str]:
    """``(placement, device)`` of a refit between worker group ranks: ``cuda`` when the training
    side exports from a GPU and every engine loads onto one in its own process (an engine that
    takes its weights through host memory, as vLLM's async engine does for its child process,
    says so: :meth:`~nrl_core.refit.endpoints.RefitEndpoints.nrl_refit_device`)."""
    placement = "same_node" if all(s.node_id == source.node_id for s in sinks) else "cross_node"
    return placement, _device_of(source, sinks)


def _device_of(source: Any, sinks: Sequence[Any]) -> str:
    from nrl_core.cluster._host import WorkerHost

    if not _on_gpus([source, *sinks]):
        return "cpu"  # no call to the actors: a CPU run never pays for the question
    key = _group_key(source, sinks)
    if key not in _SINK_DEVICES:
        devices = [device for group, ranks in _by_group(list(sinks)).items()
                   for device in group.call(WorkerHost.nrl_refit_device, on=ranks)]
        _SINK_DEVICES[key] = "cuda" if all(d == "cuda" for d in devices) else "cpu"
    return _SINK_DEVICES[key]


def _on_gpus(ranks: Sequence[Any]) -> bool:
    """Whether every one of ``ranks`` started with a GPU (as its actor recorded)."""
    return all(rank.group.infos[rank.rank].cuda for rank in ranks)


#: Where each set of engines of a run loads its weights, asked once (:func:`_device_of`).
_SINK_DEVICES: dict[str, str] = {}


def refit(source: Any | Sequence[Any], sink: Any | Sequence[Any], plan: RefitPlan = DEFAULT_PLAN) -> RefitReport:
    """Move ``source``'s weights into ``sink`` (several sinks for data-parallel generation), as
    ``plan`` says (:class:`~nrl_core.refit.plan.RefitPlan`: transport, mode, delivery, sizes).

    Either all are local objects (a :class:`~nrl_core.contracts.TrainingWorker`-like source with
    ``weight_manifest``/``export_weights``, :class:`~nrl_core.contracts.GenerationWorker` sinks),
    or all are ranks of worker groups (:meth:`WorkerGroup.endpoint
    <nrl_core.cluster.worker_group.WorkerGroup.endpoint>`), called through the groups like any
    other worker call: a rank that dies or raises is one error naming it.

    Colocated: ``source`` is every training rank and ``sink`` the same ranks, each hosting a rank
    of an engine: every rank loads its own engine in process, all at once (exporting full tensors
    is collective for a sharded backend). Otherwise one source rank exports for every sink.

    Raises :class:`~nrl_core.refit.manifest.RefitError` (sinks keep their old weights) when what
    arrives does not match the source's manifest.
    """
    from nrl_core.refit.buckets import refit_dtype

    plan = dataclasses.replace(plan, dtype=None if plan.dtype is None else refit_dtype(plan.dtype))
    sources = list(source) if isinstance(source, (list, tuple)) else [source]
    sinks = list(sink) if isinstance(sink, (list, tuple)) else [sink]
    if not sinks or not sources:
        raise ValueError("refit needs a source and at least one sink")
    ranks = [_is_group_rank(x) for x in (*sources, *sinks)]
    if not any(ranks):
        if len(sources) != 1:
            raise ValueError("refit: local objects have one source")
        transport = choose_transport("same_process", plan.transport)
        reports = [refit_local(sources[0], s, transport, plan.bucket_bytes, refit_dtype(plan.dtype), plan.wanted,
                               plan.pipelined) for s in sinks]
        return combine_reports(reports, concurrent=False)
    if not all(ranks):
        raise TypeError("refit: source and sinks must be all local objects or all worker group ranks "
                        "(WorkerGroup.endpoint)")
    if sources == sinks:
        return _refit_colocated(sources, plan)
    if len(sources) != 1 or any(s in sources for s in sinks):
        raise ValueError("refit: colocated, the sinks are the source ranks themselves; otherwise one source rank "
                         "exports for sinks in other actors (a sharded training backend exports once per refit)")
    return _refit_ranks(sources[0], sinks, plan)


def _is_group_rank(obj: Any) -> bool:
    from nrl_core.cluster.worker_group import GroupRank

    return isinstance(obj, GroupRank)


def _refit_colocated(ranks: list[Any], plan: RefitPlan) -> RefitReport:
    """Every rank loads the engine rank it hosts, in process, all at once."""
    from nrl_core.cluster._host import WorkerHost

    if plan.in_flight:
        raise ValueError("refit: in-flight weight updates need engines in actors of their own (not colocated)")
    transport = choose_transport("same_process", plan.transport, device="cuda" if _on_gpus(ranks) else "cpu")
    reports = [report for group, on in _by_group(ranks).items()
               for report in group.call(WorkerHost.nrl_refit_local, transport, plan.bucket_bytes, plan.dtype,
                                        plan.wanted, plan.pipelined, on=on)]
    return combine_reports(reports)


def _refit_ranks(source: Any, sinks: list[Any], plan: RefitPlan) -> RefitReport:
    start = time.perf_counter()
    placement, device = placement_of(source, sinks)
    transport = choose_transport(placement, plan.transport, device=device)
    if transport.collective:
        nbytes, versions = _collective(source, sinks, transport, plan, device)
    elif plan.pipelined and transport.name == PIPELINED_TRANSPORT:
        nbytes, versions = _stream_import(source, sinks, transport, plan)
    else:
        nbytes, versions = _export_import(source, sinks, transport, plan)
    return RefitReport(bytes=nbytes * len(sinks), seconds=time.perf_counter() - start, version=max(versions),
                       transport=transport.name, placement=placement)


def _by_group(sinks: list[Any]) -> dict[Any, list[int]]:
    """The sinks' ranks per group (one call per group, not per rank)."""
    groups: dict[Any, list[int]] = {}
    for sink in sinks:
        groups.setdefault(sink.group, []).append(sink.rank)
    return groups


def _gather(calls: list[tuple[Any, Any]]) -> list[Any]:
    """Wait for every group's call, then surface the first failure: every engine must be done
    with the buffers before an error reaches a caller who might refit again at once (the next
    export rewrites them)."""
    _gather_quietly(calls)
    return [value for group, futures in calls for value in group.get(futures)]


def _export_import(source: Any, sinks: list[Any], transport: TransportChoice, plan: RefitPlan) -> tuple[int, list[int]]:
    """The source exports once; every sink imports the same handles, concurrently. The sinks'
    calls take the export's object ref, so Ray starts them when it is done."""
    from nrl_core.cluster._host import InFlightWorkerHost, WorkerHost

    exported = source.call_async(WorkerHost.nrl_refit_export, transport, plan.bucket_bytes, plan.dtype)
    try:
        endpoint = InFlightWorkerHost.nrl_refit_import_in_flight if plan.in_flight else WorkerHost.nrl_refit_import
        imports = [(group, group.call_async(endpoint, exported.refs[0], plan.wanted, plan.streams, on=ranks))
                   for group, ranks in _by_group(sinks).items()]
        try:
            weights = source.get(exported)  # an export that failed is the source's error, not the engines'
        except BaseException:
            _gather_quietly(imports)
            raise
        return manifest_bytes(weights.manifest), [int(v) for v in _gather(imports)]
    finally:
        # Runs before the source's next call; nothing to wait for (a failed export cleaned up itself).
        _cleanup(source, [exported.refs[0]])


def _stream_import(source: Any, sinks: list[Any], transport: TransportChoice, plan: RefitPlan) -> tuple[int, list[int]]:
    """A pipelined refit on one node: the source publishes each bucket's handle on a channel as it
    writes it, and every sink, called at the same moment, loads each bucket as it is published."""
    from nrl_core.cluster._host import WorkerHost
    from nrl_core.refit.channel import ChannelAddress

    channel = ChannelAddress(RefitSession().id)
    exported = source.call_async(WorkerHost.nrl_refit_export_streamed, transport, channel, plan.bucket_bytes,
                                 plan.dtype)
    try:
        imports = [(group, group.call_async(WorkerHost.nrl_refit_import_streamed, transport, channel, [exported.refs[0]],
                                            float(plan.timeout_s or DEFAULT_WAIT_S), plan.wanted, on=ranks))
                   for group, ranks in _by_group(sinks).items()]
        try:
            nbytes = int(source.get(exported))
        except BaseException:
            _gather_quietly(imports)
            raise
        return nbytes, [int(v) for v in _gather(imports)]
    finally:
        _cleanup(source, [ExportedWeights(transport=transport, session=RefitSession(id=channel.session_id), manifest=[],
                                          handles=[])])


def _gather_quietly(calls: list[tuple[Any, Any]]) -> None:
    import ray

    ray.wait([ref for _, futures in calls for ref in futures.refs], num_returns=sum(len(f.refs) for _, f in calls))


def _collective(source: Any, sinks: list[Any], transport: TransportChoice, plan: RefitPlan,
                device: str = "cpu") -> tuple[int, list[int]]:
    """One sender, every sink receiving at once: broadcast, except (each rank its wanted tensors)
    what only one sink loads, sent to it alone. A sink's refusal of the manifest comes before
    anything is sent. Pipelined: each sink loads every bucket as it arrives; one that fails
    part-way reads the rest of the stream, so the sender and the other sinks finish."""
    from nrl_core.cluster._host import InFlightWorkerHost, WorkerHost

    key = _group_key(source, sinks)
    options: dict[str, Any] = {"world_size": 1 + len(sinks), "group_key": key, "reuse": key in _FORMED_GROUPS,
                               "backend": broadcast_backend(device == "cuda")}
    if plan.timeout_s is not None:
        options["timeout_s"] = float(plan.timeout_s)
    manifest = source.call(WorkerHost.nrl_refit_manifest, plan.dtype)
    receive_rank = {(s.group, s.rank): i + 1 for i, s in enumerate(sinks)}
    try:
        wants = _wants(sinks, manifest, plan.in_flight) if plan.wanted else {}
    except BaseException:
        source.call(WorkerHost.nrl_refit_drain, plan.bucket_bytes, plan.dtype)  # the other training ranks' export ends
        raise
    names = {spec.name for spec in manifest}
    options["skips"] = {receive_rank[sink]: sorted(names.difference(names_of(wanted))) for sink, wanted in wants.items()
                        if wanted is not None}
    options["slices"] = {receive_rank[sink]: slices for sink, wanted in wants.items()
                         if (slices := slices_of(wanted))}
    session = source.call(WorkerHost.nrl_refit_prepare, transport, RefitSession(options=options))
    try:
        endpoint = InFlightWorkerHost.nrl_refit_receive_in_flight if plan.in_flight else WorkerHost.nrl_refit_receive
        pending = [(group, group.call_async(endpoint, on=ranks, per_rank_args=[
                        (transport, session.with_options(rank=receive_rank[(group, r)], skips={}, slices={}), manifest,
                         wants.get((group, r)), plan.streams)
                        for r in ranks]))
                   for group, ranks in _by_group(sinks).items()]
        try:
            for _ in source.group.stream(WorkerHost.nrl_refit_send, transport, session, plan.bucket_bytes, plan.dtype,
                                         on=source.rank,
                                         backpressure=STREAM_BACKPRESSURE):
                pass  # a collective sender yields no handles; this waits for it and surfaces its errors
        except BaseException:
            _FORMED_GROUPS.discard(key)  # its members dropped it: the next refit forms it again
            _gather_quietly(pending)
            raise
        try:
            versions = [int(v) for v in _gather(pending)]
        except BaseException:
            _FORMED_GROUPS.discard(key)
            raise
        _FORMED_GROUPS.add(key)
        return manifest_bytes(manifest), versions
    finally:
        _cleanup(source, [ExportedWeights(transport=transport, session=session, manifest=[], handles=[])])


#: The collective refit groups formed in this run, by :func:`_group_key`: each is formed at its
#: first refit and reused by the next ones, and forgotten when a refit through it fails.
_FORMED_GROUPS: set[str] = set()


def _group_key(source: Any, sinks: list[Any]) -> str:
    """The sender and receivers of a collective refit, by their actors: the same key from refit
    to refit of a run, another for other actors."""
    infos = [endpoint.group.infos[endpoint.rank] for endpoint in (source, *sinks)]
    return "-".join(info.worker_id or f"{info.node_id}:{info.pid}" for info in infos)


def _wants(sinks: list[Any], manifest: list[Any], in_flight: bool) -> dict[tuple[Any, int], list[Any] | None]:
    """What each sink loads of ``manifest`` (its worker's ``refit_wants``), checked against it:
    a sink naming a tensor the source does not send is refused before anything is sent (the caller
    then runs the source's export for the other training ranks, whose export is collective)."""
    from nrl_core.cluster._host import InFlightWorkerHost, WorkerHost
    from nrl_core.refit.endpoints import wanted_part

    endpoint = InFlightWorkerHost.nrl_refit_wants_in_flight if in_flight else WorkerHost.nrl_refit_wants
    calls = [(group, ranks, group.call_async(endpoint, manifest, on=ranks)) for group, ranks in _by_group(sinks).items()]
    wants: dict[tuple[Any, int], list[Any] | None] = {}
    for group, ranks, futures in calls:
        for rank, names in zip(ranks, group.get(futures)):
            if names is not None:
                wanted_part(manifest, names, who=f"{group.name}[rank {rank}]")
            wants[(group, rank)] = names
    return wants


def _cleanup(source: Any, exported: list[Any]) -> None:
    """End the source's side of a refit; a source whose group a failure stopped has nothing left to end."""
    from nrl_core.cluster._host import WorkerHost
    from nrl_core.errors import WorkerError

    try:
        source.call_async(WorkerHost.nrl_refit_cleanup, exported)
    except WorkerError:
        pass
