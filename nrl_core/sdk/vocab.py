"""Next-token distributions beyond the sampled token: the top-k of a model's next-token
distribution and its logprobs at given token ids, from logits that may be split over the
vocabulary between tensor-parallel ranks.

Distillation needs both: the teacher's top-k at every position, and the student's logprobs at the
teacher's ids, with gradients. Under tensor parallelism no rank gathers the full vocabulary: the
normaliser is reduced over the group (a max, then a sum of exponentials), each rank takes the
top-k of its own shard and only ``k`` candidates per rank cross to the others.

Alignment is :class:`~nrl_core.contracts.TokenBatch`'s: position ``t`` describes the distribution
of token ``t`` (computed from the logits at ``t - 1``); position 0 holds zeros.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nrl_core.device import all_gather, all_reduce

__all__ = ["next_token_logprobs_at", "next_token_topk"]


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: every rank computes the same loss from the
    reduced value, so each rank's share receives the gradient once, on that rank."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        return all_reduce(tensor.clone(), group=group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def _split(group: Any) -> tuple[int, int]:
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _log_normaliser(logits: torch.Tensor, group: Any) -> torch.Tensor:
    """``logsumexp`` over the whole vocabulary of ``logits``' last dimension (a shard of it per rank)."""
    _, size = _split(group)
    if size == 1:
        return torch.logsumexp(logits, dim=-1)
    peak = logits.detach().amax(dim=-1)
    all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    total = _SumOverGroup.apply((logits - peak.unsqueeze(-1)).exp().sum(dim=-1), group)
    return peak + total.log()


def _shifted(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The logits that predict tokens ``1..S-1``, in float32, divided by ``temperature``."""
    body = logits[:, :-1].float()
    return body / temperature if temperature != 1.0 else body


def _aligned(body: torch.Tensor) -> torch.Tensor:
    return torch.cat([body.new_zeros((body.shape[0], 1, *body.shape[2:])), body], dim=1)


def next_token_logprobs_at(logits: torch.Tensor, ids: torch.Tensor, *, temperature: float = 1.0,
                           tp_group: Any = None) -> torch.Tensor:
    """``[b, S, k]`` full-vocabulary logprobs of the token ids ``ids`` (``[b, S, k]``, aligned) under
    ``softmax(logits / temperature)``; differentiable. ``logits`` is ``[b, S, V]``, or this rank's
    contiguous vocabulary shard ``[b, S, V / tp]`` of ``tp_group``."""
    body = _shifted(logits, temperature)
    targets = ids[:, 1:].to(device=body.device, dtype=torch.long)
    rank, size = _split(tp_group)
    if size == 1:
        picked = body.gather(-1, targets)
    else:
        width = body.shape[-1]
        local = targets - rank * width
        inside = (local >= 0) & (local < width)
        picked = body.gather(-1, local.clamp(0, width - 1)) * inside
        picked = _SumOverGroup.apply(picked, tp_group)
    return _aligned(picked - _log_normaliser(body, tp_group).unsqueeze(-1))


@torch.no_grad()
def next_token_topk(logits: torch.Tensor, k: int, *, temperature: float = 1.0, tp_group: Any = None,
                    vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` likeliest next tokens at every position: float32 logprobs ``[b, S, k]`` (full
    vocabulary, descending) and int64 ids ``[b, S, k]``, aligned. ``logits`` as in
    :func:`next_token_logprobs_at`; ids at or past ``vocab_size`` (a backend's padding of the
    vocabulary) are never chosen."""
    body = _shifted(logits, temperature)
    rank, size = _split(tp_group)
    width = body.shape[-1]
    if vocab_size is not None and (rank + 1) * width > vocab_size:
        padding = torch.arange(rank * width, (rank + 1) * width, device=body.device) >= vocab_size
        body = body.masked_fill(padding, float("-inf"))
    normaliser = _log_normaliser(body, tp_group).unsqueeze(-1)
    values, ids = body.topk(min(k, width), dim=-1)
    if size > 1:
        ids = ids + rank * width
        values = torch.cat(all_gather(values.contiguous(), group=tp_group), dim=-1)
        ids = torch.cat(all_gather(ids.contiguous(), group=tp_group), dim=-1)
        values, order = values.topk(k, dim=-1)
        ids = ids.gather(-1, order)
    return _aligned(values - normaliser), _aligned(ids)
