"""Multi-turn rollouts: episodes with an environment that talks back (``grpo.max_rollout_turns``).

NeMo RL's semantics. Each turn, every live episode's next response is generated in one batch; the
environment's ``step`` answers all of them at once (:class:`~nrl_core.contracts.MultiTurnEnvironment`).
An episode ends when the environment says it is done, when its context reaches
``policy.max_total_sequence_length`` (its last observation cut to fit; the episode is marked
truncated) or after ``max_rollout_turns`` model turns. Its reward is the sum of its turns' rewards.

Tokens in, tokens out: an episode's tokens are extended with exactly the tokens the engine sampled
and the environment's tokenized observation; the history is never rendered and tokenized again, so
what is trained on is what was sampled (a chat template that rewrites history cannot change it).
The loss mask is 1 on sampled tokens and 0 on the environment's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nrl_core.algorithms.rollout_sources import apart_from_training, validates_greedily
from nrl_core.algorithms.scoring import RolloutGroup, Scorer
from nrl_core.algorithms.setup import PhaseTimer
from nrl_core.contracts import EnvResult, EnvStep, Episode, GenerationOutput, MultiTurnEnvironment
from nrl_core.data import DatumSpec
from nrl_core.errors import NrlError
from nrl_core.generation_kit import stop_string_end

_ANCHOR = [{"role": "user", "content": "-"}, {"role": "assistant", "content": "-"}]


@dataclass
class EpisodeRun:
    """One episode in progress: everything after the prompt, token by token."""

    prompt: DatumSpec
    metadata: dict[str, Any]
    stop_strings: list[str] | None
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    turns: int = 0
    env_tokens: int = 0
    weight_version: int | None = None
    ended_by: str | None = None  # "environment", "length" (the context is full) or "turns"
    metric_sums: dict[str, float] = field(default_factory=dict)  # the environment's step metrics
    metric_counts: dict[str, int] = field(default_factory=dict)

    @property
    def context_length(self) -> int:
        return len(self.prompt.prompt_ids) + len(self.tokens)

    @property
    def truncated(self) -> bool:
        return self.ended_by == "length"

    @property
    def environment_metadata(self) -> dict[str, Any]:
        """What the environment's steps added to or changed in the prompt's metadata (for the logs:
        the prompt's own metadata, often the whole task, is not repeated per rollout)."""
        given = self.prompt.metadata
        return {k: v for k, v in self.metadata.items() if k not in given or given[k] != v}

    def add(self, tokens: Sequence[int], logprobs: Sequence[float] | None) -> None:
        """Sampled tokens (with their logprobs) or the environment's (``logprobs`` None)."""
        self.tokens.extend(tokens)
        self.loss_mask.extend([1.0 if logprobs is not None else 0.0] * len(tokens))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(tokens))


