"""Checkpoint I/O of the dtensor worker through ``torch.distributed.checkpoint`` (DCP).

Layout of a checkpoint directory::

    model_optim/           DCP shards of model + optimizer      (fully_parallel_save)
    consolidated.pt        one file of full tensors from rank 0 (fully_parallel_save: false)
    model/                 safetensors shards of the weights under their Hugging Face names, and
    optim/                 DCP shards of the optimizer          (model_save_format: safetensors)
    trainer_state.pt       step and scheduler state (rank 0)
    rng/rank{r}.pt         torch/CUDA/python/numpy RNG states of each rank
    nrl_checkpoint.json    written last, once every file is complete: format, architecture,
                           parameter shapes and every file's size

``nrl_checkpoint.json`` is the commit marker: a directory without it is incomplete, a file whose
size differs from the one recorded is truncated, and recorded shapes that differ from the model's
mean another architecture. Loading checks all of that, then reads into *copies* of the state and
only copies into the live model and optimizer once everything has been read, so a failed load
leaves the worker untouched.

With ``CheckpointOptions.save_optimizer`` false (``checkpointing.save_optimizer: false``) the shards
and ``consolidated.pt`` hold the model only, ``trainer_state.pt`` the step only, and the marker says
``"optimizer": false``; loading such a checkpoint restores the weights and starts the optimizer and
its learning-rate schedule fresh, as NeMo RL does (its resume finds no optimizer directory).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from nrl_backend_dtensor.safe_load import dcp_load, load_file
from nrl_backend_dtensor.sharded_load import tied_parameters
from nrl_core.api import (
    CheckpointOptions,
    NrlError,
    broadcast,
    first_failure,
    main_group_timeout,
    rng_state,
    set_rng_state,
)

logger = logging.getLogger(__name__)

MARKER = "nrl_checkpoint.json"
SHARDED_DIR = "model_optim"
SAFETENSORS_DIR = "model"  # NeMo RL's safetensors layout: weights by HF name, the optimizer apart
OPTIM_DIR = "optim"
CONSOLIDATED = "consolidated.pt"
TRAINER_STATE = "trainer_state.pt"
FORMAT_VERSION = 1


@dataclass(kw_only=True)
class TrainState:
    """What the checkpoint code needs from a worker (kept narrow so it is testable on its own)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    get_step: Callable[[], int]
    set_step: Callable[[int], None]
    architecture: dict[str, Any]
    param_shapes: dict[str, list[int]]
    async_group: dist.ProcessGroup | None = None
    frozen_in_checkpoints: bool = True  # False with LoRA: only the adapters (and their optimizer state) are saved
    base_model: dict[str, Any] | None = None  # with LoRA: the base the adapters belong to (nrl_core.sdk.base_model_identity)


@dataclass
class _Pending:
    path: str
    futures: list[Future] = field(default_factory=list)
    marker: dict[str, Any] = field(default_factory=dict)


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree


def _file_sizes(root: str) -> dict[str, int]:
    sizes = {}
    for base, _, files in os.walk(root):
        for name in files:
            if name == MARKER:
                continue
            full = os.path.join(base, name)
            sizes[os.path.relpath(full, root)] = os.path.getsize(full)
    return sizes


