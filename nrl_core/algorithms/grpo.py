"""Group Relative Policy Optimization, with NeMo RL's configuration semantics.

One step: refit the engines if stale, generate ``num_generations_per_prompt`` responses per
prompt, score them, compute group-relative advantages, compute the policy's and the reference's
logprobs of what was sampled, train with the clipped policy-gradient loss; the loop in
:class:`~nrl_core.algorithms.base.AlgorithmRun` then logs, validates and checkpoints.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from nrl_core.algorithms.advantages import clip_advantages, prompt_group_ids
from nrl_core.algorithms.base import AlgorithmRun
from nrl_core.algorithms.generation import Generation
from nrl_core.algorithms.loss import GRPO_SEMANTICS_VERSION
from nrl_core.algorithms.rollouts import repeat_prompts, rollout_batch
from nrl_core.algorithms.setup import PhaseTimer, build_environment, load_tokenizer
from nrl_core.algorithms.grpo_config import check_grpo, on_policy_ratio
from nrl_core.algorithms.rewards import has_spread, scale_rewards, shape_rewards
from nrl_core.contracts import AdvantageInputs, EnvResult, EnvSample, GenerationOutput, TokenBatch, import_object
from nrl_core.errors import NrlError
from nrl_core.data import DatumSpec, LengthLimits, prepare_data
from nrl_core.plugins import get_plugin_manager

logger = logging.getLogger(__name__)


@dataclass
class RolloutGroup:
    """One prompt's ``num_generations_per_prompt`` sampled responses and their rewards; its
    ``output.weight_version`` is the version of the weights that sampled it."""

    prompt: DatumSpec
    output: GenerationOutput
    rewards: list[float]
    components: dict[str, list[float]] = field(default_factory=dict)
    task_rewards: list[float] | None = None  # before reward shaping: what dynamic sampling filters on


def reward_components(groups: Sequence[RolloutGroup]) -> dict[str, torch.Tensor]:
    """Each named reward over the groups' samples, in group order; 0 where a group lacks it (a
    batch mixing environments), as NeMo RL fills them."""
    names = sorted({name for g in groups for name in g.components})
    return {name: torch.tensor([r for g in groups for r in g.components.get(name, [0.0] * len(g.rewards))])
            for name in names}


def merge_groups(groups: Sequence[RolloutGroup]) -> GenerationOutput:
    """The groups' samples as one output, in group order; the oldest weight version."""
    return GenerationOutput(token_ids=[t for g in groups for t in g.output.token_ids],
                            logprobs=[lp for g in groups for lp in g.output.logprobs],
                            finish_reasons=[r for g in groups for r in g.output.finish_reasons],
                            weight_version=min(g.output.weight_version for g in groups))


