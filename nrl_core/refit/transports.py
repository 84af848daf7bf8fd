"""The three core refit transports, registered by :mod:`nrl_core.builtin`.

A transport has two halves that run where the data is:

* a :class:`TransportSender` in the training process turns each bucket into a small picklable
  *handle* (or ``None`` when the data travels out of band);
* a :class:`TransportReceiver` in the generation process turns the stream of handles back into
  buckets of tensors.

The orchestration carries the handles (a local generator in one process; between actors, the
training actor's export result, which every generation actor imports); the transport carries the
bytes. A collective transport (``broadcast``) returns no handles: its two halves run at once.

* ``in_process``: the handle *is* the bucket; tensors are handed over by reference.
* ``shared_memory``: each bucket is packed into one flat file under ``/dev/shm`` through
  ``torch.UntypedStorage.from_file(shared=True)``; the handle holds the file name and the
  (name, dtype, shape, offset) of each tensor, and the receiver builds views on its mapping, so the
  only copy on the path is the sender's pack. By default both sides keep the files mapped and the
  sender rewrites them at the next refit (``reuse_buffers``; fresh pages cost more than the copy);
  with ``reuse_buffers=False`` every refit uses new files, removed by the refit's cleanup.
* ``broadcast``: a private ``torch.distributed`` group of the training rank 0 (root) and the
  generation ranks, created from a ``TCPStore`` the sender hosts, NCCL between GPUs and gloo on
  the CPU; each bucket is a header, its pickled layouts, one flat ``uint8`` buffer broadcast of
  the tensors more than one receiver loads, and one sent point to point to each receiver with
  tensors only it loads (``session.options["skips"]``: a rank of vLLM's expert parallelism gets
  its own experts only) or its block of (``session.options["slices"]``: a tensor-parallel rank
  gets its rows or columns), all on the group's device. Works across nodes.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import os
import pickle
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from nrl_core.refit.buckets import Bucket, dtype_name, parse_dtype, tensor_nbytes
from nrl_core.refit.shm_space import reserve, shm_dir
from nrl_core.refit.slices import Region, cut

if TYPE_CHECKING:
    import torch

PLACEMENTS = ("same_process", "same_node", "cross_node")
_ALIGN = 64


@dataclass(frozen=True)
class RefitSession:
    """What both halves of one refit agree on; picklable, created by the orchestrator.

    ``options`` is transport-specific (the broadcast group's address, world size and the
    receiver's rank); :meth:`RefitTransport.prepare` fills it in on the sender's side.
    """

    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    options: dict[str, Any] = field(default_factory=dict)

    def with_options(self, **options: Any) -> RefitSession:
        return replace(self, options={**self.options, **options})


class TransportSender(Protocol):
    def send(self, bucket: Bucket) -> Any:
        """Ship ``bucket``; return its small picklable handle, or ``None`` if it went out of band."""

    def close(self) -> None:
        """End of stream (called once after the last bucket, also after an error)."""


class TransportReceiver(Protocol):
    def buckets(self, handles: Iterable[Any]) -> Iterator[Bucket]:
        """The buckets, in order, rebuilt from the sender's non-``None`` handles."""

    def close(self) -> None: ...


class RefitTransport(Protocol):
    """A transport class, named by a :class:`~nrl_core.contracts.RefitTransportSpec`; built with no
    arguments on both sides."""

    name: str

    def prepare(self, session: RefitSession) -> RefitSession:
        """Runs on the sender's side before the refit starts (choose an address, a directory)."""

    def sender(self, session: RefitSession) -> TransportSender: ...

    def receiver(self, session: RefitSession) -> TransportReceiver: ...

    def cleanup(self, session: RefitSession) -> None:
        """End a refit on the sender's side, once every receiver is done (also after a failure):
        remove what the session left behind. Safe to call twice."""


@dataclass(frozen=True)
class TransportChoice:
    """A refit transport as the driver chose it from the registry (``nrl_refit_transports``): its
    name, the import path of its class, and whether both halves must run at once. Small and
    picklable, so a worker builds the transport from it without a registry of its own."""

    name: str
    path: str
    collective: bool = False

    def build(self) -> RefitTransport:
        from nrl_core.contracts import import_object

        return import_object(self.path)()


# --------------------------------------------------------------------------- in_process


class _ByReference:
    def send(self, bucket: Bucket) -> Bucket:
        return bucket

    def buckets(self, handles: Iterable[Any]) -> Iterator[Bucket]:
        return iter(handles)

    def close(self) -> None:
        pass


class InProcessTransport:
    """Source and sink share a process: buckets pass by reference, nothing is copied."""

    name = "in_process"

    def prepare(self, session: RefitSession) -> RefitSession:
        return session

    def sender(self, session: RefitSession) -> TransportSender:
        return _ByReference()

    def receiver(self, session: RefitSession) -> TransportReceiver:
        return _ByReference()

    def cleanup(self, session: RefitSession) -> None:
        pass


# --------------------------------------------------------------------------- packing


@dataclass(frozen=True)
class PackedLayout:
    """Where each tensor of a bucket sits in its flat byte buffer."""

    nbytes: int
    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]  # (name, dtype, shape, byte offset)


