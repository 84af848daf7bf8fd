"""Training-state checkpoints through Megatron-Core's ``dist_checkpointing``, honouring every knob.

* ``fully_parallel_save`` → ``FullyParallelSaveStrategyWrapper`` (data-parallel replicas split
  the writing); off: the default strategy, where each shard's first replica writes it.
* ``fully_parallel_load`` → ``FullyParallelLoadStrategyWrapper`` (replicas split reading and
  exchange); off: every rank reads what it needs.
* ``async_save`` → ``save(..., async_sharded_save=True)`` scheduled on Megatron's
  ``AsyncCallsQueue``; the write finishes in the background and is finalized (metadata and our
  marker written) by :meth:`CheckpointIO.finalize`, called before the next save and at exit.
* RNG states (Python, NumPy, torch, CUDA, and the tensor-parallel RNG tracker) are always saved,
  one object per rank; ``load_rng`` decides whether loading restores them. A checkpoint loaded at
  another data-parallel size has no RNG state for this layout: the worker leaves it out (as
  Megatron-LM does when the layout changed) and says so.
* The distributed optimizer's state is written in Megatron-LM's ``dp_reshardable`` format (each
  rank its own buffer ranges, loadable at another data-parallel size). It does not convert to or
  from the non-distributed optimizer's state: the marker records which one a checkpoint holds,
  and loading into the other is one line.
* ``save_optimizer`` false (``checkpointing.save_optimizer: false``) → the worker leaves the
  optimizer's sharded state and the scheduler out of what it saves and the marker records
  ``"optimizer": false``; loading such a checkpoint (:meth:`CheckpointIO.saved`) restores
  the weights and starts the optimizer and its schedule fresh, as NeMo RL does (``load_optim``
  off when its resume finds no optimizer state).

A checkpoint is complete when ``nrl_megatron_checkpoint.json`` exists (written last, by rank 0);
loading checks it and the model identity first, so a partial or foreign checkpoint is a one-line
:class:`NrlError` and leaves the worker untouched.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from nrl_core.api import CheckpointOptions, NrlError

MARKER = "nrl_megatron_checkpoint.json"
REQUIRED_FILES = ("common.pt", "metadata.json")  # what dist_checkpointing.save always writes


def rng_state() -> dict[str, Any]:
    """The SDK's RNG state plus Megatron's CUDA RNG tracker (its model-parallel streams)."""
    from megatron.core import tensor_parallel

    from nrl_core.api import rng_state as base_state

    return {**base_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def set_rng_state(state: Mapping[str, Any]) -> None:
    from megatron.core import tensor_parallel

    from nrl_core.api import set_rng_state as set_base

    set_base(state)
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


class CheckpointIO:
    """Save/load of one worker's model, optimizer, scheduler, step and RNG."""

    def __init__(self, identity: Mapping[str, Any], *, distributed_optimizer: bool = False) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.identity = dict(identity)
        self.distributed_optimizer = distributed_optimizer
        self.queue = AsyncCallsQueue()
        self.pending: list[str] = []

    # ------------------------------------------------------------------ save
    def save(self, path: str, options: CheckpointOptions, sharded: dict[str, Any], common: dict[str, Any]) -> None:
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        self.finalize()  # an earlier asynchronous save completes before the next one starts
        target = Path(path)
        if dist.get_rank() == 0:
            target.mkdir(parents=True, exist_ok=True)
            (target / MARKER).unlink(missing_ok=True)
        dist.barrier()
        strategy = get_default_save_sharded_strategy()
        if options.fully_parallel_save:
            strategy = FullyParallelSaveStrategyWrapper(
                strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
        state = {**sharded, **common}
        request = dist_checkpointing.save(state, str(target), sharded_strategy=strategy,
                                          async_sharded_save=options.async_save)
        if options.async_save:
            request.add_finalize_fn(lambda: self._write_marker(target, options))
            self.queue.schedule_async_request(request)
            self.pending.append(str(target))
        else:
            self._write_marker(target, options)
            dist.barrier()  # no rank may look for the marker before rank 0 has written it

    def _write_marker(self, target: Path, options: CheckpointOptions) -> None:
        from megatron.core import parallel_state

        if dist.get_rank() == 0:
            meta = {**self.identity, "options": {k: getattr(options, k) for k in
                                                 ("fully_parallel_save", "async_save")},
                    "optimizer": options.save_optimizer, "distributed_optimizer": self.distributed_optimizer,
                    "dp": parallel_state.get_data_parallel_world_size(with_context_parallel=True)}
            tmp = target / (MARKER + ".tmp")
            tmp.write_text(json.dumps(meta, indent=1))
            os.replace(tmp, target / MARKER)

    def finalize(self) -> None:
        """Block until every asynchronous save has been written and finalized. Collective."""
        if self.pending:
            self.queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
            self.pending.clear()
            dist.barrier()

    # ------------------------------------------------------------------ load
    def check(self, path: str) -> dict[str, Any]:
        """One-line errors for a missing, incomplete or foreign checkpoint; else its marker."""
        marker = Path(path) / MARKER
        if not Path(path).is_dir():
            raise NrlError(f"checkpoint {path} does not exist")
        if not marker.is_file():
            raise NrlError(f"checkpoint {path} is incomplete (no {MARKER}); it was interrupted or is still "
                           "being written asynchronously")
        meta = json.loads(marker.read_text())
        for name in REQUIRED_FILES:  # Megatron's own message for these is not about the file
            if not (Path(path) / name).is_file():
                raise NrlError(f"checkpoint {path} is damaged: Megatron's '{name}' is missing")
        for key, value in self.identity.items():
            if meta.get(key) != value:
                raise NrlError(f"checkpoint {path} is from another model or layout ({key}: {meta.get(key)!r}, "
                               f"this run: {value!r})")
        saved = meta.get("distributed_optimizer")  # None: written before the marker recorded it
        if meta.get("optimizer", True) is not False and saved is not None and saved != self.distributed_optimizer:
            raise NrlError(f"checkpoint {path} holds {'the distributed' if saved else 'the non-distributed'} "
                           f"optimizer's state and this run uses the other; set policy.megatron_cfg.optimizer."
                           f"use_distributed_optimizer: {str(saved).lower()} to resume from it (Megatron's two "
                           f"formats do not convert)")
        return meta

    def saved(self, path: str) -> tuple[bool, int | None]:
        """Whether checkpoint ``path`` holds optimizer and scheduler state (those from before
        ``save_optimizer`` existed all do), and the data-parallel size it was saved at (None: from
        before it was recorded); checked first. Collective: finishes a pending save."""
        self.finalize()
        meta = self.check(path)
        return meta.get("optimizer", True) is not False, meta.get("dp")

    def load(self, path: str, options: CheckpointOptions, sharded: dict[str, Any]) -> dict[str, Any]:
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

        self.finalize()
        self.check(path)
        strategy = get_default_load_sharded_strategy(path)
        if options.fully_parallel_load:
            strategy = FullyParallelLoadStrategyWrapper(
                strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        from nrl_backend_megatron.safe_load import refusal, safe_dist_checkpointing, start_load

        safe_dist_checkpointing()
        start_load(path)
        try:
            return dist_checkpointing.load(sharded, path, sharded_strategy=strategy)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - surfaced as one line
            from nrl_core.api import describe_failure

            if refusal() is not None:  # a file that would run code: named, and nothing of it ran
                raise refusal() from None
            raise NrlError(f"cannot load checkpoint {path}: {describe_failure(exc)}; it is truncated or "
                           f"corrupt") from None


def rng_sharded_object(key: str, state: Any) -> Any:
    """The RNG state of this rank as a ``ShardedObject`` indexed by (pp, tp, dp) rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
             ps.get_data_parallel_world_size(with_context_parallel=True))
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
              ps.get_data_parallel_rank(with_context_parallel=True))
    return ShardedObject(key, state, shape, offset, replica_id=0)


def register_exit_finalizer(method: Callable[[], None]) -> None:
    """Run a worker's bound ``method`` at exit if the worker is still alive then. Held weakly: the
    exit registry must not keep a dropped worker, and the device memory it holds, alive."""
    import atexit
    import weakref

    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def finalize() -> None:
        bound = ref()
        if bound is not None:
            bound()

    atexit.register(finalize)
