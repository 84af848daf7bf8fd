"""The ``math_multi_reward`` environment (NeMo RL's ``MathMultiRewardEnvironment``): three named
rewards per response, for GDPO (``grpo.adv_estimator.name: gdpo``).

* ``correctness``: the text between the last ``<answer>`` and the next ``</answer>``, stripped,
  equals the ground truth exactly;
* ``integer``: that answer is a string of digits;
* ``format``: the response is exactly ``<think>...</think>\\n<answer>...</answer>`` with one
  ``<answer>`` and one ``</answer>``.

The scalar reward is their sum, as NeMo RL totals named rewards. Every check is a string
operation in linear time on the response (no regular expression that could backtrack), so it runs
in the driver without verifier workers; model output is never executed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nrl_core.api import EnvResult, EnvSample
from nrl_env_math.plugin import MULTI_REWARD_SCHEMA

REWARD_NAMES = ("correctness", "integer", "format")


def answer_of(response: str) -> str:
    """The text of the last ``<answer>`` up to its ``</answer>`` (or the end), stripped."""
    return response.split("<answer>")[-1].split("</answer>")[0].strip()


def is_formatted(response: str) -> bool:
    """``<think>...</think>\\n<answer>...</answer>`` from the first character to the last, with one
    ``<answer>`` and one ``</answer>``."""
    if response.count("<answer>") != 1 or response.count("</answer>") != 1:
        return False
    opening = response.index("<answer>")
    head = response[:opening]
    return (response.startswith("<think>") and response.endswith("</answer>") and head.endswith("</think>\n")
            and len(head) >= len("<think>") + len("</think>\n"))


def rewards_of(response: str, ground_truth: str) -> dict[str, float]:
    answer = answer_of(response)
    return {"correctness": float(answer == ground_truth), "integer": float(answer.isdigit()),
            "format": float(is_formatted(response))}


class MathMultiRewardEnvironment:
    """Scores responses with the three named rewards; ``config`` is ``env.math_multi_reward``."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = MULTI_REWARD_SCHEMA.validate(dict(config), "env.math_multi_reward")

    def score(self, samples: list[EnvSample]) -> EnvResult:
        """Rewards (the sum of the three) in the order of ``samples``, each named reward in
        ``components``; metrics: ``accuracy`` (mean correctness) and each reward's mean."""
        scored = [rewards_of(s.response, str(s.metadata.get("ground_truth", "")).strip()) for s in samples]
        components = {name: [r[name] for r in scored] for name in REWARD_NAMES}
        n = max(len(samples), 1)
        metrics = {f"reward/{name}": sum(values) / n for name, values in components.items()}
        metrics.update(accuracy=metrics["reward/correctness"], num_samples=float(len(samples)))
        return EnvResult(rewards=[sum(r.values()) for r in scored], metrics=metrics, counts=("num_samples",),
                         components=components)

    def shutdown(self) -> None:
        """Nothing to stop: scoring runs in the driver."""
