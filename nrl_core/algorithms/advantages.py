"""Group-relative advantages (GRPO), with NeMo RL's semantics.

Each response's advantage is its reward minus a baseline formed from the other responses to the
same prompt, optionally divided by a standard deviation of those rewards. Responses are grouped by
a group id per response: identical prompts share one (:func:`prompt_group_ids`, NeMo RL's rule), or,
without ids, ``group_size`` consecutive responses form a group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

#: Added to a standard deviation before dividing by it (NeMo RL's constant).
STD_EPSILON = 1e-6

StdOf = Literal["others", "group"]


def prompt_group_ids(prompts: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
    """One id per response; responses to identical prompts (token for token) share an id, numbered
    in order of first appearance. Grouping by content, not position, keeps a prompt that occurs
    twice in a batch as one group, as NeMo RL does."""
    rows = prompts.tolist() if isinstance(prompts, torch.Tensor) else [list(p) for p in prompts]
    ids: dict[tuple[int, ...], int] = {}
    return torch.tensor([ids.setdefault(tuple(row), len(ids)) for row in rows], dtype=torch.long)


def consecutive_group_ids(size: int, group_size: int) -> torch.Tensor:
    """Ids for ``size`` responses where each ``group_size`` consecutive ones share a prompt."""
    if group_size < 1 or size % group_size:
        raise ValueError(f"expected a flat vector of num_prompts x {group_size} rewards, got {size}")
    return torch.arange(size) // group_size


def baseline_and_std(rewards: torch.Tensor, group_ids: torch.Tensor, *, leave_one_out: bool = True,
                     valid_mask: torch.Tensor | None = None, std_of: StdOf = "others"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-response baseline and standard deviation over the valid members of its group.

    The baseline of response i is the mean reward of its group's valid responses, leaving i out
    with ``leave_one_out`` (RLOO's unbiased baseline). The std is the unbiased standard deviation
    of the same rewards the baseline averages (``std_of="others"``, NeMo RL's), so with leave-one-out
    a group of two has one other reward and no std (0: left unnormalised); ``std_of="group"`` takes
    the std of the whole group's valid rewards instead (TRL's and verl's choice). A group with at
    most one valid response, and an invalid response, gets its own reward as baseline (advantage 0)
    and std 0. Computed in float64; returned in ``rewards``' dtype.
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must be flat vectors of one size, got {tuple(rewards.shape)} "
                         f"and {tuple(group_ids.shape)}")
    r = rewards.double()
    valid = torch.ones_like(r) if valid_mask is None else valid_mask.double()
    baseline, std = r.clone(), torch.zeros_like(r)
    for gid in torch.unique(group_ids):
        members = (group_ids == gid).nonzero().flatten()
        v, x = valid[members], r[members]
        if v.sum() <= 1:
            continue
        n = len(members)
        # others[i, j]: whether response j counts towards response i's baseline
        others = v.expand(n, n).clone()
        if leave_one_out:
            others.fill_diagonal_(0.0)
        spread = others if std_of == "others" else v.expand(n, n)
        count = spread.sum(1)
        center = (spread @ x) / count
        variance = (spread * (x[None, :] - center[:, None]) ** 2).sum(1) / (count - 1).clamp_min(1)
        valid_member = v > 0
        baseline[members] = torch.where(valid_member, (others @ x) / others.sum(1), x)
        std[members] = torch.where(valid_member & (count > 1), variance.sqrt(), torch.zeros_like(variance))
    return baseline.to(rewards.dtype), std.to(rewards.dtype)


def normalize_by_std(advantages: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``advantages / (std + 1e-6)`` wherever ``std > 0``; responses whose std is 0 keep their
    advantage unscaled rather than having it sharpened by a near-zero division."""
    return torch.where(std > 0, advantages / (std + STD_EPSILON), advantages)


def group_advantages(rewards: torch.Tensor, group_size: int | None = None, *, group_ids: torch.Tensor | None = None,
                     leave_one_out: bool = True, normalize: bool = True, std_of: StdOf = "others") -> torch.Tensor:
    """Per-response GRPO advantages for flat ``rewards`` (NeMo RL's ``GRPOAdvantageEstimator``).

    Groups come from ``group_ids`` or, without them, ``group_size`` consecutive responses.
    """
    if rewards.dim() != 1:
        raise ValueError(f"expected a flat vector of rewards, got shape {tuple(rewards.shape)}")
    if group_ids is None:
        if group_size is None:
            raise ValueError("give group_size or group_ids")
        group_ids = consecutive_group_ids(rewards.numel(), group_size)
        if leave_one_out and group_size < 2:
            raise ValueError("leave-one-out baselines need at least 2 generations per prompt")
    baseline, std = baseline_and_std(rewards, group_ids, leave_one_out=leave_one_out, std_of=std_of)
    advantages = rewards.double() - baseline.double()
    if normalize:
        advantages = normalize_by_std(advantages, std.double())
    return advantages.to(rewards.dtype)


def clip_advantages(advantages: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """NeMo RL's ``grpo.advantage_clip_low/high``: bounds applied after normalisation."""
    if low is not None:
        advantages = advantages.clamp(min=low)
    if high is not None:
        advantages = advantages.clamp(max=high)
    return advantages
