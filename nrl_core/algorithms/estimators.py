"""The core's advantage estimators, registered through ``nrl_advantage_estimators`` like any
plugin's (NeMo RL's ``grpo.adv_estimator.name``). Each is built once per run from
``grpo.adv_estimator`` and the whole config, and called in the driver once per step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nrl_core.algorithms.advantages import baseline_and_std, group_advantages
from nrl_core.algorithms.loss import kl_estimate
from nrl_core.contracts import AdvantageInputs
from nrl_core.errors import ConfigError


def _shared(section: Mapping[str, Any], config: Mapping[str, Any], key: str) -> Any:
    """``grpo.adv_estimator.<key>``, or ``grpo.<key>`` where the estimator section leaves it null
    (NeMo RL's configs interpolate the one from the other)."""
    value = section.get(key)
    return config["grpo"][key] if value is None else value


class GroupRelativeEstimator:
    """GRPO: reward minus the mean of the prompt's other responses (or all of them), divided by a
    standard deviation where it is above zero (NeMo RL's ``GRPOAdvantageEstimator``)."""

    def __init__(self, section: Mapping[str, Any], config: Mapping[str, Any]) -> None:
        self.leave_one_out = bool(_shared(section, config, "use_leave_one_out_baseline"))
        self.normalize = bool(_shared(section, config, "normalize_rewards"))
        self.std_of = section.get("std_of", "others")

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor:
        return group_advantages(inputs.rewards, group_ids=inputs.group_ids, leave_one_out=self.leave_one_out,
                                normalize=self.normalize, std_of=self.std_of)


class MultiRewardEstimator:
    """GDPO (NeMo RL's ``GDPOAdvantageEstimator``): each named reward the environment reports gets
    its own group-relative advantage (baseline and std as GRPO's); their sum, weighted by
    ``reward_weights`` (in the components' alphabetical order; default all 1), is then normalised
    to mean 0 and std 1 over the batch. So a sparse reward is not drowned by a dense one."""

    def __init__(self, section: Mapping[str, Any], config: Mapping[str, Any]) -> None:
        self.per_reward = GroupRelativeEstimator(section, config)
        self.weights = section.get("reward_weights")

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor:
        names = sorted(inputs.reward_components)
        if len(names) < 2:
            raise ConfigError("grpo.adv_estimator.name", f"gdpo needs an environment that reports several named "
                                                         f"rewards, got {len(names)} ({', '.join(names) or 'none'}); "
                                                         "use a multi-reward environment (e.g. env.math_multi_reward) "
                                                         "or the grpo estimator")
        weights = self.weights if self.weights is not None else [1.0] * len(names)
        if len(weights) != len(names):
            raise ConfigError("grpo.adv_estimator.reward_weights",
                              f"has {len(weights)} entries for {len(names)} rewards ({', '.join(names)}); give one "
                              "weight per reward, in that (alphabetical) order")
        total = sum(float(w) * self.per_reward(AdvantageInputs(rewards=inputs.reward_components[name].double(),
                                                               group_ids=inputs.group_ids, batch=inputs.batch))
                    for w, name in zip(weights, names))
        std = total.std()
        centred = total - total.mean()
        return (centred / std if std > 0 else centred).to(inputs.rewards.dtype)


class ReinforcePlusPlusEstimator:
    """REINFORCE++ (NeMo RL's ``ReinforcePlusPlusAdvantageEstimator``): reward minus the prompt's
    mean reward (``minus_baseline``), per token minus beta x KL(policy || reference) when
    ``loss_fn.use_kl_in_reward``, then whitened over every valid token of the batch."""

    def __init__(self, section: Mapping[str, Any], config: Mapping[str, Any]) -> None:
        self.minus_baseline = bool(section.get("minus_baseline", True))
        self.kl = RewardKL(config["loss_fn"])

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor:
        rewards = inputs.rewards.double()
        if self.minus_baseline:
            baseline, _ = baseline_and_std(rewards, inputs.group_ids, leave_one_out=False)
            rewards = rewards - baseline
        mask = inputs.batch.fields["token_mask"].double()
        advantages = rewards.unsqueeze(1).expand_as(mask) - self.kl(inputs.batch.fields)
        return whiten(advantages, mask).to(inputs.rewards.dtype)


class RewardKL:
    """beta x KL(policy || reference) per token, the penalty ``loss_fn.use_kl_in_reward`` moves from
    the loss into the reward (0 without it), for the estimators that take it."""

    def __init__(self, loss_fn: Mapping[str, Any]) -> None:
        self.coef = float(loss_fn["reference_policy_kl_penalty"]) if loss_fn.get("use_kl_in_reward") else 0.0
        self.kind = loss_fn["reference_policy_kl_type"]

    def __call__(self, fields: Mapping[str, torch.Tensor]) -> torch.Tensor | float:
        if not self.coef:
            return 0.0
        return self.coef * kl_estimate(fields["prev_logprobs"].double(), fields["reference_logprobs"].double(),
                                       self.kind)


def whiten(values: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = False) -> torch.Tensor:
    """``values`` shifted to mean 0 and scaled to variance 1 over the tokens in ``mask``. NeMo RL
    whitens REINFORCE++'s advantages by the population variance (at least 1e-8) and GAE's by the
    sample variance plus 1e-8 (``unbiased``)."""
    count = mask.sum().clamp_min(1)
    mean = (values * mask).sum() / count
    variance = ((values - mean).square() * mask).sum() / count
    if unbiased:
        return (values - mean) * (variance * count / (count - 1).clamp_min(1) + 1e-8).rsqrt()
    return (values - mean) * variance.clamp_min(1e-8).rsqrt()


def generalized_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *,
                           gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the tokens in ``mask`` (response tokens; others are skipped, carrying the running
    values across them, so a multi-turn sequence's observation tokens add no phantom steps):
    delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next. Returns the advantages and
    the returns A + V, both zero outside ``mask``. For PPO's value model; GRPO has none."""
    advantages = torch.zeros_like(token_rewards)
    next_value = torch.zeros_like(token_rewards[:, 0])
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(token_rewards.shape[1])):
        valid = mask[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(valid, advantage, torch.zeros_like(advantage))
        next_value = torch.where(valid, values[:, t], next_value)
        next_advantage = torch.where(valid, advantage, next_advantage)
    return advantages, (advantages + values) * mask


class GeneralizedAdvantageEstimator:
    """GAE on a value model's per-token ``values`` (NeMo RL's ``GeneralizedAdvantageEstimator``):
    the reward at each response's last token, minus beta x KL per token with
    ``loss_fn.use_kl_in_reward``, then :func:`generalized_advantages`, whitened over valid tokens
    with ``normalize_advantages``. Only an algorithm with a value model (PPO) provides ``values``."""

    def __init__(self, section: Mapping[str, Any], config: Mapping[str, Any]) -> None:
        self.gamma, self.lam = float(section.get("gae_gamma", 1.0)), float(section.get("gae_lambda", 0.95))
        self.normalize = bool(section.get("normalize_advantages", True))
        self.kl = RewardKL(config["loss_fn"])

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor:
        fields = inputs.batch.fields
        mask = fields["token_mask"].double()
        token_rewards = torch.zeros_like(mask) - self.kl(fields)
        last = mask.shape[1] - 1 - mask.fliplr().argmax(dim=1)
        rows = mask.any(dim=1).nonzero().flatten()
        token_rewards[rows, last[rows]] += inputs.rewards.double()[rows]
        advantages, _ = generalized_advantages(token_rewards * mask, fields["values"].double(), mask,
                                               gamma=self.gamma, lam=self.lam)
        if self.normalize:
            advantages = whiten(advantages, mask, unbiased=True) * mask
        return advantages.to(inputs.rewards.dtype)