class CheckpointIO:
    """Saves and loads one worker's state; holds the pending asynchronous save, if any."""

    def __init__(self, state: TrainState) -> None:
        self.state = state
        self._pending: _Pending | None = None
        self._optim_group: dist.ProcessGroup | None = None
        # what a fresh optimizer and schedule look like (built before any step): a checkpoint
        # without optimizer state puts these back
        self._fresh_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                              for g in state.optimizer.param_groups]
        self._fresh_scheduler = copy.deepcopy(state.scheduler.state_dict())

    # ------------------------------------------------------------------ save

    def _options(self, **kwargs: Any) -> StateDictOptions:
        """Torch's state-dict options, leaving out frozen parameters (a LoRA run's base weights,
        which a load then leaves as they are)."""
        frozen = self.state.frozen_in_checkpoints
        return StateDictOptions(ignore_frozen_params=not frozen, strict=frozen, **kwargs)

    def _live(self, options: StateDictOptions, with_optim: bool) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}`` of the live objects, or ``{"model": ...}`` alone. The
        model alone never asks torch for the optimizer's state dict, which would fill an empty
        (fresh) optimizer's state with a dummy step."""
        if not with_optim:
            return {"model": get_model_state_dict(self.state.model, options=options)}
        msd, osd = get_state_dict(self.state.model, self.state.optimizer, options=options)
        return {"model": msd, "optim": osd}

    def save(self, path: str, options: CheckpointOptions) -> None:
        """Save everything under ``path`` (collective). With ``async_save`` return once the write
        is scheduled; it completes at the next save, load or :meth:`finalize`."""
        self.finalize()
        rank = dist.get_rank()
        os.makedirs(os.path.join(path, "rng"), exist_ok=True)
        pending = _Pending(path=path)
        with_optim = options.save_optimizer
        if options.model_save_format == "safetensors":
            self._save_safetensors(path, pending, options, with_optim)
            fmt = "safetensors"
        elif options.fully_parallel_save:
            target = self._live(self._options(), with_optim)
            if options.async_save:
                pending.futures.append(dcp.async_save(target, checkpoint_id=os.path.join(path, SHARDED_DIR),
                                                      process_group=self.state.async_group))
            else:
                dcp.save(target, checkpoint_id=os.path.join(path, SHARDED_DIR))
            fmt = "sharded"
        else:
            full = self._live(self._options(full_state_dict=True, cpu_offload=True), with_optim)
            if rank == 0:
                write = lambda: torch.save(full, os.path.join(path, CONSOLIDATED))  # noqa: E731
                pending.futures.append(_in_thread(write) if options.async_save else _done(write()))
            fmt = "consolidated"
        torch.save(rng_state(), os.path.join(path, "rng", f"rank{rank}.pt"))
        if rank == 0:
            trainer = {"step": self.state.get_step()}
            if with_optim:  # the schedule goes with the optimizer, as in NeMo RL
                trainer["scheduler"] = self.state.scheduler.state_dict()
            torch.save(trainer, os.path.join(path, TRAINER_STATE))
        pending.marker = {"format": fmt, "format_version": FORMAT_VERSION, "step": self.state.get_step(),
                          "optimizer": with_optim,
                          "world_size": dist.get_world_size(), "architecture": self.state.architecture,
                          "param_shapes": self.state.param_shapes, "base_model": self.state.base_model}
        self._pending = pending
        if not options.async_save:
            self.finalize()

    def _save_safetensors(self, path: str, pending: _Pending, options: CheckpointOptions, with_optim: bool) -> None:
        """Every rank writes its shards of the weights as safetensors under their HF names (torch's
        Hugging Face storage writer), and of the optimizer as DCP shards."""
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        live = self._live(self._options(), with_optim)
        writes = [(_hf_names(live["model"], tied_parameters(self.state.model)), {"storage_writer": HuggingFaceStorageWriter(os.path.join(path, SAFETENSORS_DIR),
                                                                              save_distributed=True)},
                   self.state.async_group)]
        if with_optim:
            writes.append(({"optim": live["optim"]}, {"checkpoint_id": os.path.join(path, OPTIM_DIR)},
                           self._second_async_group()))
        for state, where, group in writes:
            if options.async_save:  # two writes in flight at once: each on a group of its own
                pending.futures.append(dcp.async_save(state, process_group=group, **where))
            else:
                dcp.save(state, **where)

    def _second_async_group(self) -> dist.ProcessGroup | None:
        """A gloo group for the optimizer's asynchronous write beside the weights' (collective,
        made at the first such save): two writes sharing one group interleave their collectives."""
        if self.state.async_group is None:
            return None
        if self._optim_group is None:
            self._optim_group = dist.new_group(backend="gloo", timeout=main_group_timeout())
        return self._optim_group

    def finalize(self) -> None:
        """Wait for the pending save on every rank, then commit it (rank 0 writes the marker).
        Collective when a save is pending."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        for future in pending.futures:
            future.result()
        dist.barrier()
        if dist.get_rank() == 0:
            marker = dict(pending.marker, files=_file_sizes(pending.path))
            tmp = os.path.join(pending.path, MARKER + ".tmp")
            with open(tmp, "w") as f:
                json.dump(marker, f, indent=1)
            os.replace(tmp, os.path.join(pending.path, MARKER))
        dist.barrier()

    # ------------------------------------------------------------------ load

    def validate(self, path: str) -> dict[str, Any]:
        """The checkpoint's marker after checking completeness, sizes and architecture."""
        if not os.path.isdir(path):
            raise NrlError(f"checkpoint directory '{path}' does not exist")
        marker_path = os.path.join(path, MARKER)
        if not os.path.exists(marker_path):
            raise NrlError(f"checkpoint '{path}' is incomplete or not a dtensor checkpoint (no {MARKER}); "
                           f"the save may have been interrupted")
        try:
            with open(marker_path) as f:
                marker = json.load(f)
        except (OSError, ValueError):
            raise NrlError(f"checkpoint '{path}' has an unreadable {MARKER}; the save may have been interrupted") from None
        for rel, size in marker.get("files", {}).items():
            full = os.path.join(path, rel)
            if not os.path.exists(full):
                raise NrlError(f"checkpoint '{path}' is truncated: file '{rel}' is missing")
            if os.path.getsize(full) != size:
                raise NrlError(f"checkpoint '{path}' is truncated: file '{rel}' has {os.path.getsize(full)} bytes, "
                               f"{size} were written")
        saved_base, base = marker.get("base_model"), self.state.base_model
        if saved_base != base:
            if base is None or saved_base is None:
                raise NrlError(f"checkpoint '{path}' is {'a LoRA' if saved_base else 'a full-weight'} checkpoint and this "
                               f"run {'trains LoRA adapters' if base else 'trains full weights'}; set "
                               "policy.dtensor_config.lora_cfg.enabled as the run that saved it did")
            raise NrlError(f"checkpoint '{path}' holds LoRA adapters of another base model ({saved_base.get('model')}, "
                           f"weights {saved_base.get('checksum')}) than policy.model_name ({base.get('model')}, weights "
                           f"{base.get('checksum')}); resume on the base it was trained from")
        theirs, ours = marker.get("param_shapes", {}), self.state.param_shapes
        arch = marker.get("architecture", {}).get("model_type")
        if theirs != ours:
            diff = sorted(set(theirs) ^ set(ours)) or [k for k in ours if theirs[k] != ours[k]]
            name = diff[0]
            raise NrlError(f"checkpoint '{path}' is from another architecture ({arch}): parameter '{name}' has shape "
                           f"{theirs.get(name, 'missing')} there and {ours.get(name, 'missing')} in this model")
        return marker

    def load(self, path: str, options: CheckpointOptions) -> None:
        """Load ``path`` into the worker (collective). Raises :class:`NrlError` leaving it unchanged.
        A checkpoint saved without optimizer state (whatever ``options`` says now) restores the
        weights and step and starts the optimizer and its schedule fresh."""
        self.finalize()
        marker = self.validate(path)
        with_optim = marker.get("optimizer", True) is not False
        if options.load_rng and not os.path.exists(os.path.join(path, "rng", f"rank{dist.get_rank()}.pt")):
            raise NrlError(f"checkpoint '{path}' has no RNG state for rank {dist.get_rank()} (saved at world size "
                           f"{marker.get('world_size')}); resume at the same world size or set load_rng: false")
        try:
            if options.fully_parallel_load:
                model_sd, optim_sd, sd_options = self._read_every_rank(path, marker["format"], with_optim)
            else:
                model_sd, optim_sd, sd_options = self._read_rank0_broadcast(path, marker["format"], with_optim)
            trainer = load_file(os.path.join(path, TRAINER_STATE))
            rng = load_file(os.path.join(path, "rng", f"rank{dist.get_rank()}.pt")) if options.load_rng else None
        except NrlError:
            raise
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP/pickle errors become one line
            if isinstance(first_failure(exc), NrlError):
                raise first_failure(exc) from None
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise NrlError(f"checkpoint '{path}' could not be read ({type(exc).__name__}: {first[:200]}); "
                           f"it is truncated or corrupt") from None
        # Everything is read: only now touch the live objects.
        if with_optim:
            set_state_dict(self.state.model, self.state.optimizer, model_state_dict=model_sd,
                           optim_state_dict=optim_sd, options=sd_options)
            self.state.scheduler.load_state_dict(trainer["scheduler"])
        else:
            set_model_state_dict(self.state.model, model_sd, options=sd_options)
            self._fresh_optimizer()
            if dist.get_rank() == 0:
                logger.info("checkpoint %s holds no optimizer state (saved with checkpointing.save_optimizer: "
                            "false): the optimizer and its learning-rate schedule start fresh", path)
        self.state.set_step(int(trainer["step"]))
        if rng is not None:
            set_rng_state(rng)

    def _fresh_optimizer(self) -> None:
        """The optimizer and scheduler as the worker built them: no state (Adam's moments and step
        come back at the next step), the first learning rate, the schedule at its start."""
        self.state.optimizer.state.clear()
        for group, fresh in zip(self.state.optimizer.param_groups, self._fresh_groups):
            group.update(copy.deepcopy(fresh))
        self.state.scheduler.load_state_dict(copy.deepcopy(self._fresh_scheduler))

    def _read_every_rank(self, path: str, fmt: str, with_optim: bool = True) -> tuple[Any, Any, StateDictOptions]:
        if fmt == "safetensors":
            staged = _clone(self._live(self._options(), with_optim))
            self._read_safetensors(path, staged, no_dist=False)
            return staged["model"], staged.get("optim"), self._options()
        if fmt == "sharded":
            staged = _clone(self._live(self._options(), with_optim))
            dcp_load(staged, os.path.join(path, SHARDED_DIR))
            return staged["model"], staged.get("optim"), self._options()
        full = load_file(os.path.join(path, CONSOLIDATED), map_location="cpu")
        return self._shard_like_live(full["model"], full["optim"] if with_optim else None)

    def _read_safetensors(self, path: str, staged: dict[str, Any], *, no_dist: bool) -> None:
        """The weights from safetensors (a format that holds tensors only: nothing in it runs),
        the optimizer through the safe DCP reader."""
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        ties = tied_parameters(self.state.model)
        dcp.load(_hf_names(staged["model"], ties),
                 storage_reader=HuggingFaceStorageReader(os.path.join(path, SAFETENSORS_DIR)), no_dist=no_dist)
        for name, source in ties.items():  # written once, under its first name
            if source in staged["model"]:  # else frozen (LoRA): neither name was written, the live value stays
                staged["model"][name] = staged["model"][source]
        if "optim" in staged:
            optim = {"optim": staged["optim"]}
            dcp_load(optim, os.path.join(path, OPTIM_DIR), no_dist=no_dist)
            staged["optim"] = optim["optim"]

    def _shard_like_live(self, model_sd: Any, optim_sd: Any) -> tuple[Any, Any, StateDictOptions]:
        """Full tensors (present on every rank) cut into this rank's shards of the live layout
        (``optim_sd`` None: the model alone).

        Why not ``set_state_dict(full_state_dict=True)``: it assigns new parameter objects, which
        leaves the optimizer pointing at the old ones; a sharded load copies in place.
        """
        live = self._live(self._options(), optim_sd is not None)
        optim = _shard_like(optim_sd, live["optim"]) if optim_sd is not None else None
        return _shard_like(model_sd, live["model"]), optim, self._options()

    def _read_rank0_broadcast(self, path: str, fmt: str, with_optim: bool = True) -> tuple[Any, Any, StateDictOptions]:
        rank0 = dist.get_rank() == 0
        error: list[Any] = [None]
        model_sd: Any = {}
        optim_sd: Any = {}
        if fmt in ("sharded", "safetensors"):
            # rank 0 reads the shards of every rank into full-size tensors, without collectives
            skeleton = self._live(self._options(full_state_dict=True, cpu_offload=True), with_optim)
        if rank0:
            try:
                if fmt in ("sharded", "safetensors"):
                    staged = _clone(skeleton)
                    if fmt == "sharded":
                        dcp_load(staged, os.path.join(path, SHARDED_DIR), no_dist=True)
                    else:
                        self._read_safetensors(path, staged, no_dist=True)
                    model_sd, optim_sd = staged["model"], staged.get("optim")
                else:
                    full = load_file(os.path.join(path, CONSOLIDATED), map_location="cpu")
                    model_sd, optim_sd = full["model"], full["optim"] if with_optim else None
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - shared with the other ranks
                if isinstance(first_failure(exc), NrlError):
                    error[0] = first_failure(exc)
                else:
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    error[0] = f"{type(exc).__name__}: {first[:200]}"
        dist.broadcast_object_list(error, src=0)
        if isinstance(error[0], NrlError):
            raise error[0]
        if error[0] is not None:
            raise NrlError(f"checkpoint '{path}' could not be read on rank 0 ({error[0]}); it is truncated or corrupt")
        model_sd, optim_sd = broadcast_tree([model_sd, optim_sd] if rank0 else None)
        return self._shard_like_live(model_sd, optim_sd)


