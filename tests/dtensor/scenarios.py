"""Functions run on every rank of a spawned world (``run_distributed``); importable by name."""

from __future__ import annotations

import os
from typing import Any

from nrl_core.testing.distributed import gather_shards

from common import make_batch, make_config
from nrl_core.algorithms.loss import NLLLoss
from nrl_core.contracts import CheckpointOptions
from nrl_core.errors import NrlError
from nrl_backend_dtensor.worker import DTensorPolicyWorker


def fsdp_and_checkpoints(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """FSDP at dp=2: logprobs and training trajectory; sharded/consolidated/async saves and loads."""
    out: dict[str, Any] = {}
    batch = make_batch()
    w = DTensorPolicyWorker(make_config(), rank, world_size)
    out["logprobs"] = gather_shards(w.get_logprobs(batch), batch)
    out["losses"] = [w.train(batch, NLLLoss())["loss"] for _ in range(2)]
    out["logprobs_after"] = gather_shards(w.get_logprobs(batch), batch)
    w.save_checkpoint(os.path.join(root, "sharded"), CheckpointOptions())
    w.save_checkpoint(os.path.join(root, "consolidated"), CheckpointOptions(fully_parallel_save=False))
    w.save_checkpoint(os.path.join(root, "async"), CheckpointOptions(async_save=True))
    w.finalize_checkpoint()
    try:
        w.train(make_batch(batch_size=7), NLLLoss())
    except NrlError as exc:
        out["bad_batch_error"] = str(exc)

    fresh = DTensorPolicyWorker(make_config(), rank, world_size)
    for name, options in [("sharded", CheckpointOptions()),
                          ("sharded", CheckpointOptions(fully_parallel_load=False)),
                          ("consolidated", CheckpointOptions()),
                          ("consolidated", CheckpointOptions(fully_parallel_load=False)),
                          ("async", CheckpointOptions())]:
        fresh.load_checkpoint(os.path.join(root, name), options)
        out[f"loaded/{name}/{options.fully_parallel_load}"] = gather_shards(fresh.get_logprobs(batch), batch)
        out[f"step/{name}"] = fresh.train_step_count
    return out


def tensor_parallel(rank: int, world_size: int) -> dict[str, Any]:
    """TP=2 (dp=1), with and without sequence parallelism: logprobs and one training step."""
    out: dict[str, Any] = {}
    batch = make_batch()
    for sp in (False, True):
        cfg = make_config(dtensor_config={"tensor_parallel_size": 2, "sequence_parallel": sp})
        w = DTensorPolicyWorker(cfg, rank, world_size)
        out[f"sp={sp}/logprobs"] = gather_shards(w.get_logprobs(batch), batch)
        out[f"sp={sp}/loss"] = w.train(batch, NLLLoss())["loss"]
        out[f"sp={sp}/logprobs_after"] = gather_shards(w.get_logprobs(batch), batch)
    qwen = DTensorPolicyWorker(make_config("qwen3", dtensor_config={"tensor_parallel_size": 2}), rank, world_size)
    out["qwen3/logprobs"] = gather_shards(qwen.get_logprobs(batch), batch)
    return out