class ObservationTokens:
    """An observation's tokens: text as it is, messages through the chat template (what the
    template writes after a finished assistant turn for them, with the next generation prompt)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, observation: str | list[dict[str, Any]]) -> list[int]:
        if isinstance(observation, str):
            text = observation
        else:
            text = self._rendered(observation)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _rendered(self, messages: list[dict[str, Any]]) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            base = self.tokenizer.apply_chat_template(_ANCHOR, tokenize=False)
            full = self.tokenizer.apply_chat_template(_ANCHOR + list(messages), tokenize=False,
                                                      add_generation_prompt=True)
            if full.startswith(base):
                return full[len(base):]
        return "".join(str(m.get("content", "")) for m in messages)


def cut_at_stop(tokenizer: Any, tokens: list[int], logprobs: list[float],
                stop_strings: Sequence[str] | None) -> tuple[list[int], list[float], bool]:
    """The shortest prefix of ``tokens`` whose text contains a stop string (the stop string kept,
    as vLLM's ``include_stop_str_in_output``), or all of them; True when one was found."""
    end = stop_string_end(tokens, stop_strings or (), lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    if end is None:
        return tokens, logprobs, False
    return tokens[:end], logprobs[:end], True


class MultiTurnSampler:
    """Groups of ``group_size`` episodes per prompt, played turn by turn (see the module docstring)."""

    def __init__(self, config: Mapping[str, Any], generation: Any, scorer: Scorer, tokenizer: Any,
                 env: MultiTurnEnvironment, max_length: int) -> None:
        """``max_length`` bounds an episode's context: ``policy.max_total_sequence_length``, or the
        engine's ``max_model_len`` when lower."""
        built = getattr(env, "plugin_object", env)  # the plugin's own object behind the run's boundary
        if not isinstance(built, MultiTurnEnvironment):
            raise NrlError(f"data.env_name: environment {type(built).__name__} has no step(episodes) method, so it "
                           "cannot play multi-turn episodes; its spec must not say multi_turn=True")
        grpo, policy = config["grpo"], config["policy"]
        self.generation = generation
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.env = env
        self.group_size = int(grpo["num_generations_per_prompt"])
        self.max_turns = int(grpo["max_rollout_turns"])
        self.max_length = int(max_length)
        self.stop_strings = list(policy["generation"].get("stop_strings") or [])
        self.val_batch_size = int(grpo["val_batch_size"])
        self.val_greedy = validates_greedily(policy["generation"])
        self.observation_tokens = ObservationTokens(tokenizer)

    # ------------------------------------------------------------------ the sampler protocol

    def sample(self, prompts: Sequence[DatumSpec], timer: PhaseTimer) -> tuple[list[RolloutGroup], EnvResult]:
        with timer("refit"):
            self.generation.prepare()
        with timer("generation"):
            episodes = self.play([p for p in prompts for _ in range(self.group_size)])
        with timer("hand_off"):
            self.generation.finish()
        return self.groups(prompts, episodes)

    def stream(self, prompts: Sequence[DatumSpec]) -> Iterator[tuple[int, RolloutGroup, EnvResult]]:
        """The groups once the whole batch of episodes is played (turns are batched across
        episodes), each with its own episodes' turn metrics (averaged over groups when combined)."""
        episodes = self.play([p for p in prompts for _ in range(self.group_size)])
        groups, _ = self.groups(prompts, episodes)
        n = self.group_size
        for index, group in enumerate(groups):
            yield index, group, EnvResult(rewards=list(group.task_rewards or group.rewards),
                                          metrics=turn_metrics(episodes[index * n:(index + 1) * n]))

    def validate(self, prompts: Sequence[DatumSpec]) -> tuple[list[float], list[dict[str, Any]]]:
        self.generation.prepare()
        rewards: list[float] = []
        records: list[dict[str, Any]] = []
        with apart_from_training(self.generation):
            for start in range(0, len(prompts), self.val_batch_size):
                for episode in self.play(prompts[start:start + self.val_batch_size], greedy=self.val_greedy):
                    rewards.append(episode.reward)
                    records.append({"prompt": episode.prompt.prompt_text, "messages": episode.messages,
                                    "reward": episode.reward, "turns": episode.turns, "ended_by": episode.ended_by,
                                    "prompt_token_ids": list(episode.prompt.prompt_ids),
                                    "response_token_ids": episode.tokens, "weight_version": episode.weight_version,
                                    "metadata": episode.environment_metadata})
        self.generation.finish()
        return rewards, records

    # ------------------------------------------------------------------ episodes

    def play(self, prompts: Sequence[DatumSpec], greedy: bool = False) -> list[EpisodeRun]:
        """Play one episode per prompt to its end; every turn of every live episode in one generate call."""
        episodes = [EpisodeRun(prompt=p, metadata=dict(p.metadata), stop_strings=self.stop_strings or None)
                    for p in prompts]
        live = list(episodes)
        while live:
            for episode in live:
                if episode.context_length >= self.max_length:
                    episode.ended_by = "length"
                elif episode.turns >= self.max_turns:
                    episode.ended_by = "turns"
            live = [e for e in live if e.ended_by is None]
            if not live:
                break
            out = self.generation.generate([e.prompt.prompt_ids + e.tokens for e in live], greedy=greedy)
            for episode, tokens, logprobs in zip(live, out.token_ids, out.logprobs):
                self._respond(episode, list(tokens), list(logprobs), out.weight_version)
            steps = self.env.step([Episode(prompt=e.prompt.prompt_text, messages=list(e.messages),
                                           metadata=e.metadata, turn=e.turns) for e in live])
            if len(steps) != len(live):
                raise NrlError(f"environment {type(self.env).__name__}.step returned {len(steps)} results for "
                               f"{len(live)} episodes; it must answer each episode once, in order")
            for episode, step in zip(live, steps):
                self._observe(episode, step)
            live = [e for e in live if e.ended_by is None]
        return episodes

    def _respond(self, episode: EpisodeRun, tokens: list[int], logprobs: list[float], version: int) -> None:
        tokens, logprobs, _ = cut_at_stop(self.tokenizer, tokens, logprobs, episode.stop_strings)
        room = self.max_length - episode.context_length
        if len(tokens) >= room:
            tokens, logprobs = tokens[:room], logprobs[:room]
            episode.ended_by = "length"
        episode.add(tokens, logprobs)
        episode.turns += 1
        episode.weight_version = version if episode.weight_version is None else min(episode.weight_version, version)
        episode.messages.append({"role": "assistant",
                                 "content": self.tokenizer.decode(tokens, skip_special_tokens=True)})

    def _observe(self, episode: EpisodeRun, step: EnvStep) -> None:
        episode.reward += float(step.reward)
        for name, value in step.metrics.items():
            episode.metric_sums[name] = episode.metric_sums.get(name, 0.0) + float(value)
            episode.metric_counts[name] = episode.metric_counts.get(name, 0) + 1
        for name, value in step.components.items():
            episode.components[name] = episode.components.get(name, 0.0) + float(value)
        if step.metadata is not None:
            episode.metadata = dict(step.metadata)
        episode.stop_strings = step.stop_strings if step.stop_strings is not None else (self.stop_strings or None)
        if step.done:
            episode.ended_by = "environment"
            return
        if episode.ended_by is not None:  # the response filled the context: nothing more fits
            return
        if episode.turns >= self.max_turns:  # no turn left to read an observation in
            episode.ended_by = "turns"
            return
        tokens = self.observation_tokens(step.observation)
        room = self.max_length - episode.context_length
        if len(tokens) >= room:
            tokens = tokens[:room]
            episode.ended_by = "length"
        episode.add(tokens, None)
        episode.env_tokens += len(tokens)
        if isinstance(step.observation, str):
            episode.messages.append({"role": "environment", "content": step.observation})
        else:
            episode.messages.extend(step.observation)

    # ------------------------------------------------------------------ scoring

    def groups(self, prompts: Sequence[DatumSpec], episodes: list[EpisodeRun]) -> tuple[list[RolloutGroup], EnvResult]:
        """Every prompt's ``group_size`` episodes as a scored group; the batch's turn metrics."""
        n = self.group_size
        groups = []
        for i, prompt in enumerate(prompts):
            mine = episodes[i * n:(i + 1) * n]
            output = GenerationOutput(token_ids=[e.tokens for e in mine], logprobs=[e.logprobs for e in mine],
                                      finish_reasons=["length" if e.truncated else "stop" for e in mine],
                                      weight_version=min(e.weight_version or 0 for e in mine))
            names = sorted({k for e in mine for k in e.components})
            result = EnvResult(rewards=[e.reward for e in mine],
                               components={k: [e.components.get(k, 0.0) for e in mine] for k in names},
                               sample_metadata=[e.environment_metadata for e in mine])
            groups.append(self.scorer.group(prompt, output, result, loss_masks=[e.loss_mask for e in mine],
                                            turns=[e.turns for e in mine]))
        return groups, EnvResult(rewards=[e.reward for e in episodes], metrics=turn_metrics(episodes))


def turn_metrics(episodes: Sequence[EpisodeRun]) -> dict[str, float]:
    """NeMo RL's multi-turn rollout metrics (``env/multi_turn/...`` in the logs)."""
    n = max(len(episodes), 1)
    turns = [e.turns for e in episodes]
    names = sorted({k for e in episodes for k in e.metric_sums})
    reported = {name: sum(e.metric_sums.get(name, 0.0) for e in episodes)
                / sum(e.metric_counts.get(name, 0) for e in episodes) for name in names}
    return {**reported,  # each of the environment's metrics over the steps that reported it
            "multi_turn/avg_turns_per_sample": sum(turns) / n,
            "multi_turn/max_turns_per_sample": float(max(turns, default=0)),
            "multi_turn/natural_termination_rate": sum(e.ended_by == "environment" for e in episodes) / n,
            "multi_turn/truncation_rate": sum(e.ended_by == "length" for e in episodes) / n,
            "multi_turn/max_turns_reached_rate": sum(e.ended_by == "turns" for e in episodes) / n,
            "multi_turn/mean_total_tokens_per_sample": sum(e.context_length for e in episodes) / n,
            "multi_turn/mean_gen_tokens_per_sample": sum(len(e.tokens) - e.env_tokens for e in episodes) / n,
            "multi_turn/mean_env_tokens_per_sample": sum(e.env_tokens for e in episodes) / n}
