"""Group-relative advantages (GRPO).

Rewards arrive as one flat vector ordered by prompt: ``num_generations_per_prompt`` consecutive
entries share a prompt. Each response's advantage is its reward minus its group's baseline,
optionally divided by the group's standard deviation.
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, leave_one_out: bool = True, normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per-response advantages for rewards ``[num_prompts * group_size]``.

    * baseline: the group mean, or with ``leave_one_out`` the mean of the *other* responses of the
      group (an unbiased baseline: a response's own reward does not lower its advantage);
    * ``normalize``: divide by the group's (unbiased) reward standard deviation; a group whose
      rewards are all equal carries no signal and gets advantage 0, never a division by ~0.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"expected a flat vector of num_prompts x {group_size} rewards, got shape {tuple(rewards.shape)}")
    if leave_one_out and group_size < 2:
        raise ValueError("leave-one-out baselines need at least 2 generations per prompt")
    grouped = rewards.double().view(-1, group_size)
    total = grouped.sum(dim=1, keepdim=True)
    if leave_one_out:
        baseline = (total - grouped) / (group_size - 1)
    else:
        baseline = total / group_size
    advantages = grouped - baseline
    if normalize and group_size > 1:
        std = grouped.std(dim=1, keepdim=True, unbiased=True)
        advantages = torch.where(std > eps, advantages / (std + eps), torch.zeros_like(advantages))
    return advantages.view(-1).to(rewards.dtype)
