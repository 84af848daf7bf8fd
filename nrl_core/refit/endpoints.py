"""The two halves of a refit as they run inside the processes that own the weights.

:func:`send_handles` runs next to the training worker (rank 0), :func:`receive_into` next to the
generation worker. :func:`refit_local` runs both in one process. :class:`RefitEndpoints` exposes
them as Ray actor methods: an actor class that hosts workers inherits it, and the orchestrator
drives a refit between such actors.

With a handle-based transport (``shared_memory``) the training actor exports every bucket first
(:meth:`RefitEndpoints.nrl_refit_export`) and each generation actor imports the same handles
(:meth:`RefitEndpoints.nrl_refit_import`): the generation side stages the whole model before it
loads anything anyway (a refit that fails its manifest check must leave the engine untouched), so
streaming buckets would overlap nothing, and one export serves any number of engines. A
collective transport (``broadcast``) needs both halves running at once: the training actor sends
through a Ray streaming generator while the generation actors receive.

Generation workers that declare ``pipelined_import`` load as the buckets arrive instead: the
training actor publishes each handle on a same-node channel the moment its bucket is written
(:meth:`RefitEndpoints.nrl_refit_export_streamed`, :mod:`nrl_core.refit.channel`) and the
generation actors, called at the same moment, load bucket k while bucket k+1 is exported
(:meth:`RefitEndpoints.nrl_refit_import_streamed`). In one process (colocated) such a worker
loads each bucket as the training worker exports it (:func:`refit_local`), so the engine's device
never holds a second copy of the model.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from nrl_core.contracts import WeightSpec, import_object
from nrl_core.dispatch import Fanout, Gather, dispatch
from nrl_core.long_lived import long_lived_objects
from nrl_core.refit.adapters import AdapterSink, AdapterSource
from nrl_core.refit.buckets import iter_buckets, manifest_bytes, refit_dtype
from nrl_core.refit.channel import ChannelAddress, ChannelReader, ChannelWriter, remove_channel
from nrl_core.refit.report import RefitReport
from nrl_core.refit.slices import Region, WeightSlice, as_owned, check_slice
from nrl_core.refit.transports import RefitSession, TransportChoice
from nrl_core.timeline import mark

STREAM_BACKPRESSURE = 2
"""Buckets a training actor may run ahead of the generation actors in a collective transport."""


PIPELINE_CHUNK_BYTES = 4 * 2**20
"""What a pipelined refit publishes at a time, whatever ``bucket_size_mb`` is (a bucket is what the
training side gathers at once): the engine starts loading once the first chunk is written."""


class _Chunked:
    """A weight source whose buckets are cut into chunks of whole tensors of about ``chunk_bytes``."""

    def __init__(self, source: Any, chunk_bytes: int) -> None:
        self.source, self.chunk_bytes = source, chunk_bytes

    def export_weights(self, bucket_bytes: int, dtype: str) -> Iterator[list[Any]]:
        for bucket in self.source.export_weights(bucket_bytes, dtype):
            yield from iter_buckets(iter(bucket), self.chunk_bytes)


@dataclass(frozen=True)
class ExportedWeights:
    """One export through a handle-based transport: everything a generation actor needs to import
    it (small and picklable; the bytes stay where the transport put them)."""

    transport: TransportChoice
    session: RefitSession
    manifest: list[WeightSpec]
    handles: list[Any]


def send_handles(source: Any, transport: TransportChoice, session: RefitSession, bucket_bytes: int,
                 dtype: str) -> Iterator[Any]:
    """Export ``source``'s weights bucket by bucket through the transport; yield the handles."""
    sender = transport.build().sender(session)
    try:
        for bucket in source.export_weights(bucket_bytes, dtype):
            handle = sender.send(bucket)
            if handle is not None:
                yield handle
    finally:
        sender.close()


def wanted_part(manifest: list[WeightSpec], wants: Iterable[str | WeightSlice],
                who: str = "the engine") -> list[WeightSpec]:
    """The entries of ``manifest`` named in ``wants`` (what a
    :class:`~nrl_core.contracts.PartialImporter` rank loads: a name, or with ``sliced_import`` a
    :class:`~nrl_core.refit.slices.WeightSlice` of one); a name outside the manifest, or a block
    outside its tensor, is a :class:`~nrl_core.refit.manifest.RefitError` before anything is sent."""
    from nrl_core.refit.manifest import RefitError

    wants = list(wants)
    wanted = names_of(wants)
    unknown = sorted(wanted - {spec.name for spec in manifest})
    if unknown:
        raise RefitError(f"refit rejected, weights unchanged; {who} asks for {len(unknown)} tensors the training "
                         f"side does not send: {', '.join(unknown[:8])} (its refit_wants must name manifest "
                         f"entries)", extra=unknown)
    specs = {spec.name: spec for spec in manifest}
    for entry in wants:
        if isinstance(entry, WeightSlice):
            check_slice(entry, specs[entry.name], who)
    return [spec for spec in manifest if spec.name in wanted]