def layout_of(bucket: Bucket) -> PackedLayout:
    entries = []
    offset = 0
    for name, tensor in bucket:
        entries.append((name, dtype_name(tensor.dtype), tuple(int(d) for d in tensor.shape), offset))
        offset += -(-tensor_nbytes(tensor) // _ALIGN) * _ALIGN
    return PackedLayout(nbytes=max(offset, 1), entries=tuple(entries))


def pack_into(flat: torch.Tensor, bucket: Bucket, layout: PackedLayout) -> None:
    """Copy each tensor of ``bucket`` into its slot of the ``uint8`` buffer ``flat``."""
    for (_name, tensor), (_, _, _, offset) in zip(bucket, layout.entries):
        if tensor.numel() == 0:
            continue
        slot = flat[offset:offset + tensor_nbytes(tensor)].view(tensor.dtype).view(tensor.shape)
        slot.copy_(tensor.detach())


def views_of(flat: torch.Tensor, layout: PackedLayout) -> Bucket:
    """The bucket as views into ``flat`` (no copy)."""
    bucket: Bucket = []
    for name, dtype_str, shape, offset in layout.entries:
        dtype = parse_dtype(dtype_str)
        numel = 1
        for d in shape:
            numel *= d
        bucket.append((name, flat[offset:offset + numel * dtype.itemsize].view(dtype).view(shape)))
    return bucket


# --------------------------------------------------------------------------- shared_memory


@dataclass(frozen=True)
class ShmHandle:
    path: str
    layout: PackedLayout
    reused: bool = False


def _map(path: str, nbytes: int) -> torch.Tensor:
    """Map (creating if needed) ``path`` as a flat ``uint8`` tensor shared with other processes."""
    import torch

    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _map_for_writing(path: str, nbytes: int) -> torch.Tensor:
    """:func:`_map` for a buffer the sender is about to fill, its space reserved first: ``/dev/shm``
    hands out pages on first write, and a process that writes past its free space dies of SIGBUS."""
    held = os.path.getsize(path) if os.path.exists(path) else 0
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        reserve(fd, path, nbytes, "refit: the next weight bucket (shared-memory refits keep a copy of the whole "
                "model there)", held)
    except BaseException:
        if not held:
            _unlink(path)
        raise
    finally:
        os.close(fd)
    return _map(path, nbytes)


_POOL_PREFIX = "nrl-refit-pool-"


class _SenderPool:
    """The ``/dev/shm`` files one sending process writes its buckets into, reused refit after refit.

    A fresh file's pages must be allocated and zeroed on first write, which costs more than the
    copy itself (about 0.2 s per 300 MB here); a reused file is already backed. So is a reused
    mapping: mapping a file again faults in every page on first write. A file and its mapping only
    grow, so refits whose buckets differ in size (a pipelined refit's chunks, another bucket size)
    write a prefix of what they have. Files are named by the owner's pid and bucket index; they are
    removed by :func:`release_shared_buffers`, at interpreter exit, or, for a process that was
    killed, by the next pool created on the node.
    """

    def __init__(self, directory: str) -> None:
        import atexit

        self.directory = directory
        self.maps: dict[int, torch.Tensor] = {}
        _remove_stale_pool_files(directory)
        atexit.register(self.release)

    def slot(self, index: int, nbytes: int) -> tuple[str, torch.Tensor]:
        """The file for bucket ``index`` and the first ``nbytes`` of its mapping, mapped anew only
        when the held one is too small or its file is gone."""
        path = os.path.join(self.directory, f"{_POOL_PREFIX}{os.getpid()}-{index:06d}")
        flat = self.maps.get(index)
        if flat is None or flat.numel() < nbytes or not os.path.exists(path):
            flat = self.maps[index] = _map_for_writing(path, nbytes)
        return path, flat[:nbytes]

    def release(self) -> None:
        self.maps.clear()
        for path in glob.glob(os.path.join(self.directory, f"{_POOL_PREFIX}{os.getpid()}-*")):
            _unlink(path)


def _remove_stale_pool_files(directory: str) -> None:
    for path in glob.glob(os.path.join(directory, f"{_POOL_PREFIX}*")):
        pid = os.path.basename(path)[len(_POOL_PREFIX):].split("-", 1)[0]
        try:
            os.kill(int(pid), 0)
        except (ValueError, ProcessLookupError):
            _unlink(path)
        except PermissionError:  # alive, owned by someone else
            pass


@dataclass(frozen=True)
class _HeldMapping:
    """A receiver's mapping of a sender's pool file, and which file it maps: a file removed and
    made again under the same name (a sender that released its pool, a pid used again) is another
    file, whose bytes the old mapping does not see."""

    file: tuple[int, int]  # (st_dev, st_ino)
    flat: torch.Tensor


_SENDER_POOLS: dict[str, _SenderPool] = {}
_RECEIVER_MAPS: dict[str, _HeldMapping] = {}


def release_shared_buffers() -> None:
    """Drop this process's reusable shared-memory buffers (both sides); the next refit makes new ones."""
    for pool in _SENDER_POOLS.values():
        pool.release()
    _SENDER_POOLS.clear()
    _RECEIVER_MAPS.clear()


class _ShmSender:
    def __init__(self, session: RefitSession) -> None:
        directory = session.options.get("shm_dir") or shm_dir()
        self._reuse = bool(session.options.get("reuse_buffers", True))
        self._prefix = os.path.join(directory, f"nrl-refit-{session.id}-")
        self._pool = _SENDER_POOLS.setdefault(directory, _SenderPool(directory)) if self._reuse else None
        self._seq = 0

    def send(self, bucket: Bucket) -> ShmHandle:
        layout = layout_of(bucket)
        index, self._seq = self._seq, self._seq + 1
        if self._pool is not None:
            path, flat = self._pool.slot(index, layout.nbytes)
            pack_into(flat, bucket, layout)
            return ShmHandle(path=path, layout=layout, reused=True)
        path = f"{self._prefix}{index:06d}"
        try:
            flat = _map_for_writing(path, layout.nbytes)
            pack_into(flat, bucket, layout)
        except BaseException:
            _unlink(path)
            raise
        del flat  # the sender's mapping goes; the file (and its pages) stay for the receiver
        return ShmHandle(path=path, layout=layout)

    def close(self) -> None:
        pass


class _ShmReceiver:
    def buckets(self, handles: Iterable[Any]) -> Iterator[Bucket]:
        # yielded from a call, so this frame keeps none of it: a mapping only the bucket holds goes with it
        return map(_mapped_views, handles)

    def close(self) -> None:
        pass


def _mapped_views(handle: ShmHandle) -> Bucket:
    stat = _check_exists(handle)
    if handle.reused:  # the sender rewrites this file next refit: keep all of it mapped
        file = (stat.st_dev, stat.st_ino)
        held = _RECEIVER_MAPS.get(handle.path)
        if held is None or held.file != file or held.flat.numel() < handle.layout.nbytes:
            held = _RECEIVER_MAPS[handle.path] = _HeldMapping(file, _map(handle.path, stat.st_size))
        return views_of(held.flat, handle.layout)
    # other receivers may read the same file: the sender's cleanup removes it
    return views_of(_map(handle.path, handle.layout.nbytes), handle.layout)


def _check_exists(handle: ShmHandle) -> os.stat_result:
    """The handle's file, checked: mapping a missing file would create an empty one and load
    zeros as weights, so refuse instead."""
    try:
        stat: os.stat_result | None = os.stat(handle.path)
    except OSError:
        stat = None
    if stat is None or stat.st_size < handle.layout.nbytes:
        from nrl_core.refit.manifest import RefitError

        size = -1 if stat is None else stat.st_size
        raise RefitError(f"refit rejected, weights unchanged; the shared-memory buffer {handle.path} is gone or short "
                         f"({size} of {handle.layout.nbytes} bytes): the sending process exited or released it "
                         f"before the receiver read it")
    return stat


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SharedMemoryTransport:
    """Same node, different processes: one ``/dev/shm`` file per bucket, mapped by the receiver."""

    name = "shared_memory"

    def prepare(self, session: RefitSession) -> RefitSession:
        return session.with_options(shm_dir=session.options.get("shm_dir") or shm_dir())

    def sender(self, session: RefitSession) -> TransportSender:
        return _ShmSender(session)

    def receiver(self, session: RefitSession) -> TransportReceiver:
        return _ShmReceiver()

    def cleanup(self, session: RefitSession) -> None:
        directory = session.options.get("shm_dir") or shm_dir()
        for path in glob.glob(os.path.join(directory, f"nrl-refit-{session.id}-*")):
            _unlink(path)


# --------------------------------------------------------------------------- broadcast


def _node_address() -> str:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    return "127.0.0.1"


def broadcast_backend(cuda: bool) -> str:
    """The refit group's backend: NCCL between GPUs (device to device, no host copy, as NeMo RL and
    verl refit), gloo on the CPU. The sender decides; every receiver joins what it chose."""
    return "nccl" if cuda else "gloo"


class _Group:
    """A private group of a sender and its receivers (never the default group: training owns that
    one), on the backend the sender chose; every tensor it carries lives on :attr:`device`. With
    a ``group_key`` in the session's options it lasts from refit to refit (:func:`_group_for`)."""

    def __init__(self, session: RefitSession, rank: int) -> None:
        import torch
        import torch.distributed as dist

        opts = session.options
        backend = str(opts.get("backend", "gloo"))
        if backend == "nccl" and not torch.cuda.is_available():
            from nrl_core.refit.manifest import RefitError

            raise RefitError(f"refit rejected, weights unchanged; the sender broadcasts over NCCL but receiver rank "
                             f"{rank} has no CUDA device; give every generation worker a GPU or none to the trainer")
        timeout = datetime.timedelta(seconds=float(opts.get("timeout_s", 600)))
        size = int(opts["world_size"])
        bound = _BOUND_STORES.pop(session.id, None) if rank == 0 else None
        self._store = bound if bound is not None else dist.TCPStore(opts["host"], int(opts["port"]), size, rank == 0,
                                                                     timeout=timeout)
        store = dist.PrefixStore(f"nrl-refit-{session.id}", self._store)
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(store, rank, size, nccl_opts)
        else:
            self.device = torch.device("cpu")
            self._pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._bopts = dist.BroadcastOptions()
        self._bopts.rootRank = 0
        self.shape = (backend, size, rank)
        _GROUPS_FORMED["count"] += 1

    def destroy(self, failed: bool = False) -> None:
        """Free the communicator (NCCL's lives until shut down) and the store: after a failure
        ``abort``, which does not wait on peers that may be gone; else ``shutdown``."""
        end = getattr(self._pg, "abort" if failed else "shutdown", None)
        if callable(end):
            with contextlib.suppress(Exception):
                end()
        self._pg = self._store = None

    def broadcast(self, tensor: torch.Tensor) -> None:
        self._pg.broadcast([tensor], self._bopts).wait()

    def send(self, tensor: torch.Tensor, rank: int) -> Any:
        return self._pg.send([tensor], rank, 0)

    def receive(self, tensor: torch.Tensor) -> None:
        self._pg.recv([tensor], 0, 0).wait()


_LASTING: dict[str, _Group] = {}  # group key -> this process's group, formed at the key's first refit
_GROUPS_FORMED = {"count": 0}


def _group_for(session: RefitSession, rank: int) -> _Group:
    """This process's group for ``session``: formed anew (replacing one of the same key), or, when
    the driver says the key's group is formed (``reuse``), the one formed then. A group is made
    once per run and sender-receiver set, not once per refit: forming one costs seconds on NCCL,
    and NCCL communicators live until destroyed."""
    key = session.options.get("group_key")
    if key and session.options.get("reuse"):
        group = _LASTING.get(key)
        wanted = (str(session.options.get("backend", "gloo")), int(session.options["world_size"]), rank)
        if group is None or group.shape != wanted:
            from nrl_core.refit.manifest import RefitError

            raise RefitError(f"refit rejected, weights unchanged; rank {rank} of the refit group {key} does not hold "
                             "it (its process was restarted?); restart the run")
        return group
    group = _Group(session, rank)
    if key:
        drop_group(key, failed=False)  # the members form it anew: the driver saw a refit through it fail
        _LASTING[key] = group
    return group


def drop_group(key: str | None, group: _Group | None = None, failed: bool = True) -> None:
    """Destroy ``group`` (a refit through it failed), forgetting it under ``key`` only if it is
    the one held there: a late failure of an old refit must not destroy the group a newer one
    formed under the same key. Without ``group``: whatever ``key`` holds (the run ends)."""
    if not key:
        if group is not None:
            group.destroy(failed)
        return
    if group is None or _LASTING.get(key) is group:
        group = _LASTING.pop(key, None)
    if group is not None:
        group.destroy(failed)


def release_refit_groups() -> None:
    """Destroy every group this process holds for refits (at shutdown)."""
    for key in list(_LASTING):
        drop_group(key, failed=False)


def broadcast_groups_formed() -> int:
    """How many refit groups this process has formed: what shows a group lasting across refits."""
    return _GROUPS_FORMED["count"]


def split_by_skips(bucket: Bucket, receivers: Iterable[int], skips: dict[int, frozenset[str]],
                   slices: dict[int, dict[str, Region]] | None = None) -> tuple[Bucket, dict[int, Bucket]]:
    """``bucket``'s tensors to broadcast, and for each receiver the tensors to send it alone: a
    tensor only one receiver loads goes to it alone (``skips``: what each receiver does not load),
    any other to the whole group, so the sender still sends each byte once; a tensor no receiver
    loads is not sent. A tensor some receiver loads a block of (``slices``: its
    :class:`~nrl_core.refit.slices.WeightSlice` regions) goes to each receiver alone, as its block
    or whole. A name no receiver skips (one the manifest never named) is broadcast, for every
    receiver's manifest check to refuse."""
    receivers = list(receivers)
    slices = slices or {}
    shared: Bucket = []
    private: dict[int, Bucket] = {}
    for name, tensor in bucket:
        takers = [r for r in receivers if name not in skips.get(r, ())]
        blocks = {r: slices[r][name] for r in takers if name in slices.get(r, {})}
        if blocks or (len(takers) == 1 and len(receivers) > 1):
            for r in takers:
                private.setdefault(r, []).append((name, cut(tensor, blocks[r]) if r in blocks else tensor))
        elif takers:
            shared.append((name, tensor))
    return shared, private


def _packed(bucket: Bucket, layout: PackedLayout, device: torch.device) -> torch.Tensor:
    import torch

    flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    pack_into(flat, bucket, layout)
    return flat


class _BroadcastSender:
    def __init__(self, session: RefitSession) -> None:
        self._key = session.options.get("group_key")
        self._group = _group_for(session, rank=0)
        self._failed = False
        self._receivers = range(1, int(session.options["world_size"]))
        self._skips = {int(rank): frozenset(names) for rank, names in (session.options.get("skips") or {}).items()}
        self._slices = {int(rank): {name: tuple(map(tuple, region)) for name, region in blocks.items()}
                        for rank, blocks in (session.options.get("slices") or {}).items()}

    def send(self, bucket: Bucket) -> None:
        try:
            self._send(bucket)
        except BaseException:
            self._failed = True
            drop_group(self._key, self._group)  # a stream cut part-way leaves the group out of step
            raise

    def _send(self, bucket: Bucket) -> None:
        import torch

        device = self._group.device
        shared, private = split_by_skips(bucket, self._receivers, self._skips, self._slices)
        layout = layout_of(shared)
        private_layouts = {rank: layout_of(tensors) for rank, tensors in private.items()}
        meta = torch.frombuffer(bytearray(pickle.dumps((layout, private_layouts))), dtype=torch.uint8).to(device)
        self._group.broadcast(torch.tensor([meta.numel(), layout.nbytes], dtype=torch.int64, device=device))
        self._group.broadcast(meta)
        if shared:
            self._group.broadcast(_packed(shared, layout, device))
        sends = [self._group.send(_packed(tensors, private_layouts[rank], device), rank)
                 for rank, tensors in private.items()]
        for work in sends:
            work.wait()
        return None

    def close(self) -> None:
        import torch

        if self._failed:  # the group is gone with the failure, which is what the caller sees
            return
        try:
            self._group.broadcast(torch.zeros(2, dtype=torch.int64, device=self._group.device))  # end of stream
        except BaseException:
            drop_group(self._key, self._group)
            raise


_RECEIVED = {"bytes": 0}
_BOUND_STORES: dict[str, Any] = {}  # session id -> the sender's store, bound by prepare, taken by its group


def broadcast_bytes_received() -> int:
    """The bytes of the tensors this process received in its last broadcast refit, broadcast and
    sent to it alone together (headers, layouts and alignment left out): what shows that a rank got
    only its part."""
    return _RECEIVED["bytes"]


class _BroadcastReceiver:
    def __init__(self, session: RefitSession) -> None:
        self._rank = int(session.options["rank"])
        self._key = session.options.get("group_key")
        self._group = _group_for(session, rank=self._rank)
        _RECEIVED["bytes"] = 0

    def buckets(self, handles: Iterable[Any]) -> Iterator[Bucket]:
        ended = False
        try:
            yield from self._buckets()
            ended = True
        finally:
            if not ended:  # a failure here, or a reader that stopped early: the group is out of step
                drop_group(self._key, self._group)

    def _buckets(self) -> Iterator[Bucket]:
        while (layouts := self._next_layouts()) is not None:
            # yielded from a call, so this frame keeps none of it: a sink that drops the bucket frees
            # its buffers before the next one's are allocated (one bucket in memory, not two)
            yield self._receive(*layouts)

    def _next_layouts(self) -> tuple[PackedLayout, PackedLayout | None, int] | None:
        """The next bucket's layout, this rank's private part's, and the broadcast's bytes; None at the end."""
        import torch

        device = self._group.device
        header = torch.zeros(2, dtype=torch.int64, device=device)
        self._group.broadcast(header)
        meta_len, nbytes = (int(v) for v in header.tolist())
        if meta_len == 0:
            return None
        meta = torch.empty(meta_len, dtype=torch.uint8, device=device)
        self._group.broadcast(meta)
        layouts: tuple[PackedLayout, dict[int, PackedLayout]] = pickle.loads(meta.cpu().numpy().tobytes())
        layout, private_layouts = layouts
        return layout, private_layouts.get(self._rank), nbytes

    def _receive(self, layout: PackedLayout, mine: PackedLayout | None, nbytes: int) -> Bucket:
        import torch

        device = self._group.device
        bucket: Bucket = []
        if layout.entries:
            flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._group.broadcast(flat)
            bucket.extend(views_of(flat, layout))
        if mine is not None:
            own = torch.empty(mine.nbytes, dtype=torch.uint8, device=device)
            self._group.receive(own)
            bucket.extend(views_of(own, mine))
        _RECEIVED["bytes"] += sum(tensor_nbytes(tensor) for _, tensor in bucket)
        return bucket

    def close(self) -> None:
        pass


class BroadcastTransport:
    """A broadcast group spanning training rank 0 and the generation ranks; any placement. NCCL
    when the sender has CUDA (every receiver must then have a GPU), gloo otherwise: one code path.

    ``session.options``: ``world_size`` (1 + generation ranks; default 2), ``rank`` on each
    receiver (1..world_size-1), ``host``/``port`` and ``backend`` (:func:`broadcast_backend`)
    filled in by :meth:`prepare` on the sender, and ``skips`` on the sender (``{rank: names}``,
    the manifest's tensors a receiver does not load: :class:`~nrl_core.contracts.PartialImporter`)
    and ``slices`` (``{rank: {name: region}}``, the blocks a receiver loads of the others:
    ``sliced_import``).
    """

    name = "broadcast"

    def prepare(self, session: RefitSession) -> RefitSession:
        """The group's address: without a port given, the sender's store binds one the system
        picks and keeps it for :meth:`sender` (a port found free and bound later can be taken in
        between, and receivers that then join another refit's store wait out the timeout)."""
        import torch
        import torch.distributed as dist

        host = session.options.get("host") or _node_address()
        backend = session.options.get("backend") or broadcast_backend(torch.cuda.is_available())
        size = int(session.options.get("world_size", 2))
        port = session.options.get("port")
        if session.options.get("reuse"):  # the group formed at an earlier refit carries this one
            return session.with_options(host=host, port=port or 0, world_size=size, backend=backend)
        if not port:
            timeout = datetime.timedelta(seconds=float(session.options.get("timeout_s", 600)))
            store = dist.TCPStore(host, 0, size, True, timeout=timeout, wait_for_workers=False)
            _BOUND_STORES[session.id] = store
            port = store.port
        return session.with_options(host=host, port=port, world_size=size, backend=backend)

    def sender(self, session: RefitSession) -> TransportSender:
        return _BroadcastSender(session)

    def receiver(self, session: RefitSession) -> TransportReceiver:
        return _BroadcastReceiver(session.with_options(rank=session.options.get("rank", 1)))

    def cleanup(self, session: RefitSession) -> None:
        _BOUND_STORES.pop(session.id, None)  # a refit that failed before its group formed
