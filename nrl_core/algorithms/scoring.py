"""Scoring rollouts: the one place responses become environment samples and rewards.

Every rollout source (synchronous, asynchronous, multi-turn) and validation score through a
:class:`Scorer`: it decodes the responses, asks the environment for rewards, and applies
``grpo.reward_scaling`` and ``grpo.reward_shaping``, giving :class:`RolloutGroup`s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nrl_core.algorithms.rewards import scale_rewards, shape_rewards
from nrl_core.contracts import Environment, EnvResult, EnvSample, GenerationOutput
from nrl_core.data import DatumSpec


@dataclass
class RolloutGroup:
    """One prompt's sampled responses and their rewards; its ``output.weight_version`` is the
    oldest version of the weights that sampled it.

    ``output.token_ids`` are everything after the prompt. For a multi-turn episode that includes
    the environment's tokens, which ``loss_masks`` marks 0 (1: sampled by the policy); None means
    every response token was sampled."""

    prompt: DatumSpec
    output: GenerationOutput
    rewards: list[float]
    components: dict[str, list[float]] = field(default_factory=dict)
    task_rewards: list[float] | None = None  # before reward shaping: what dynamic sampling filters on
    loss_masks: list[list[float]] | None = None
    turns: list[int] | None = None  # model turns per episode (multi-turn)
    tool_calls: list[int] | None = None  # tool calls per episode (multi-turn with tools)
    metadata: list[dict[str, Any]] | None = None  # what the environment said about each sample, for the logs

    @property
    def size(self) -> int:
        return len(self.rewards)


def merge_groups(groups: Sequence[RolloutGroup]) -> GenerationOutput:
    """The groups' samples as one output, in group order; the oldest weight version."""
    return GenerationOutput.concatenate([g.output for g in groups])


def merged_loss_masks(groups: Sequence[RolloutGroup]) -> list[list[float]] | None:
    """Every sample's response loss mask in group order; None when every response token is sampled."""
    if all(g.loss_masks is None for g in groups):
        return None
    return [mask for g in groups
            for mask in (g.loss_masks or [[1.0] * len(ids) for ids in g.output.token_ids])]


def reward_components(groups: Sequence[RolloutGroup]) -> dict[str, torch.Tensor]:
    """Each named reward over the groups' samples, in group order; 0 where a group lacks it (a
    batch mixing environments), as NeMo RL fills them."""
    names = sorted({name for g in groups for name in g.components})
    return {name: torch.tensor([r for g in groups for r in g.components.get(name, [0.0] * len(g.rewards))])
            for name in names}


class Scorer:
    """Rewards for responses: decoded, scored by the run's environment, scaled and shaped."""

    def __init__(self, config: Mapping[str, Any], tokenizer: Any, env: Environment, *, section: str = "grpo") -> None:
        """``section``: the algorithm section holding NeMo RL's ``reward_scaling`` and
        ``reward_shaping`` (GRPO's, or another algorithm's with the same keys: PPO's)."""
        grpo = config[section]
        self.tokenizer = tokenizer
        self.env = env
        self.scaling = grpo["reward_scaling"]
        self.shaping = grpo["reward_shaping"]
        self.length_limit = int(self.shaping["max_response_length"] or config["policy"]["max_total_sequence_length"])

    def samples(self, prompts: Sequence[DatumSpec], token_ids: Sequence[Sequence[int]]) -> list[EnvSample]:
        """``token_ids[i]`` answers ``prompts[i]``: the environment's view of each answer."""
        texts = self.tokenizer.batch_decode([list(t) for t in token_ids], skip_special_tokens=True)
        return [EnvSample(prompt=p.prompt_text, response=text, metadata=p.metadata) for p, text in zip(prompts, texts)]

    def rewards(self, prompts: Sequence[DatumSpec], token_ids: Sequence[Sequence[int]]) -> tuple[EnvResult, list[str]]:
        """The environment's result for each answer, and the decoded answers."""
        samples = self.samples(prompts, token_ids)
        return self.env.score(samples), [s.response for s in samples]

    def score(self, prompts: Sequence[DatumSpec], rollouts: GenerationOutput, group_size: int
              ) -> tuple[list[RolloutGroup], EnvResult]:
        """``group_size`` consecutive responses per prompt, scored in one call to the environment."""
        n = group_size
        result, _ = self.rewards([p for p in prompts for _ in range(n)], rollouts.token_ids)
        groups = [self.group(prompt, rollouts.slice(i * n, (i + 1) * n), result.slice(i * n, (i + 1) * n))
                  for i, prompt in enumerate(prompts)]
        return groups, result

    def group(self, prompt: DatumSpec, output: GenerationOutput, result: EnvResult, **extra: Any) -> RolloutGroup:
        """One prompt's responses with the environment's rewards after ``grpo.reward_scaling`` and
        ``grpo.reward_shaping`` (the named rewards are scaled too, as NeMo RL does)."""
        task = scale_rewards(result.rewards, self.scaling)
        shaped = shape_rewards(task, [len(ids) for ids in output.token_ids],
                               [reason == "length" for reason in output.finish_reasons], self.shaping,
                               self.length_limit)
        return RolloutGroup(prompt=prompt, output=output, rewards=shaped, task_rewards=task,
                            components={k: scale_rewards(v, self.scaling) for k, v in result.components.items()},
                            metadata=result.sample_metadata, **extra)
