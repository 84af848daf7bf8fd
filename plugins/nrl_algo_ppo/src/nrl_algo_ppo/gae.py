"""PPO's advantages and the critic's targets from one step's rollouts (NeMo RL's GAE estimator).

The critic's head at position ``t`` has read tokens ``0..t``: it values the state *after* token
``t``. The value of the state in which token ``t`` was sampled is therefore its output at ``t - 1``
(:func:`token_values`; none before the first token). Each response's reward sits on its last token
(minus ``beta x KL`` on every token with ``loss_fn.use_kl_in_reward``), GAE runs over the response
tokens (:func:`nrl_core.algorithms.estimators.generalized_advantages`), the critic learns the
returns ``A + V`` computed with ``gae_lambda_value`` and the policy the advantages computed with
its own lambda, whitened over the step's tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nrl_core.api import generalized_advantages, whiten


def token_values(raw: torch.Tensor) -> torch.Tensor:
    """The critic's ``[b, t]`` outputs as the value of the state each token was sampled in."""
    return torch.cat([raw.new_zeros((raw.shape[0], 1)), raw[:, :-1]], dim=1)


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[b, t]``: each response's reward on its last token in ``mask``, zero elsewhere."""
    out = torch.zeros_like(mask, dtype=rewards.dtype)
    last = mask.shape[1] - 1 - mask.fliplr().argmax(dim=1)
    rows = (mask > 0).any(dim=1).nonzero().flatten()
    out[rows, last[rows]] = rewards[rows]
    return out


@dataclass(frozen=True)
class GAEConfig:
    """``ppo.adv_estimator`` (NeMo RL's keys)."""

    gamma: float = 1.0
    lam: float = 0.95
    lam_value: float | None = None
    lam_policy: float | None = None
    length_adaptive_alpha: float = 0.0
    normalize: bool = True

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> GAEConfig:
        return cls(gamma=float(section["gae_gamma"]), lam=float(section["gae_lambda"]),
                   lam_value=section["gae_lambda_value"], lam_policy=section["gae_lambda_policy"],
                   length_adaptive_alpha=float(section["length_adaptive_alpha"]),
                   normalize=bool(section["normalize_advantages"]))

    def policy_lambda(self, mask: torch.Tensor) -> torch.Tensor | float:
        """VAPO's length-adaptive lambda ``1 - 1 / (alpha x length)`` per response, else the policy's."""
        if self.length_adaptive_alpha > 0:
            lengths = mask.sum(dim=1)
            return (1.0 - 1.0 / (self.length_adaptive_alpha * lengths).clamp_min(1.0)).clamp(0.0, 1.0)
        return self.lam if self.lam_policy is None else float(self.lam_policy)


def advantages_and_returns(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                           cfg: GAEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's advantages and the critic's returns, float64, zero outside ``mask``."""
    token_rewards, values, mask = token_rewards.double(), values.double(), mask.double()
    lam_value = cfg.lam if cfg.lam_value is None else float(cfg.lam_value)
    value_advantages, returns = generalized_advantages(token_rewards * mask, values, mask, gamma=cfg.gamma,
                                                       lam=lam_value)
    lam_policy = cfg.policy_lambda(mask)
    same = not isinstance(lam_policy, torch.Tensor) and lam_policy == lam_value
    advantages = value_advantages if same else generalized_advantages(
        token_rewards * mask, values, mask, gamma=cfg.gamma, lam=lam_policy)[0]
    if cfg.normalize:
        advantages = whiten(advantages, mask, unbiased=True)
    return advantages * mask, returns


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over the tokens in ``mask``: how much of the
    return's variance the critic explains (1 perfect, 0 no better than the mean)."""
    m = mask.double()
    count = m.sum().clamp_min(1)

    def variance(x: torch.Tensor) -> torch.Tensor:
        mean = (x * m).sum() / count
        return ((x - mean).square() * m).sum() / count

    r, v = returns.double(), values.double()
    return float(1.0 - variance(r - v) / variance(r).clamp_min(1e-8))
