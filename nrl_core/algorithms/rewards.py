"""What GRPO does to the environment's rewards before advantages, with NeMo RL's keys: reward
scaling (``grpo.reward_scaling``), DAPO's overlong shaping or the stop-properly penalty
(``grpo.reward_shaping``), and DAPO's dynamic-sampling filter (``grpo.use_dynamic_sampling``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def scale_rewards(rewards: Sequence[float], cfg: Mapping[str, Any]) -> list[float]:
    """Each reward clamped to [source_min, source_max], then mapped linearly onto
    [target_min, target_max] (DAPO recipes map 0/1 correctness onto -1/1)."""
    if not cfg["enabled"]:
        return list(rewards)
    low, high = float(cfg["source_min"]), float(cfg["source_max"])
    to_low, to_high = float(cfg["target_min"]), float(cfg["target_max"])
    return [to_low + (min(max(r, low), high) - low) / (high - low) * (to_high - to_low) for r in rewards]


def shape_rewards(rewards: Sequence[float], response_lengths: Sequence[int], truncated: Sequence[bool],
                  cfg: Mapping[str, Any], max_response_length: int) -> list[float]:
    """DAPO's overlong shaping: a response longer than ``max_response_length -
    overlong_buffer_length`` tokens loses ``overlong_buffer_penalty`` x its excess over the buffer
    length (so a response at ``max_response_length`` loses the whole penalty). With
    ``stop_properly_penalty_coef`` set instead, a truncated response's reward is multiplied by it."""
    if not cfg["enabled"]:
        return list(rewards)
    coef = cfg["stop_properly_penalty_coef"]
    if coef is not None:
        return [r * coef if cut else r for r, cut in zip(rewards, truncated)]
    buffer, penalty = int(cfg["overlong_buffer_length"]), float(cfg["overlong_buffer_penalty"])
    expected = max_response_length - buffer
    return [r + min(-(length - expected) / buffer * penalty, 0.0) for r, length in zip(rewards, response_lengths)]


def has_spread(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards differ, so its advantages carry a signal (DAPO keeps only these)."""
    return len(set(rewards)) > 1


def shaping_problem(cfg: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first inconsistent ``grpo.reward_shaping`` / ``reward_scaling`` value, as (key, message)."""
    shaping = cfg["reward_shaping"]
    if shaping["enabled"]:
        coef = shaping["stop_properly_penalty_coef"]
        if coef is not None and not 0 <= coef <= 1:
            return "grpo.reward_shaping.stop_properly_penalty_coef", f"must be in [0, 1], got {coef}"
        if coef is None and not shaping["overlong_buffer_length"]:
            return "grpo.reward_shaping.overlong_buffer_length", "must be a positive number of tokens for DAPO's overlong shaping"
    scaling = cfg["reward_scaling"]
    if scaling["enabled"] and scaling["source_max"] <= scaling["source_min"]:
        return "grpo.reward_scaling.source_max", (f"{scaling['source_max']} must exceed source_min "
                                                  f"{scaling['source_min']}")
    return None