def names_of(wants: Iterable[str | WeightSlice]) -> set[str]:
    """The tensors ``wants`` names, whole or a block of."""
    return {entry if isinstance(entry, str) else entry.name for entry in wants}


def slices_of(wants: Iterable[str | WeightSlice] | None) -> dict[str, Region]:
    """The blocks among ``wants``, by name (a name wanted whole is not among them)."""
    return {entry.name: entry.region for entry in wants or () if isinstance(entry, WeightSlice)}


def _without(buckets: Iterable[Any], unwanted: frozenset[str]) -> Iterator[Any]:
    """The buckets less the tensors named in ``unwanted`` (a transport that sent them anyway); what
    the manifest never named still passes, for the manifest check to refuse."""
    # a map keeps no bucket between items: one kept while the next is received would hold its buffer
    return map(lambda bucket: [(name, tensor) for name, tensor in bucket if name not in unwanted], buckets)


def receive_into(sink: Any, transport: TransportChoice, session: RefitSession, handles: Iterable[Any],
                 manifest: list[WeightSpec], pipelined: bool = False,
                 wants: Iterable[str | WeightSlice] | None = None) -> int:
    """Rebuild the buckets from ``handles`` and hand them to ``sink.import_weights`` (``pipelined``:
    to ``sink.import_weights_pipelined``, which loads them as they arrive); the version.

    ``wants``: the names of ``manifest`` the sink loads (``refit_wants``, partial import); the sink
    then gets only those tensors and a manifest of only those, and each block it named
    (``sliced_import``) as an :class:`~nrl_core.refit.slices.OwnedRegion` of the manifest's shape. Leaves the transport's cleanup to the
    caller: other receivers may still be reading the same handles."""
    receiver = transport.build().receiver(session)
    pipelined = pipelined and hasattr(sink, "import_weights_pipelined")  # adapter sinks import atomically
    load = sink.import_weights_pipelined if pipelined else sink.import_weights
    try:
        # a receiver that stops part-way reads the rest: the sender and the other receivers go on to the end
        with _read_to_the_end(receiver.buckets(handles), pipelined and transport.collective) as buckets:
            if wants is not None:
                part = wanted_part(manifest, wants)
                kept = {spec.name for spec in part}
                buckets = _without(buckets, frozenset(spec.name for spec in manifest if spec.name not in kept))
                manifest = part
                slices = slices_of(wants)
                if slices:  # each block handed as a tensor of the whole shape that holds only the block
                    buckets = as_owned(buckets, slices, {spec.name: spec.shape for spec in part})
            return int(load(buckets, manifest))
    finally:
        receiver.close()


def drain_export(source: Any, bucket_bytes: int, dtype: str) -> None:
    """Run ``source``'s export and drop the buckets: a sharded training backend's other ranks
    gather full tensors collectively, so every rank must take part in each export."""
    for _ in source.export_weights(bucket_bytes, dtype):
        pass


def local_wants(sink: Any, manifest: list[WeightSpec], partial: bool) -> list[str | WeightSlice] | None:
    """What ``sink`` loads of ``manifest`` when the refit is ``partial`` (its backend declares
    ``partial_import``), else None: everything. Adapter-only refits send everything."""
    if not partial or isinstance(sink, AdapterSink):
        return None
    return list(sink.refit_wants(list(manifest)))


class _Held:
    """An iterator its consumer cannot close (it has no ``close`` for a generator to pass on)."""

    def __init__(self, items: Iterable[Any]) -> None:
        self._items = iter(items)

    def __iter__(self) -> _Held:
        return self

    def __next__(self) -> Any:
        return next(self._items)


@contextlib.contextmanager
def _read_to_the_end(items: Iterable[Any], needed: bool) -> Iterator[Iterable[Any]]:
    """``items`` for a consumer that may fail part-way; when ``needed``, the rest is read after its
    failure: a collective stream (a sharded source's export gathers, a broadcast group) must run
    to its end on every rank, also after this rank's import stopped reading."""
    if not needed:
        yield items
        return
    held = _Held(items)
    try:
        yield held
    except Exception:
        with contextlib.suppress(Exception):
            for _ in held:
                pass
        raise


