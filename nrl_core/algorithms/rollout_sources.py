"""Where GRPO's rollouts come from: a sampler (what one batch of prompts becomes) fed by a source
(when prompts are drawn and with which weights).

The GRPO loop asks its source for the rollouts of each step and trains on them; it does not know
whether they were sampled just now (:class:`SyncRollouts`) or by a collector running ahead with
bounded staleness (:class:`~nrl_core.algorithms.async_rollouts.AsyncRollouts`), nor whether each is
one response or a many-turn episode (the sampler's business: :class:`SingleTurnSampler`, or
:class:`~nrl_core.algorithms.multi_turn.MultiTurnSampler`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from nrl_core.algorithms.rewards import has_spread
from nrl_core.algorithms.rollouts import repeat_prompts
from nrl_core.algorithms.scoring import RolloutGroup, Scorer
from nrl_core.algorithms.setup import PhaseTimer
from nrl_core.contracts import EnvResult
from nrl_core.data import DatumSpec
from nrl_core.errors import NrlError


@dataclass
class RolloutBatch:
    """The scored rollouts one step trains on, with the metrics of how they were made."""

    step: int
    groups: list[RolloutGroup]
    metrics: dict[str, float] = field(default_factory=dict)
    timer: PhaseTimer = field(default_factory=PhaseTimer)


class Sampler(Protocol):
    """What a batch of prompts becomes: scored groups of ``group_size`` rollouts each."""

    group_size: int

    def sample(self, prompts: Sequence[DatumSpec], timer: PhaseTimer) -> tuple[list[RolloutGroup], EnvResult]:
        """Every prompt's group, with the engines refit first if the policy changed."""

    def stream(self, prompts: Sequence[DatumSpec]) -> Iterator[tuple[int, RolloutGroup, EnvResult]]:
        """``(prompt index, group, its environment result)`` as each group completes, with the
        weights the engines hold (the caller refits)."""

    def validate(self, prompts: Sequence[DatumSpec]) -> tuple[list[float], list[dict[str, Any]]]:
        """Greedy rollouts of ``prompts``: each reward, and a record of each for the log."""


class RolloutSource(Protocol):
    def start(self, first_step: int) -> None:
        """Called once the run's state is restored, before the first step."""

    def batch_for(self, step: int) -> RolloutBatch:
        """The rollouts ``step`` trains on."""

    def after_step(self, batch: RolloutBatch) -> dict[str, float]:
        """The policy was trained on ``batch``: the source's metrics of the step."""

    def engines(self) -> AbstractContextManager[None]:
        """Hold the engines for the caller (validation) between the source's own uses."""

    def dataloader_state(self, next_step: int) -> dict[str, Any]:
        """Where the prompts of ``next_step`` are drawn from, for a checkpoint."""

    def stop(self) -> None: ...


def env_metrics(result: EnvResult) -> dict[str, float]:
    return {f"env/{k}": v for k, v in result.metrics.items()}


@contextlib.contextmanager
def apart_from_training(generation: Any) -> Iterator[None]:
    """Validation's generate calls, outside the sequence of training's: each engine's sampling
    position (taken once the engines hold the weights to validate) is put back afterwards, so
    whether and when a run validates never changes the samples it trains on. A run extended after
    its end-of-run validation then continues as the unbroken run does. Validation draws the seeds
    the next training call draws, on other prompts."""
    positions = generation.sampling_states()
    yield  # a validation that fails ends the run: its error, not a restore's, is the one to see
    generation.load_sampling_states(positions)


def validates_greedily(generation: Mapping[str, Any]) -> bool:
    """``policy.generation.val_temperature`` 0: validation decodes greedily. Otherwise it samples as
    training does, as NeMo RL validates (its ``val_temperature`` defaults to the training one)."""
    return generation.get("val_temperature") == 0


