"""``refit()``: move the training side's current weights into the generation side.

It works the same whether source and sink are local objects (one process) or Ray actors (the
training and the generation workers in their own processes): the transport is chosen by where
they are (same process -> ``in_process``, same node -> ``shared_memory``, otherwise
``broadcast``) unless the config names one (``policy.refit.transport``).
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from nrl_core.errors import ConfigError
from nrl_core.refit.buckets import DEFAULT_BUCKET_BYTES, bucket_bytes_from_gb, manifest_bytes
from nrl_core.refit.endpoints import STREAM_BACKPRESSURE, ExportedWeights, refit_local
from nrl_core.refit.report import RefitReport, combine_reports
from nrl_core.refit.transports import PLACEMENTS, RefitSession

TRANSPORT_KEY = "policy.refit.transport"


def _is_actor(obj: Any) -> bool:
    return type(obj).__module__.startswith("ray.") and type(obj).__name__ == "ActorHandle"


def choose_transport(placement: str, override: str | None = None) -> str:
    """The transport for ``placement``: ``override`` if given (checked against where it works),
    else the registered transport of highest priority that works there."""
    from nrl_core.plugins import get_plugin_manager

    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement '{placement}'; one of {', '.join(PLACEMENTS)}")
    registry = get_plugin_manager().refit_transports()
    if override:
        spec = registry.get(override, TRANSPORT_KEY)
        if placement not in spec.placements:
            raise ConfigError(TRANSPORT_KEY, f"transport '{override}' cannot be used when training and generation "
                                             f"are {placement.replace('_', ' ')} (it works {', '.join(spec.placements)}); "
                                             f"remove the key to choose automatically")
        return override
    for spec in sorted(registry, key=lambda spec: -spec.priority):
        if placement in spec.placements:
            return spec.name
    raise ConfigError(TRANSPORT_KEY, f"no installed refit transport works {placement.replace('_', ' ')} "
                                     f"(installed: {', '.join(registry.names()) or 'none'})")


def refit_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """``transport``, ``bucket_bytes`` and ``dtype`` for :func:`refit` from a validated config:
    ``policy.refit.transport`` (null: by placement), the bucket size from
    ``policy.refit_buffer_size_gb`` (NeMo RL's spelling, GiB) when set, else
    ``policy.refit.bucket_size_mb`` (MiB), and the dtype from ``policy.precision`` (null: each
    weight owner's default precision, resolved where the weights are)."""
    policy = config.get("policy", {}) or {}
    section = policy.get("refit") or {}
    gb = policy.get("refit_buffer_size_gb")
    mb = section.get("bucket_size_mb")
    if gb:
        bucket_bytes = bucket_bytes_from_gb(gb)
    elif mb:
        bucket_bytes = bucket_bytes_from_gb(mb / 1024)
    else:
        bucket_bytes = DEFAULT_BUCKET_BYTES
    return {"transport": section.get("transport"), "bucket_bytes": bucket_bytes,
            "dtype": policy.get("precision")}


def refit(source: Any, sink: Any | Sequence[Any], transport: str | None = None,
          bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: str | None = "float32",
          timeout_s: float | None = None) -> RefitReport:
    """Move ``source``'s weights (a :class:`~nrl_core.contracts.TrainingWorker`-like object with
    ``weight_manifest``/``export_weights``, or a Ray actor hosting one) into ``sink`` (a
    :class:`~nrl_core.contracts.GenerationWorker` or actor; several actors for data-parallel
    generation). Actors must inherit :class:`~nrl_core.refit.endpoints.RefitEndpoints`.

    ``dtype`` None is the source's default precision (``policy.precision`` null), resolved in the
    source's process. ``timeout_s`` bounds a collective transport's own group (``distributed_timeout_minutes``).

    Raises :class:`~nrl_core.refit.manifest.RefitError` (sinks keep their old weights) when what
    arrives does not match the source's manifest.
    """
    from nrl_core.refit.buckets import refit_dtype

    dtype = None if dtype is None else refit_dtype(dtype)
    sinks = list(sink) if isinstance(sink, (list, tuple)) else [sink]
    if not sinks:
        raise ValueError("refit needs at least one sink")
    if not _is_actor(source) and not any(_is_actor(s) for s in sinks):
        local = refit_dtype(dtype)
        reports = [refit_local(source, s, choose_transport("same_process", transport), bucket_bytes, local)
                   for s in sinks]
        return combine_reports(reports, concurrent=False)
    if not (_is_actor(source) and all(_is_actor(s) for s in sinks)):
        raise TypeError("refit: source and sinks must be all local objects or all Ray actors")
    return _refit_actors(source, sinks, transport, bucket_bytes, dtype, timeout_s)


def _refit_actors(source: Any, sinks: list[Any], override: str | None, bucket_bytes: int, dtype: str | None,
                  timeout_s: float | None = None) -> RefitReport:
    import ray

    start = time.perf_counter()
    colocated = [s._actor_id == source._actor_id for s in sinks]
    if any(colocated):
        if not all(colocated):
            raise ValueError("refit: the sinks must all live in the source's actor (colocated) or all in other "
                             "actors; a sharded training backend exports once per refit")
        transport = choose_transport("same_process", override)
        reports = ray.get([_call(s, "nrl_refit_local", transport, bucket_bytes, dtype) for s in sinks])
        return RefitReport(bytes=sum(r.bytes for r in reports), seconds=time.perf_counter() - start,
                           version=max(r.version for r in reports), transport=transport, placement="same_process")
    source_node, *nodes = _node_ids([source, *sinks])
    placement = "same_node" if all(n == source_node for n in nodes) else "cross_node"
    name = choose_transport(placement, override)
    from nrl_core.plugins import get_plugin_manager

    try:
        if get_plugin_manager().refit_transports().get(name, TRANSPORT_KEY).collective:
            nbytes, versions = _collective(source, sinks, name, bucket_bytes, dtype, timeout_s)
        else:
            nbytes, versions = _export_import(source, sinks, name, bucket_bytes, dtype)
    except BaseException:
        for actor in (source, *sinks):  # in case an actor was restarted elsewhere: ask again next time
            _NODE_OF_ACTOR.pop(actor._actor_id, None)
        raise
    return RefitReport(bytes=nbytes * len(sinks), seconds=time.perf_counter() - start, version=max(versions),
                       transport=name, placement=placement)


_NODE_OF_ACTOR: dict[Any, str] = {}


def _node_ids(actors: list[Any]) -> list[str]:
    """The node of each actor, asked once per actor: every refit would otherwise pay a round trip
    for it, and an actor does not move (nrl's worker groups do not let Ray restart one; a failed
    refit forgets the actors involved, in case one was restarted elsewhere)."""
    import ray

    unknown = [a for a in actors if a._actor_id not in _NODE_OF_ACTOR]
    for actor, node in zip(unknown, ray.get([_call(a, "nrl_refit_node_id") for a in unknown])):
        _NODE_OF_ACTOR[actor._actor_id] = node
    return [_NODE_OF_ACTOR[a._actor_id] for a in actors]


def _call(actor: Any, method: str, *args: Any) -> Any:
    """``actor.method.remote(*args)`` kept out of Ray's task-event stream (the dashboard's task
    list): recording an event costs about a millisecond per call here, a quarter of the fixed cost
    of a small model's refit."""
    return getattr(actor, method).options(enable_task_events=False).remote(*args)


def _export_import(source: Any, sinks: list[Any], name: str, bucket_bytes: int, dtype: str | None) -> tuple[int, list[int]]:
    """The source exports once; every sink imports the same handles, concurrently. The sinks'
    calls depend on the export's object ref, so Ray starts them when it is done: one wait here."""
    import ray

    exported = _call(source, "nrl_refit_export", name, bucket_bytes, dtype)
    try:
        imports = [_call(s, "nrl_refit_import", exported) for s in sinks]
        # Every engine must be done with the buffers before an error reaches a caller who might
        # refit again at once: the next export rewrites them.
        ray.wait(imports, num_returns=len(imports))
        versions = [int(v) for v in ray.get(imports)]
        return manifest_bytes(ray.get(exported).manifest), versions
    finally:
        _call(source, "nrl_refit_cleanup", [exported])  # runs before the source's next call; nothing to wait for


def _collective(source: Any, sinks: list[Any], name: str, bucket_bytes: int, dtype: str | None,
                timeout_s: float | None = None) -> tuple[int, list[int]]:
    """One sender, every sink receiving the same broadcast concurrently."""
    import ray

    options: dict[str, Any] = {"world_size": 1 + len(sinks)}
    if timeout_s is not None:
        options["timeout_s"] = float(timeout_s)
    manifest = ray.get(_call(source, "nrl_refit_manifest", dtype))
    session = ray.get(_call(source, "nrl_refit_prepare", name, RefitSession(options=options)))
    try:
        pending = [_call(s, "nrl_refit_receive", name, session.with_options(rank=i + 1), manifest)
                   for i, s in enumerate(sinks)]
        stream = source.nrl_refit_send.options(num_returns="streaming", enable_task_events=False,
                                               _generator_backpressure_num_objects=STREAM_BACKPRESSURE).remote(
            name, session, bucket_bytes, dtype)
        for ref in stream:  # a collective sender yields no handles; this waits for it and surfaces its errors
            ray.get(ref)
        ray.wait(pending, num_returns=len(pending))
        return manifest_bytes(manifest), [int(v) for v in ray.get(pending)]
    finally:
        _call(source, "nrl_refit_cleanup", [ExportedWeights(transport=name, session=session, manifest=[], handles=[])])