def refit_local(source: Any, sink: Any, transport: TransportChoice, bucket_bytes: int, dtype: str,
                partial: bool = False, pipelined: bool = False) -> RefitReport:
    """Both halves in this process (``in_process``, or ``shared_memory`` to exercise its path);
    ``partial``: the sink declares ``partial_import`` and gets only what it names. ``pipelined``:
    the sink declares ``pipelined_import`` and loads each bucket as it is exported, so no second
    copy of the model is staged; a failure part-way leaves it refusing to generate until a refit
    succeeds, and this rank's export still runs to its end (a sharded source's is collective)."""
    if transport.collective:
        raise ValueError(f"the {transport.name} transport needs the sender and the receiver in different processes")
    start = time.perf_counter()
    built = transport.build()
    session = built.prepare(RefitSession())
    manifest = source.weight_manifest(dtype)
    try:
        wants = local_wants(sink, manifest, partial)
    except BaseException:
        drain_export(source, bucket_bytes, dtype)  # colocated ranks of a sharded source export together
        raise
    try:
        with _read_to_the_end(send_handles(source, transport, session, bucket_bytes, dtype), pipelined) as handles:
            version = receive_into(sink, transport, session, handles, manifest, pipelined=pipelined, wants=wants)
    finally:
        built.cleanup(session)
    return RefitReport(bytes=manifest_bytes(manifest), seconds=time.perf_counter() - start, version=version,
                       transport=transport.name, placement="same_process")


