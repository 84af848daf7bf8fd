"""Shared builders for the dtensor tests: configs, batches and the tiny models (built once, cached)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from nrl_core.contracts import TokenBatch
from nrl_core.testing.tiny_models import cached_tiny_model


def make_config(family: str = "llama", **policy_overrides: Any) -> dict[str, Any]:
    """A plain validated-shape config with only the keys the worker reads."""
    policy: dict[str, Any] = {
        "model_name": str(cached_tiny_model(family, size="tiny")),
        "trust_remote_code": False,
        "seed": 42,
        "precision": "float32",
        "train_global_batch_size": 8,
        "train_micro_batch_size": 2,
        "logprob_batch_size": 4,
        "max_total_sequence_length": 64,
        "max_grad_norm": 1.0,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3, "weight_decay": 0.01, "foreach": False}},
        "scheduler": [
            {"name": "torch.optim.lr_scheduler.LinearLR", "kwargs": {"start_factor": 0.5, "end_factor": 1.0,
                                                                      "total_iters": 2}},
            {"name": "torch.optim.lr_scheduler.ConstantLR", "kwargs": {"factor": 1.0, "total_iters": 100}},
            {"milestones": [2]},
        ],
        "logprob_chunk_size": None,
        "sequence_packing": {"enabled": False, "train_mb_tokens": 128, "logprob_mb_tokens": 128,
                             "algorithm": "modified_first_fit_decreasing", "sequence_length_round": 1},
        "dynamic_batching": {"enabled": False, "train_mb_tokens": 128, "logprob_mb_tokens": 128,
                             "sequence_length_round": 1},
        "hf_config_overrides": None,
        "dtensor_config": {"enabled": True, "cpu_offload": False, "sequence_parallel": False,
                           "activation_checkpointing": False, "tensor_parallel_size": 1, "context_parallel_size": 1,
                           "custom_parallel_plan": None, "fully_parallel_save": True, "fully_parallel_load": True,
                           "async_save": False, "load_rng": False},
    }
    for key, value in policy_overrides.items():
        if isinstance(value, dict) and isinstance(policy.get(key), dict):
            policy[key] = {**policy[key], **value}
        else:
            policy[key] = value
    return {"policy": copy.deepcopy(policy)}


def make_batch(batch_size: int = 8, max_len: int = 24, min_len: int = 4, seed: int = 0, vocab: int = 512) -> TokenBatch:
    """Right-padded random sequences of varied lengths with a loss mask past a 'prompt' of 2 tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch_size,), generator=g)
    lengths[0] = max_len
    ids = torch.randint(4, vocab, (batch_size, max_len), generator=g)
    positions = torch.arange(max_len)[None, :]
    ids = torch.where(positions < lengths[:, None], ids, torch.full_like(ids, 3))
    mask = ((positions >= 2) & (positions < lengths[:, None])).float()
    return TokenBatch(input_ids=ids, input_lengths=lengths, fields={"token_mask": mask})
