"""Functions run on every rank of a spawned world (``run_distributed``); importable by name."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from common import make_batch, make_config

from nrl_backend_dtensor.worker import DTensorPolicyWorker
from nrl_core.algorithms.loss import NLLLoss
from nrl_core.contracts import CheckpointOptions
from nrl_core.errors import NrlError
from nrl_core.testing.distributed import gather_shards


def fsdp_and_checkpoints(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """FSDP at dp=2: logprobs and training trajectory; sharded/consolidated/async saves and loads."""
    out: dict[str, Any] = {}
    batch = make_batch()
    w = DTensorPolicyWorker(make_config(), rank, world_size)
    out["load"] = dataclasses.asdict(w.load_stats)
    out["logprobs"] = gather_shards(w.get_logprobs(batch), batch)
    out["losses"] = [w.train(batch, NLLLoss())["loss"] for _ in range(2)]
    out["logprobs_after"] = gather_shards(w.get_logprobs(batch), batch)
    w.save_checkpoint(os.path.join(root, "sharded"), CheckpointOptions())
    w.save_checkpoint(os.path.join(root, "consolidated"), CheckpointOptions(fully_parallel_save=False))
    w.save_checkpoint(os.path.join(root, "async"), CheckpointOptions(async_save=True))
    w.save_checkpoint(os.path.join(root, "lean"), CheckpointOptions(async_save=True, save_optimizer=False))
    w.save_checkpoint(os.path.join(root, "safetensors"), CheckpointOptions(async_save=True,
                                                                           model_save_format="safetensors"))
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
                          ("async", CheckpointOptions()),
                          ("lean", CheckpointOptions()),  # no optimizer state: the optimizer starts fresh
                          ("lean", CheckpointOptions(fully_parallel_load=False)),
                          ("safetensors", CheckpointOptions()),
                          ("safetensors", CheckpointOptions(fully_parallel_load=False))]:
        fresh.load_checkpoint(os.path.join(root, name), options)
        out[f"loaded/{name}/{options.fully_parallel_load}"] = gather_shards(fresh.get_logprobs(batch), batch)
        out[f"step/{name}"] = fresh.step
        out[f"optimizer_state/{name}"] = len(fresh.optimizer.state)
    return out


def tensor_parallel(rank: int, world_size: int) -> dict[str, Any]:
    """TP=2 (dp=1), with and without sequence parallelism: logprobs and one training step."""
    out: dict[str, Any] = {}
    batch = make_batch()
    for sp in (False, True):
        cfg = make_config(dtensor_config={"tensor_parallel_size": 2, "sequence_parallel": sp})
        w = DTensorPolicyWorker(cfg, rank, world_size)
        out[f"sp={sp}/load"] = dataclasses.asdict(w.load_stats)
        out[f"sp={sp}/logprobs"] = gather_shards(w.get_logprobs(batch), batch)
        out[f"sp={sp}/loss"] = w.train(batch, NLLLoss())["loss"]
        out[f"sp={sp}/logprobs_after"] = gather_shards(w.get_logprobs(batch), batch)
    qwen = DTensorPolicyWorker(make_config("qwen3", dtensor_config={"tensor_parallel_size": 2}), rank, world_size)
    out["qwen3/logprobs"] = gather_shards(qwen.get_logprobs(batch), batch)
    return out


#: ClippedPGLoss configurations the data-parallel loss test trains with, one optimizer step each.
LOSS_VARIANTS: dict[str, dict[str, Any]] = {
    "ppo+kl": {"reference_policy_kl_penalty": 0.1, "ratio_clip_c": 3.0},
    "gspo+tis": {"sequence_level_importance_ratios": True, "token_level_loss": False,
                 "use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis",
                 "truncated_importance_sampling_ratio": 1.02, "reference_policy_kl_penalty": 0.05},
    "cispo+icepop": {"use_cispo": True, "use_importance_sampling_correction": True,
                     "truncated_importance_sampling_type": "icepop", "truncated_importance_sampling_ratio": 1.01,
                     "truncated_importance_sampling_ratio_min": 0.99},
    "reinforce+seq-mask-tis": {"disable_ppo_ratio": True, "token_level_loss": False,
                               "use_importance_sampling_correction": True,
                               "truncated_importance_sampling_type": "seq-mask-tis",
                               "truncated_importance_sampling_ratio": 1.002,
                               "truncated_importance_sampling_ratio_min": 0.998},
}


def rl_batch(logprobs: Any) -> Any:
    """``make_batch`` with GRPO's fields around ``logprobs`` (the current policy's): previous,
    engine and reference logprobs a little off, advantages of both signs, one sequence dropped by
    its sample mask."""
    import torch

    batch = make_batch()
    g = torch.Generator().manual_seed(1)
    mask = batch.fields["token_mask"]
    noise = lambda scale: (torch.randn(logprobs.shape, generator=g, dtype=torch.float64) * scale).float()
    batch.fields.update(
        prev_logprobs=(logprobs + noise(0.01)) * mask, generation_logprobs=(logprobs + noise(0.02)) * mask,
        reference_logprobs=(logprobs + noise(0.1)) * mask,
        advantages=torch.tensor([1.0, -0.5, 2.0, -1.0, 0.3, -2.0, 0.7, -0.1])[:, None] * mask,
        sample_mask=torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]))
    return batch


def loss_variants(rank: int, world_size: int, packing: bool) -> dict[str, Any]:
    """One optimizer step per ``LOSS_VARIANTS`` entry at this world size: the logprobs before each
    step, the batch and the step's reported metrics, for a direct computation in the test."""
    from nrl_core.algorithms.loss import ClippedPGLoss

    config = make_config(sequence_packing={"enabled": packing, "train_mb_tokens": 48, "logprob_mb_tokens": 64})
    worker = DTensorPolicyWorker(config, rank, world_size)
    out: dict[str, Any] = {}
    for name, keys in LOSS_VARIANTS.items():
        logprobs = gather_shards(worker.get_logprobs(make_batch()), make_batch())
        batch = rl_batch(logprobs)
        out[name] = {"logprobs": logprobs, "batch": batch, "metrics": worker.train(batch, ClippedPGLoss(**keys))}
    return out