class RefitEndpoints:
    """Mixin for Ray actor classes that host a training and/or a generation worker; each endpoint
    declares how :meth:`WorkerGroup.call <nrl_core.cluster.worker_group.WorkerGroup.call>` reaches it.

    The training side is ``self.worker``; the generation side is ``self.generation_worker`` when the
    actor also hosts one (colocated placement, built with :meth:`nrl_colocate_generation`), else
    ``self.worker``. Override :meth:`nrl_refit_source` / :meth:`nrl_refit_sink` to change that.
    """

    worker: Any = None
    generation_worker: Any = None
    adapter_refit: dict[str, Any] | None = None  # the adapter config while refits send adapters alone

    def record_call(self, what: str) -> None:
        """Called with the name of every worker method this actor runs; hosts that keep a call
        history override it (see :class:`~nrl_core.cluster._host.WorkerHost`)."""

    def nrl_refit_source(self) -> Any:
        return self.worker

    def nrl_refit_sink(self) -> Any:
        return self.generation_worker if self.generation_worker is not None else self.worker

    def _refit_from(self) -> Any:
        source = self.nrl_refit_source()
        return source if self.adapter_refit is None else AdapterSource(source)

    def _refit_into(self) -> Any:
        sink = self.nrl_refit_sink()
        return sink if self.adapter_refit is None else AdapterSink(sink, self.adapter_refit)

    @dispatch(Fanout.RANK0)
    def nrl_adapter_config(self) -> dict[str, Any]:
        """The training worker's PEFT adapter config (``AdapterExporter.adapter_config``)."""
        return dict(self.nrl_refit_source().adapter_config())

    @dispatch(Fanout.ALL, Gather.NONE)
    def nrl_refit_adapters(self, adapter_config: dict[str, Any] | None) -> None:
        """From now on this actor's refits move LoRA adapters (``adapter_config``: what the
        training side's ``adapter_config`` returned) instead of weights; None: weights again."""
        self.adapter_refit = None if adapter_config is None else dict(adapter_config)

    @dispatch(Fanout.ALL, Gather.NONE)
    def nrl_colocate_generation(self, worker_cls: str, config: dict[str, Any], rank: int | None = None,
                                world_size: int | None = None) -> None:
        """Build a generation worker (import path) inside this actor, beside its training worker;
        by default it takes the host's own rank in its group (a worker group's ``rank``)."""
        rank = getattr(self, "rank", 0) if rank is None else rank
        world_size = getattr(self, "world_size", 1) if world_size is None else world_size
        mark("generation_worker_import_start", worker=worker_cls, rank=rank)
        with long_lived_objects():
            cls = import_object(worker_cls)
            mark("generation_worker_build_start", worker=worker_cls, rank=rank)
            self.generation_worker = cls(config, rank=rank, world_size=world_size)
        mark("generation_worker_built", worker=worker_cls, rank=rank)

    @dispatch(Fanout.ALL)
    def nrl_generation_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a method of this actor's generation worker (``generate``, ``shutdown``...)."""
        self.record_call(f"generation.{method}")
        return getattr(self.nrl_refit_sink(), method)(*args, **kwargs)

    @dispatch(Fanout.DP)
    def nrl_weight_version(self) -> int:
        """This actor's engine's weight version (negative: no weights loaded yet)."""
        return int(self.nrl_refit_sink().weight_version)

    @dispatch(Fanout.ALL, Gather.SHARDS)
    def nrl_generate_sharded(self, chunks: list[list[list[int]]], engine_size: int, greedy: bool = False) -> Any:
        """Generate this rank's engine's chunk (engine ``rank // engine_size``); only the engine's
        first rank returns the output, so each engine's result crosses to the driver once."""
        rank = getattr(self, "rank", 0)
        self.record_call("generation.generate")
        output = self.nrl_refit_sink().generate(chunks[rank // engine_size], greedy=greedy)
        return output if rank % engine_size == 0 else None

    @dispatch(Fanout.STREAM)
    def nrl_generate_groups(self, prompts: list[list[int]], group_size: int, greedy: bool = False,
                            engine_size: int = 1) -> Iterator[Any]:
        """``(prompt index, output)`` for each prompt's group of samples as it completes: a
        generator, call with ``.options(num_returns="streaming")``. Every rank of an engine of
        ``engine_size`` ranks runs it (an engine may need all its ranks); only its first yields."""
        self.record_call("generation.generate_groups")
        lead = getattr(self, "rank", 0) % engine_size == 0
        for item in self.nrl_refit_sink().generate_groups(prompts, group_size, greedy=greedy):
            if lead:
                yield item

    @dispatch(Fanout.ALL)
    def nrl_refit_node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    @dispatch(Fanout.ALL)
    def nrl_refit_device(self) -> str:
        """Where this actor's engine loads refitted weights: ``cuda`` or ``cpu``. A generation
        worker that takes them through host memory on a GPU machine (vLLM's async engine hands
        them to its child process in files) says so with a ``refit_device`` attribute; otherwise
        its process's device."""
        from nrl_core.contracts import REFIT_DEVICES

        declared = getattr(self.nrl_refit_sink(), "refit_device", None)
        if declared in REFIT_DEVICES:
            return str(declared)
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @dispatch(Fanout.RANK0)
    def nrl_refit_export(self, transport: TransportChoice, bucket_bytes: int, dtype: str | None) -> ExportedWeights:
        """Export the source's weights through a handle-based transport, for any number of
        :meth:`nrl_refit_import` calls; :meth:`nrl_refit_cleanup` ends the refit. A ``dtype`` of
        None, here and in the other endpoints, is this process's default precision."""
        dtype = refit_dtype(dtype)
        built = transport.build()
        session = built.prepare(RefitSession())
        source = self._refit_from()
        try:
            manifest = list(source.weight_manifest(dtype))
            handles = list(send_handles(source, transport, session, bucket_bytes, dtype))
        except BaseException:
            built.cleanup(session)
            raise
        return ExportedWeights(transport=transport, session=session, manifest=manifest, handles=handles)

    @dispatch(Fanout.RANK0)
    def nrl_refit_export_streamed(self, transport: TransportChoice, channel: ChannelAddress, bucket_bytes: int,
                                  dtype: str | None) -> int:
        """:meth:`nrl_refit_export` for a pipelined refit: each bucket is written in chunks of
        :data:`PIPELINE_CHUNK_BYTES`, and each chunk's handle is published on ``channel`` the moment
        it is written, for :meth:`nrl_refit_import_streamed` calls running at
        the same time; an error is published too. Returns the bytes exported;
        :meth:`nrl_refit_cleanup` ends the refit."""
        dtype = refit_dtype(dtype)
        writer = ChannelWriter(channel)
        try:
            session = transport.build().prepare(RefitSession(id=channel.session_id))
            source = self._refit_from()
            manifest = list(source.weight_manifest(dtype))
            writer.header(session, manifest)
            for handle in send_handles(_Chunked(source, PIPELINE_CHUNK_BYTES), transport, session,
                                       bucket_bytes, dtype):
                writer.put(handle)
            writer.close()
        except BaseException as exc:
            writer.fail(exc)
            raise
        return manifest_bytes(manifest)

    @dispatch(Fanout.DP)
    def nrl_refit_import(self, exported: ExportedWeights, partial: bool = False, pipelined: bool = False) -> int:
        """Load an export of another actor into this actor's generation worker; the new version.
        ``partial``: the worker declares ``partial_import`` and gets only what it names;
        ``pipelined``: it loads each bucket as it reads it (``import_weights_pipelined``)."""
        self.record_call("refit")
        sink = self._refit_into()
        return receive_into(sink, exported.transport, exported.session, exported.handles, exported.manifest,
                            pipelined=pipelined, wants=local_wants(sink, exported.manifest, partial))

    @dispatch(Fanout.DP)
    def nrl_refit_import_streamed(self, transport: TransportChoice, channel: ChannelAddress, export: list[Any],
                                  timeout_s: float, partial: bool = False) -> int:
        """Load, bucket by bucket as they are published, what :meth:`nrl_refit_export_streamed`
        exports on ``channel`` into this actor's generation worker (``import_weights_pipelined``);
        the new version. ``export``: ``[ref]`` to that export call, to notice a sender that died."""
        import ray

        self.record_call("refit")
        reader = ChannelReader(channel, timeout_s, exporter_done=lambda: bool(ray.wait(export, timeout=0)[0]))
        session, manifest = reader.header()
        sink = self._refit_into()
        return receive_into(sink, transport, session, reader.handles(), manifest, pipelined=True,
                            wants=local_wants(sink, manifest, partial))

    @dispatch(Fanout.DP)
    def nrl_refit_wants(self, manifest: list[WeightSpec]) -> list[str | WeightSlice] | None:
        """What this actor's generation worker loads of ``manifest`` (``refit_wants``), for a
        collective transport's sender; None: everything (an adapter-only refit)."""
        return local_wants(self._refit_into(), manifest, partial=True)

    @dispatch(Fanout.RANK0, Gather.NONE)
    def nrl_refit_cleanup(self, exported: list[Any]) -> None:
        """End a refit this actor sent: ``[ExportedWeights]``, or ``[ref]`` to one (wrapped in a
        list so that a failed export reaches here as the ref, not as an error)."""
        import ray

        done = exported[0]
        if isinstance(done, ray.ObjectRef):
            try:
                done = ray.get(done)
            except Exception:  # the export failed and cleaned up after itself
                return
        done.transport.build().cleanup(done.session)
        remove_channel(ChannelAddress(done.session.id))

    @dispatch(Fanout.RANK0)
    def nrl_refit_manifest(self, dtype: str | None) -> list[WeightSpec]:
        return list(self._refit_from().weight_manifest(refit_dtype(dtype)))

    @dispatch(Fanout.RANK0)
    def nrl_refit_prepare(self, transport: TransportChoice, session: RefitSession) -> RefitSession:
        return transport.build().prepare(session)

    @dispatch(Fanout.STREAM)
    def nrl_refit_send(self, transport: TransportChoice, session: RefitSession, bucket_bytes: int,
                       dtype: str | None) -> Iterator[Any]:
        """The sending half of a collective transport: a generator, call with
        ``.options(num_returns="streaming")``."""
        yield from send_handles(self._refit_from(), transport, session, bucket_bytes, refit_dtype(dtype))

    @dispatch(Fanout.DP)
    def nrl_refit_receive(self, transport: TransportChoice, session: RefitSession, manifest: list[WeightSpec],
                          wants: list[str | WeightSlice] | None = None, pipelined: bool = False) -> int:
        """The receiving half of a collective transport (the bytes arrive out of band); the new
        weight version. ``wants``: what :meth:`nrl_refit_wants` answered for this rank;
        ``pipelined``: load each bucket as it arrives (the sink declares ``pipelined_import``)."""
        return receive_into(self._refit_into(), transport, session, (), manifest, pipelined=pipelined, wants=wants)

    @dispatch(Fanout.ALL, Gather.NONE)
    def nrl_refit_drain(self, bucket_bytes: int, dtype: str | None) -> None:
        """Run the source's export and drop the buckets: what ranks other than 0 of a sharded
        training backend do during a refit, since gathering full tensors is collective."""
        drain_export(self._refit_from(), bucket_bytes, refit_dtype(dtype))

    @dispatch(Fanout.RANK0, Gather.NONE)
    def nrl_refit_release(self) -> None:
        """Free the shared-memory buffers and the refit groups this process keeps (at shutdown)."""
        from nrl_core.refit.transports import release_refit_groups, release_shared_buffers

        release_shared_buffers()
        release_refit_groups()

    @dispatch(Fanout.ALL)
    def nrl_refit_local(self, transport: TransportChoice, bucket_bytes: int, dtype: str | None,
                        partial: bool = False, pipelined: bool = False) -> RefitReport:
        self.record_call("refit")
        return refit_local(self._refit_from(), self._refit_into(), transport, bucket_bytes,
                           refit_dtype(dtype), partial, pipelined)