class GRPO(AlgorithmRun):
    section = "grpo"
    summary_prefixes = ("val/", "train/reward")

    def __init__(self, config: Mapping[str, Any]) -> None:
        check_grpo(config)  # done by validation too; a config built in code may have skipped it
        _warn_truncated_sampling(config["policy"]["generation"])
        self.group_size = int(config["grpo"]["num_generations_per_prompt"])
        self.tokenizer = load_tokenizer(config)
        data = prepare_data(config["data"], self.tokenizer, limits=prompt_limits(config))
        self.val_data: list[DatumSpec] = (data.val or [])[: config["grpo"]["max_val_samples"]]
        plugins = get_plugin_manager()
        self.on_policy_ratio = on_policy_ratio(config)
        loss_spec = plugins.loss_functions().get(config["loss_fn"]["name"], "loss_fn.name")
        self.loss_fn = import_object(loss_spec.loss).from_config({**config["loss_fn"],
                                                                  "force_on_policy_ratio": self.on_policy_ratio})
        self.estimator_spec = plugins.advantage_estimators().get(config["grpo"]["adv_estimator"]["name"],
                                                                 "grpo.adv_estimator.name")
        self.estimator = import_object(self.estimator_spec.estimator)(config["grpo"]["adv_estimator"], config)
        logger.info("previous-policy logprobs: %s", "from the training forward (one optimizer step per GRPO step)"
                    if self.on_policy_ratio else "a separate get_logprobs pass")
        self.env = build_environment(config)
        super().__init__(config, batch_size=prompts_per_batch(config["grpo"]), train_data=data.train,
                         with_generation=True)
        assert self.choice.generation is not None
        self.generation = Generation(config, self.choice.generation, self.policy)

    def step(self, prompts: Sequence[DatumSpec]) -> dict[str, float]:
        timer = PhaseTimer()
        groups, env_metrics = self.sample(prompts, timer)
        if self.cfg["use_dynamic_sampling"]:
            groups, env_metrics = self.dynamic_sampling(groups, env_metrics, timer)
        return self.train_on(groups, env_metrics, timer)

    def sample(self, prompts: Sequence[DatumSpec], timer: PhaseTimer) -> tuple[list[RolloutGroup], dict[str, float]]:
        """``group_size`` responses to each prompt, scored."""
        prompt_ids = repeat_prompts([d.prompt_ids for d in prompts], self.group_size)
        with timer("refit"):
            self.generation.prepare()  # refit if stale; colocated: the engines take the device
        with timer("generation"):
            rollouts = self.generation.generate(prompt_ids)
        with timer("hand_off"):
            self.generation.finish()  # colocated: the engines sleep, training takes the device back
        with timer("reward"):
            return self.score(prompts, rollouts)

    def dynamic_sampling(self, groups: list[RolloutGroup], env_metrics: dict[str, float],
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
            more, env_metrics = self.sample(self.train_loader.next_batch(), timer)
            batches, seen = batches + 1, seen + len(more)
            kept += [g for g in more if has_spread(g.task_rewards or g.rewards)]
        return kept[:need], {**env_metrics, "dynamic_sampling/num_gen_batches": float(batches),
                             "dynamic_sampling/kept_fraction": len(kept) / seen,
                             "dynamic_sampling/num_discarded_valid_groups": float(len(kept) - need)}

    def train_on(self, groups: Sequence[RolloutGroup], env_metrics: Mapping[str, float],
                 timer: PhaseTimer) -> dict[str, float]:
        """Group advantages, the policy's logprobs of what was sampled (unless the training forward
        gives them: ``on_policy_ratio``) and the reference's (with a KL penalty), the optimizer
        steps; the engines are stale afterwards. Returns the step's metrics."""
        prompt_ids = repeat_prompts([g.prompt.prompt_ids for g in groups], self.group_size)
        rollouts = merge_groups(groups)
        rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
        batch = self.training_batch(prompt_ids, rollouts)
        with timer("logprobs"):
            if not self.on_policy_ratio or "prev_logprobs" in self.estimator_spec.needs:
                batch.fields["prev_logprobs"] = self.policy.get_logprobs(batch)
            if self.config["loss_fn"]["reference_policy_kl_penalty"]:
                batch.fields["reference_logprobs"] = self.policy.get_reference_logprobs(batch)
        batch.fields["advantages"] = self.advantages(rewards, prompt_ids, batch, groups)
        with timer("training"):
            train_metrics = self.train(batch)
        self.generation.mark_stale()
        self.log_rollouts(groups)
        return {**self.rollout_metrics(rewards, rollouts, batch), **env_metrics,
                **{f"train/{k}": v for k, v in train_metrics.items()}, **timer.metrics(),
                "throughput/tokens_per_second": float(batch.input_lengths.sum()) / sum(timer.seconds.values())}

    # ------------------------------------------------------------------ pieces of a step

    def score(self, prompts: Sequence[DatumSpec], rollouts: GenerationOutput) -> tuple[list[RolloutGroup],
                                                                                        dict[str, float]]:
        """Rewards of ``rollouts`` (``group_size`` consecutive samples per prompt) in one call to
        the environment: the scored groups and the environment's metrics."""
        texts = self.tokenizer.batch_decode(rollouts.token_ids, skip_special_tokens=True)
        samples = [EnvSample(prompt=prompts[i // self.group_size].prompt_text, response=text,
                             metadata=prompts[i // self.group_size].metadata) for i, text in enumerate(texts)]
        result = self.env.score(samples)
        n = self.group_size
        groups = [self.scored_group(prompt, rollouts.slice(i * n, (i + 1) * n), result.slice(i * n, (i + 1) * n))
                  for i, prompt in enumerate(prompts)]
        return groups, {f"env/{k}": v for k, v in result.metrics.items()}

    def scored_group(self, prompt: DatumSpec, output: GenerationOutput, result: EnvResult) -> RolloutGroup:
        """One prompt's responses with the environment's rewards after ``grpo.reward_scaling`` and
        ``grpo.reward_shaping`` (the named rewards are scaled too, as NeMo RL does)."""
        scaling, shaping = self.cfg["reward_scaling"], self.cfg["reward_shaping"]
        task = scale_rewards(result.rewards, scaling)
        limit = shaping["max_response_length"] or self.config["policy"]["max_total_sequence_length"]
        shaped = shape_rewards(task, [len(ids) for ids in output.token_ids],
                               [reason == "length" for reason in output.finish_reasons], shaping, int(limit))
        return RolloutGroup(prompt=prompt, output=output, rewards=shaped, task_rewards=task,
                            components={k: scale_rewards(v, scaling) for k, v in result.components.items()})

    def log_rollouts(self, groups: Sequence[RolloutGroup]) -> None:
        """Every rollout of the step being trained to ``train_data_step<N>.jsonl`` (NeMo RL's file):
        prompt, response tokens, reward and the weight version that sampled it."""
        step = self.state.step + 1
        self.log.log_samples("train_data", step, [
            {"prompt_idx": g.prompt.idx, "prompt_token_ids": list(g.prompt.prompt_ids), "response_token_ids": ids,
             "reward": reward, "weight_version": g.output.weight_version}
            for g in groups for ids, reward in zip(g.output.token_ids, g.rewards)])

    def advantages(self, rewards: torch.Tensor, prompt_ids: list[list[int]], batch: TokenBatch,
                   groups: Sequence[RolloutGroup]) -> torch.Tensor:
        """The estimator's advantages per token (zero outside the responses), responses to identical
        prompts grouped together, clipped to ``grpo.advantage_clip_low/high``."""
        advantages = self.estimator(AdvantageInputs(rewards=rewards, group_ids=prompt_group_ids(prompt_ids), batch=batch,
                                                    reward_components=reward_components(groups)))
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        advantages = clip_advantages(advantages, self.cfg["advantage_clip_low"], self.cfg["advantage_clip_high"])
        return advantages.to(torch.float32) * batch.fields["token_mask"]

    def training_batch(self, prompt_ids: list[list[int]], rollouts: GenerationOutput) -> TokenBatch:
        batch = rollout_batch(prompt_ids, rollouts, pad_token_id=self.tokenizer.pad_token_id,
                              max_total_length=self.config["policy"]["max_total_sequence_length"])
        # Overlong filtering: a response cut at the length limit says nothing about its answer.
        truncated = batch.fields["truncated"]
        batch.fields["sample_mask"] = 1.0 - truncated if self.cfg["overlong_filtering"] else torch.ones_like(truncated)
        return batch

    def train(self, batch: TokenBatch) -> dict[str, float]:
        """One optimizer step per ``policy.train_global_batch_size`` rollouts (NeMo RL's
        semantics: one step's rollouts may feed several optimizer steps); metrics averaged."""
        size = int(self.config["policy"]["train_global_batch_size"])
        results = [self.policy.train(batch.select(list(range(start, start + size))), self.loss_fn)
                   for start in range(0, batch.size, size)]
        return {key: sum(r[key] for r in results) / len(results) for key in results[0]}

    def validate(self, step: int) -> dict[str, float]:
        """Greedy answers to the validation prompts, scored by the environment; every answer is
        written to ``val_data_step<step>.jsonl`` in the log directory (NeMo RL's file)."""
        if not self.val_data:
            return {}
        self.generation.prepare()
        rewards: list[float] = []
        samples: list[dict[str, Any]] = []
        size = int(self.cfg["val_batch_size"])
        for start in range(0, len(self.val_data), size):
            chunk = self.val_data[start:start + size]
            out = self.generation.generate([d.prompt_ids for d in chunk], greedy=True)
            texts = self.tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
            result = self.env.score([EnvSample(prompt=d.prompt_text, response=t, metadata=d.metadata)
                                     for d, t in zip(chunk, texts)])
            rewards.extend(result.rewards)
            samples.extend({"prompt": d.prompt_text, "response": text, "reward": reward,
                            "prompt_token_ids": list(d.prompt_ids), "response_token_ids": ids,
                            "weight_version": out.weight_version}
                           for d, text, reward, ids in zip(chunk, texts, result.rewards, out.token_ids))
        self.generation.finish()
        self.log.log_samples("val_data", step, samples)
        return {"val/reward": sum(rewards) / len(rewards), "val/accuracy": sum(r > 0 for r in rewards) / len(rewards)}

    @staticmethod
    def rollout_metrics(rewards: torch.Tensor, rollouts: GenerationOutput, batch: TokenBatch) -> dict[str, float]:
        return {"train/reward": float(rewards.mean()),
                "train/response_length": float(batch.fields["response_lengths"].mean()),
                "train/truncated_fraction": float(batch.fields["truncated"].mean()),
                "train/weight_version": float(rollouts.weight_version)}

    # ------------------------------------------------------------------ state beyond the policy

    def extra_state(self) -> dict[str, Any]:
        return {"generation": self.generation.sampling_states(), "generation_stale": self.generation.stale,
                "grpo_semantics": GRPO_SEMANTICS_VERSION}

    def restore_extra_state(self, info: Mapping[str, Any]) -> None:
        """The engines started from the HF checkpoint: load the restored policy's weights into them
        now, then put back their sampling position and weight label and whether the saved run
        would have refit before its next step, so the resumed run continues exactly."""
        warn_if_other_semantics(info)
        self.generation.load_policy_weights()
        self.generation.load_sampling_states(info.get("generation", []))
        self.generation.stale = bool(info.get("generation_stale", True))

    def shutdown(self) -> None:
        try:
            self.generation.shutdown()
            self.env.shutdown()
        finally:
            super().shutdown()


def prompts_per_batch(grpo: Mapping[str, Any]) -> int:
    """Prompts per generation batch: ``num_prompts_per_step``, times ``batch_multiplier`` with
    dynamic sampling (which draws batches until enough prompts have a signal)."""
    multiplier = float(grpo["batch_multiplier"]) if grpo["use_dynamic_sampling"] else 1.0
    return int(grpo["num_prompts_per_step"] * multiplier)


def prompt_limits(config: Mapping[str, Any]) -> LengthLimits:
    """Prompts must leave the engine room for one generated token within the sequence limit:
    ``policy.max_total_sequence_length``, or the engine's ``max_model_len`` when that is lower."""
    policy = config["policy"]
    limit, key = int(policy["max_total_sequence_length"]), "policy.max_total_sequence_length"
    spec = get_plugin_manager().generation_backends().get(policy["generation"]["backend"], "policy.generation.backend")
    engine_limit = (policy["generation"].get(spec.config_key) or {}).get("max_model_len")
    if engine_limit is not None and int(engine_limit) < limit:
        limit, key = int(engine_limit), f"policy.generation.{spec.config_key}.max_model_len"
    return LengthLimits(prompt=limit - 1, prompt_key=key)


def warn_if_other_semantics(info: Mapping[str, Any]) -> None:
    """Once, when a resumed checkpoint was written under other loss and advantage semantics: its
    run trained with them, this one continues with the current ones (docs/changelog.md)."""
    written = int(info.get("grpo_semantics", 1))
    if written != GRPO_SEMANTICS_VERSION:
        logger.warning("this checkpoint was written under GRPO semantics version %d (nrl before NeMo RL parity); the "
                       "resumed run trains with version %d: leave-one-out advantages divide by the other responses' "
                       "std, the KL term carries its score-function gradient, GSPO weights whole sequences; see "
                       "docs/changelog.md", written, GRPO_SEMANTICS_VERSION)


def _warn_truncated_sampling(generation: Mapping[str, Any]) -> None:
    """The policy's logprobs follow the sampling temperature but not top-p/top-k truncation, which
    vLLM's reported logprobs do: say so rather than let the importance ratios drift unexplained."""
    top_k = generation.get("top_k")
    if generation["top_p"] < 1 or (top_k is not None and top_k > 0):
        logger.warning("policy.generation.top_p/top_k truncate sampling: vLLM reports logprobs renormalised over "
                       "the kept tokens, the policy over the whole vocabulary, so train/token_mult_prob_error "
                       "will exceed 1; set top_p: 1.0 and top_k: null for exact importance ratios")


def main(config: Mapping[str, Any]) -> int:
    """``nrl train grpo``: the synchronous loop, or the asynchronous one with ``grpo.async_grpo.enabled``."""
    if config["grpo"]["async_grpo"]["enabled"]:
        from nrl_core.algorithms.async_grpo import AsyncGRPO

        return AsyncGRPO.main(config)
    return GRPO.main(config)