def lora_config() -> dict[str, Any]:
    from nrl_backend_dtensor.schema import LORA_SCHEMA

    return make_config(dtensor_config={"lora_cfg": LORA_SCHEMA.validate({"enabled": True, "dim": 4, "alpha": 8},
                                                                       "policy.dtensor_config.lora_cfg")})


def lora_data_parallel(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """LoRA with FSDP at dp=2: the training trajectory, and an adapter-only checkpoint saved at
    dp=2 (sharded and consolidated) loaded by a fresh worker."""
    batch = make_batch()
    w = DTensorPolicyWorker(lora_config(), rank, world_size)
    out: dict[str, Any] = {"losses": [w.train(batch, NLLLoss())["loss"] for _ in range(2)],
                           "logprobs_after": gather_shards(w.get_logprobs(batch), batch),
                           "reference": gather_shards(w.get_reference_logprobs(batch), batch)}
    for name, options in (("sharded", CheckpointOptions()), ("consolidated", CheckpointOptions(fully_parallel_save=False))):
        w.save_checkpoint(os.path.join(root, name), options)
        fresh = DTensorPolicyWorker(lora_config(), rank, world_size)
        fresh.load_checkpoint(os.path.join(root, name), CheckpointOptions())
        out[f"loaded/{name}"] = gather_shards(fresh.get_logprobs(batch), batch)
    return out


class SquaredValueLoss:
    """The mean squared value over valid tokens: a value head's loss for these tests (``reads_values``)."""

    reads_values = True

    def __call__(self, values, batch, *, global_valid_tokens, global_valid_seqs):
        mask = batch.fields["token_mask"].to(values)
        loss = ((values[:, :mask.shape[1]] - 1.0).square() * mask).sum() / max(global_valid_tokens, 1.0)
        return loss, {"loss": float(loss.detach())}


def value_config(**dtensor: Any) -> dict[str, Any]:
    return make_config(reward_model_cfg={"enabled": True, "reward_model_type": "regression"},
                       dtensor_config=dtensor)


def value_head(rank: int, world_size: int) -> dict[str, Any]:
    """A regression value head at TP=2 (with and without sequence parallelism) and at DP=2: the
    values, one training step's loss and the values after it."""
    out: dict[str, Any] = {}
    batch = make_batch()
    for name, dtensor in (("tp", {"tensor_parallel_size": 2}),
                          ("tp+sp", {"tensor_parallel_size": 2, "sequence_parallel": True}), ("dp", {})):
        torch.manual_seed(0)
        w = DTensorPolicyWorker(value_config(**dtensor), rank, world_size)
        out[f"{name}/values"] = gather_shards(w.get_values(batch), batch)
        out[f"{name}/loss"] = w.train(batch, SquaredValueLoss())["loss"]
        out[f"{name}/values_after"] = gather_shards(w.get_values(batch), batch)
    return out