def _hf_names(model_sd: dict[str, Any], ties: dict[str, str]) -> dict[str, Any]:
    """The same tensors keyed by their Hugging Face names: the worker's module holds the HF model
    as ``hf``, and the safetensors files name what ``from_pretrained`` would, a tied weight once
    (as ``save_pretrained`` writes it)."""
    return {key.removeprefix("hf."): value for key, value in model_sd.items() if key not in ties}


def _shard_like(full: Any, live: Any, where: str = "") -> Any:
    if isinstance(live, DTensor):
        if not isinstance(full, torch.Tensor) or tuple(full.shape) != tuple(live.shape):
            raise NrlError(f"checkpoint entry '{where}' does not match the model (shape "
                           f"{getattr(full, 'shape', None)} vs {tuple(live.shape)})")
        return distribute_tensor(full.to(live.device, live.dtype), live.device_mesh, live.placements,
                                 src_data_rank=None)
    if isinstance(live, dict) and isinstance(full, dict):
        if where.endswith("param_groups") or not live:
            return full
        missing = [k for k in live if k not in full]
        if missing:
            raise NrlError(f"checkpoint lacks '{where + '.' if where else ''}{missing[0]}' that the model has")
        return {k: _shard_like(full[k], v, f"{where}.{k}" if where else str(k)) for k, v in live.items()}
    if isinstance(live, torch.Tensor) and isinstance(full, torch.Tensor):
        return full.to(live.device)
    return full


class _TensorSlot:
    def __init__(self, shape: torch.Size, dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype


def broadcast_tree(tree: Any) -> Any:
    """Send rank 0's nested dict/list of tensors and plain values to every rank: the structure
    with tensor placeholders as one object, then each tensor with ``dist.broadcast``.

    Why not ``set_state_dict(broadcast_from_rank0=True)``: with optimizer state it expects every
    rank to already hold a matching skeleton, which a fresh worker does not have.
    """
    tensors: list[torch.Tensor] = []

    def strip(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            tensors.append(node)
            return _TensorSlot(node.shape, node.dtype)
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(strip(v) for v in node)
        return node

    box = [strip(tree) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    received = iter(tensors)

    def fill(node: Any) -> Any:
        if isinstance(node, _TensorSlot):
            t = next(received).cpu() if dist.get_rank() == 0 else torch.empty(node.shape, dtype=node.dtype)
            return broadcast(t, src=0)
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(fill(v) for v in node)
        return node

    return fill(box[0])


def _in_thread(fn: Callable[[], Any]) -> Future:
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future

