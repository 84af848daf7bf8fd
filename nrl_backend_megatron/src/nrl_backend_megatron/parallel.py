"""Process groups: torch.distributed (when nobody started it) and Megatron's ``parallel_state``.

Layout checks run before any group is created, so an impossible layout is a one-line
:class:`ConfigError` naming the key, never a hang or an assertion deep inside Megatron-Core.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch.distributed as dist

from nrl_backend_megatron.model import ParallelLayout
from nrl_core.api import ConfigError, process_group_backend

KEY = "policy.megatron_cfg"


def check_layout(layout: ParallelLayout, world_size: int, hf_config: Any | None) -> None:
    """Reject a parallel layout the model or the world cannot divide into, in one line (the model's
    part only when its ``hf_config`` is known)."""
    tp, pp, cp = layout.tp, layout.pp, layout.cp
    for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                        ("context_parallel_size", cp)):
        if value < 1:
            raise ConfigError(f"{KEY}.{name}", f"must be at least 1, got {value}")
    if world_size % (tp * pp * cp):
        raise ConfigError(f"{KEY}.tensor_model_parallel_size",
                          f"tp*pp*cp = {tp}*{pp}*{cp} does not divide the world size {world_size}")
    if cp > 1:  # refused also with TE: the batches are not split per CP rank, so attention would be wrong
        raise ConfigError(f"{KEY}.context_parallel_size",
                          f"{cp} needs Transformer Engine and CUDA, and sequences split per context-parallel rank, "
                          "which this backend does not do yet; set it to 1")
    if layout.sequence_parallel and tp == 1:
        raise ConfigError(f"{KEY}.sequence_parallel", "needs tensor_model_parallel_size > 1; set it to false")
    # expert-parallel ranks are carved out of one pipeline stage's data- and tensor-parallel ranks
    if layout.ep < 1 or (world_size // pp) % layout.ep:
        raise ConfigError(f"{KEY}.expert_model_parallel_size",
                          f"{layout.ep} does not divide the {world_size // pp} ranks of a pipeline stage "
                          f"(world size {world_size} / pipeline_model_parallel_size {pp})")
    if hf_config is None:
        return
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ConfigError(f"{KEY}.tensor_model_parallel_size", f"{tp} does not divide the {heads} attention heads")
    if groups % tp:
        raise ConfigError(f"{KEY}.tensor_model_parallel_size", f"{tp} does not divide the {groups} key/value heads")
    if hf_config.vocab_size % tp:
        raise ConfigError(f"{KEY}.tensor_model_parallel_size",
                          f"{tp} does not divide the vocabulary size {hf_config.vocab_size}")
    if hf_config.num_hidden_layers % pp:
        raise ConfigError(f"{KEY}.pipeline_model_parallel_size",
                          f"{pp} does not divide the {hf_config.num_hidden_layers} layers")


def _timeout(minutes: int | None) -> datetime.timedelta | None:
    return None if minutes is None else datetime.timedelta(minutes=minutes)


def ensure_process_group(rank: int, world_size: int, timeout_minutes: int | None) -> bool:
    """Start torch.distributed when nobody has (a world of ``world_size``: gloo without CUDA,
    ``cpu:gloo,cuda:nccl`` with it, since checkpoints and object collectives carry CPU tensors).

    Returns True when this call started it. ``timeout_minutes`` (``distributed_timeout_minutes``)
    becomes the process group's timeout; unset keeps torch's default.
    """
    if dist.is_initialized():
        return False
    if world_size > 1 and "MASTER_ADDR" not in os.environ:
        raise RuntimeError("torch.distributed is not initialised and MASTER_ADDR is unset for a world of "
                           f"{world_size}; start the worker under torchrun or initialise the process group")
    if world_size == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    kwargs: dict[str, Any] = {"backend": process_group_backend(), "rank": rank, "world_size": world_size}
    if timeout_minutes is not None:
        kwargs["timeout"] = _timeout(timeout_minutes)
    dist.init_process_group(**kwargs)
    return True


def init_model_parallel(layout: ParallelLayout, timeout_minutes: int | None) -> None:
    """(Re)create Megatron's parallel groups for ``layout``; the timeout also applies to them."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    kwargs: dict[str, Any] = {}
    if timeout_minutes is not None:
        kwargs["distributed_timeout_minutes"] = timeout_minutes
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=1,
        **kwargs)