class SingleTurnSampler:
    """One response per sample: generate ``group_size`` responses to each prompt, score them once."""

    def __init__(self, generation: Any, scorer: Scorer, group_size: int, val_batch_size: int,
                 val_greedy: bool = False) -> None:
        self.generation = generation
        self.scorer = scorer
        self.group_size = group_size
        self.val_batch_size = val_batch_size
        self.val_greedy = val_greedy

    def sample(self, prompts: Sequence[DatumSpec], timer: PhaseTimer) -> tuple[list[RolloutGroup], EnvResult]:
        with timer("refit"):
            self.generation.prepare()  # refit if stale; colocated: the engines take the device
        with timer("generation"):
            rollouts = self.generation.generate(repeat_prompts([d.prompt_ids for d in prompts], self.group_size))
        with timer("hand_off"):
            self.generation.finish()  # colocated: the engines sleep, training takes the device back
        with timer("reward"):
            return self.scorer.score(prompts, rollouts, self.group_size)

    def stream(self, prompts: Sequence[DatumSpec]) -> Iterator[tuple[int, RolloutGroup, EnvResult]]:
        for index, output in self.generation.generate_groups([d.prompt_ids for d in prompts], self.group_size):
            prompt = prompts[index]
            result, _ = self.scorer.rewards([prompt] * len(output.token_ids), output.token_ids)
            yield index, self.scorer.group(prompt, output, result), result

    def validate(self, prompts: Sequence[DatumSpec]) -> tuple[list[float], list[dict[str, Any]]]:
        self.generation.prepare()
        rewards: list[float] = []
        records: list[dict[str, Any]] = []
        with apart_from_training(self.generation):
            for start in range(0, len(prompts), self.val_batch_size):
                chunk = prompts[start:start + self.val_batch_size]
                out = self.generation.generate([d.prompt_ids for d in chunk], greedy=self.val_greedy)
                result, texts = self.scorer.rewards(chunk, out.token_ids)
                rewards.extend(result.rewards)
                described = result.sample_metadata or [None] * len(chunk)
                records.extend({"prompt": d.prompt_text, "response": text, "reward": reward,
                                "prompt_token_ids": list(d.prompt_ids), "response_token_ids": ids,
                                "weight_version": out.weight_version,
                                **({"metadata": meta} if meta is not None else {})}
                               for d, text, reward, ids, meta in zip(chunk, texts, result.rewards, out.token_ids,
                                                                     described))
        self.generation.finish()
        return rewards, records


class SyncRollouts:
    """Each step's prompts sampled with the current weights when the step asks; with
    ``grpo.use_dynamic_sampling``, further batches until enough groups carry a signal."""

    def __init__(self, sampler: Sampler, loader: Any, grpo: Mapping[str, Any]) -> None:
        self.sampler = sampler
        self.loader = loader
        self.cfg = grpo

    def start(self, first_step: int) -> None:
        pass

    def batch_for(self, step: int) -> RolloutBatch:
        timer = PhaseTimer()
        groups, result = self.sampler.sample(self.loader.next_batch(), timer)
        metrics = env_metrics(result)
        if self.cfg["use_dynamic_sampling"]:
            groups, metrics = self.dynamic_sampling(groups, metrics, timer)
        return RolloutBatch(step=step, groups=groups, metrics=metrics, timer=timer)

    def dynamic_sampling(self, groups: list[RolloutGroup], metrics: dict[str, float],
                         timer: PhaseTimer) -> tuple[list[RolloutGroup], dict[str, float]]:
        """DAPO's dynamic sampling: keep the groups whose rewards (before shaping) differ, the only
        ones with a gradient, and sample further batches of prompts until ``num_prompts_per_step``
        such groups are found, at most ``dynamic_sampling_max_gen_batches`` batches in all."""
        need, limit = int(self.cfg["num_prompts_per_step"]), int(self.cfg["dynamic_sampling_max_gen_batches"])
        kept = [g for g in groups if has_spread(g.task_rewards or g.rewards)]
        batches, seen = 1, len(groups)
        while len(kept) < need:
            if batches >= limit:
                raise NrlError(f"grpo.dynamic_sampling_max_gen_batches: {batches} generation batches gave only "
                               f"{len(kept)} of the {need} prompts with differing rewards a step needs; raise the "
                               "limit or grpo.batch_multiplier, or use easier data")
            more, result = self.sampler.sample(self.loader.next_batch(), timer)
            metrics = env_metrics(result)
            batches, seen = batches + 1, seen + len(more)
            kept += [g for g in more if has_spread(g.task_rewards or g.rewards)]
        return kept[:need], {**metrics, "dynamic_sampling/num_gen_batches": float(batches),
                             "dynamic_sampling/kept_fraction": len(kept) / seen,
                             "dynamic_sampling/num_discarded_valid_groups": float(len(kept) - need)}

    def after_step(self, batch: RolloutBatch) -> dict[str, float]:
        return {}  # the engines refit lazily, before the next generation

    def engines(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def dataloader_state(self, next_step: int) -> dict[str, Any]:
        return self.loader.state_dict()

    def stop(self) -> None:
        pass
