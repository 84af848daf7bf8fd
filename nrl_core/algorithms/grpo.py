"""Group Relative Policy Optimization, with NeMo RL's configuration semantics.

One step: the rollout source hands over the step's scored groups (sampled now, or by a collector
running ahead: :mod:`nrl_core.algorithms.rollout_sources`), then group-relative advantages, the
policy's and the reference's logprobs of what was sampled, and the clipped policy-gradient loss;
the loop in :class:`~nrl_core.algorithms.base.AlgorithmRun` then logs, validates and checkpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nrl_core.algorithms.advantages import clip_advantages, prompt_group_ids
from nrl_core.algorithms.async_rollouts import AsyncRollouts
from nrl_core.algorithms.base import AlgorithmRun
from nrl_core.algorithms.generation import Generation
from nrl_core.algorithms.grpo_config import check_grpo, on_policy_ratio, uses_reference_policy
from nrl_core.algorithms.loss import GRPO_SEMANTICS_VERSION
from nrl_core.algorithms.multi_turn import MultiTurnSampler
from nrl_core.algorithms.rollout_sources import (
    RolloutBatch,
    RolloutSource,
    Sampler,
    SingleTurnSampler,
    SyncRollouts,
    validates_greedily,
)
from nrl_core.algorithms.rollouts import repeat_prompts, rollout_batch
from nrl_core.algorithms.runtime import Runtime
from nrl_core.algorithms.scoring import RolloutGroup, Scorer, merge_groups, merged_loss_masks, reward_components
from nrl_core.algorithms.setup import PhaseTimer, build_environment, build_loss, generation_spec, load_tokenizer
from nrl_core.contracts import AdvantageInputs, GenerationOutput, TokenBatch, import_object
from nrl_core.data import DatumSpec, LengthLimits, prepare_data
from nrl_core.plugin_faults import call_plugin, plugin_answer_error
from nrl_core.plugins import get_plugin_manager

logger = logging.getLogger(__name__)


class GRPO(AlgorithmRun):
    section = "grpo"
    summary_prefixes = ("val/", "train/reward")

    def __init__(self, config: Mapping[str, Any], *, runtime: Runtime | None = None) -> None:
        check_grpo(config)  # done by validation too; a config built in code may have skipped it
        _warn_truncated_sampling(config["policy"]["generation"])
        self.group_size = int(config["grpo"]["num_generations_per_prompt"])
        self.tokenizer = load_tokenizer(config)
        runtime = runtime if runtime is not None else Runtime.for_process()
        data = prepare_data(config["data"], self.tokenizer, runtime.plugins, limits=prompt_limits(config))
        self.val_data: list[DatumSpec] = (data.val or [])[: config["grpo"]["max_val_samples"]]
        self.on_policy_ratio = on_policy_ratio(config)
        self.uses_reference = uses_reference_policy(config)  # as the spec told the policy's workers
        self.loss_fn = build_loss(config, force_on_policy_ratio=self.on_policy_ratio)
        estimators, name = get_plugin_manager().advantage_estimators(), config["grpo"]["adv_estimator"]["name"]
        self.estimator_spec = estimators.get(name, "grpo.adv_estimator.name")
        self.estimator_owner = estimators.plugin_owner(name)
        estimator_class = import_object(self.estimator_spec.estimator)
        self.estimator = call_plugin(self.estimator_owner, f"{estimator_class.__name__}.__init__",
                                     config["logger"]["log_dir"], estimator_class, config["grpo"]["adv_estimator"],
                                     config)
        logger.info("advantage estimator: %s, from %s", name, self.estimator_spec.distribution)
        logger.info("previous-policy logprobs: %s", "from the training forward (one optimizer step per GRPO step)"
                    if self.on_policy_ratio else "a separate get_logprobs pass")
        self.env = build_environment(config)
        super().__init__(config, batch_size=prompts_per_batch(config["grpo"]), train_data=data.train,
                         with_generation=True, runtime=runtime)
        assert self.choice.generation is not None
        self.generation = Generation(config, self.choice.generation, self.policy)
        self.scorer = Scorer(config, self.tokenizer, self.env)
        self.sampler = self.make_sampler()
        self.rollouts = self.make_rollout_source()

    def make_sampler(self) -> Sampler:
        """Multi-turn episodes with an environment that talks back, else one response per sample."""
        env_spec = get_plugin_manager().environments().get(self.config["data"]["env_name"], "data.env_name")
        if env_spec.multi_turn:
            return MultiTurnSampler(self.config, self.generation, self.scorer, self.tokenizer, self.env,
                                    max_length=prompt_limits(self.config).prompt + 1)
        return SingleTurnSampler(self.generation, self.scorer, self.group_size, int(self.cfg["val_batch_size"]),
                                 val_greedy=validates_greedily(self.config["policy"]["generation"]))

    def make_rollout_source(self) -> RolloutSource:
        """Asynchronous with ``grpo.async_grpo.enabled``, else synchronous; either feeds the same loop."""
        if self.cfg["async_grpo"]["enabled"]:
            age = self.cfg["async_grpo"]
            return AsyncRollouts(self.sampler, self.train_loader, self.generation,
                                 prompts_per_step=int(self.cfg["num_prompts_per_step"]),
                                 max_age=int(age["max_trajectory_age_steps"]), last_step=self.max_steps,
                                 in_flight=bool(age["in_flight_weight_updates"]),
                                 recompute_kv_cache=bool(age["recompute_kv_cache_after_weight_updates"]))
        return SyncRollouts(self.sampler, self.train_loader, self.cfg)

    def start(self) -> None:
        self.rollouts.start(self.state.step + 1)

    def step_data(self, step: int) -> RolloutBatch:
        return self.rollouts.batch_for(step)

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        metrics = self.train_on(batch.groups, batch.metrics, batch.timer)
        metrics.update(self.rollouts.after_step(batch))
        return metrics

    def train_on(self, groups: Sequence[RolloutGroup], env_metrics: Mapping[str, float],
                 timer: PhaseTimer) -> dict[str, float]:
        """Group advantages, the policy's logprobs of what was sampled (unless the training forward
        gives them: ``on_policy_ratio``) and the reference's (with a KL penalty), the optimizer
        steps; the engines are stale afterwards. Returns the step's metrics."""
        prompt_ids = repeat_prompts([g.prompt.prompt_ids for g in groups], self.group_size)
        rollouts = merge_groups(groups)
        rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
        batch = self.training_batch(prompt_ids, rollouts, merged_loss_masks(groups))
        with timer("logprobs"):
            if not self.on_policy_ratio or "prev_logprobs" in self.estimator_spec.needs:
                batch.fields["prev_logprobs"] = self.policy.get_logprobs(batch)
            if self.uses_reference:
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

    def log_rollouts(self, groups: Sequence[RolloutGroup]) -> None:
        """Every rollout of the step being trained to ``train_data_step<N>.jsonl`` (NeMo RL's file):
        prompt, response tokens, reward, the weight version that sampled it (its oldest token's),
        each token's version when a refit reached it mid-generation (``token_weight_versions``) and
        what the environment said about it (``metadata``, when it says anything)."""
        step = self.state.step + 1
        self.log.log_samples("train_data", step, [
            {"prompt_idx": g.prompt.idx, "prompt_token_ids": list(g.prompt.prompt_ids), "response_token_ids": ids,
             "reward": reward, "weight_version": g.output.weight_version,
             **_mixed_versions(g.output.versions_of(i)),
             **({"metadata": g.metadata[i]} if g.metadata is not None else {})}
            for g in groups for i, (ids, reward) in enumerate(zip(g.output.token_ids, g.rewards))])

    def advantages(self, rewards: torch.Tensor, prompt_ids: list[list[int]], batch: TokenBatch,
                   groups: Sequence[RolloutGroup]) -> torch.Tensor:
        """The estimator's advantages per token (zero outside the responses), responses to identical
        prompts grouped together, clipped to ``grpo.advantage_clip_low/high``."""
        inputs = AdvantageInputs(rewards=rewards, group_ids=prompt_group_ids(prompt_ids), batch=batch,
                                 reward_components=reward_components(groups))
        method = f"{type(self.estimator).__name__}.__call__"
        advantages = call_plugin(self.estimator_owner, method, self.config["logger"]["log_dir"], self.estimator, inputs)
        tokens = tuple(batch.fields["token_mask"].shape)
        shapes = (tokens[:1], (tokens[0], 1), tokens)  # per response, or per token
        if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) not in shapes:
            got = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
            raise plugin_answer_error(self.estimator_owner, method, f"returned {got} for a batch of shape {tokens}; "
                                      f"it must return one advantage per response {tokens[:1]} or per token {tokens}")
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        advantages = clip_advantages(advantages, self.cfg["advantage_clip_low"], self.cfg["advantage_clip_high"])
        return advantages.to(torch.float32) * batch.fields["token_mask"]

    def training_batch(self, prompt_ids: list[list[int]], rollouts: GenerationOutput,
                       loss_masks: list[list[float]] | None = None) -> TokenBatch:
        batch = rollout_batch(prompt_ids, rollouts, pad_token_id=self.tokenizer.pad_token_id,
                              max_total_length=self.config["policy"]["max_total_sequence_length"],
                              loss_masks=loss_masks)
        # Overlong filtering: a response cut at the length limit says nothing about its answer.
        truncated = batch.fields["truncated"]
        batch.fields["sample_mask"] = 1.0 - truncated if self.cfg["overlong_filtering"] else torch.ones_like(truncated)
        return batch

    def train(self, batch: TokenBatch) -> dict[str, float]:
        """One optimizer step per ``policy.train_global_batch_size`` rollouts (NeMo RL's
        semantics: one step's rollouts may feed several optimizer steps); metrics averaged."""
        return self.policy.train_steps(batch, self.loss_fn, int(self.config["policy"]["train_global_batch_size"]))

    def validate(self, step: int) -> dict[str, float]:
        """Greedy rollouts of the validation prompts, scored by the environment; every one is
        written to ``val_data_step<step>.jsonl`` in the log directory (NeMo RL's file)."""
        if not self.val_data:
            return {}
        with self.rollouts.engines():
            rewards, records = self.sampler.validate(self.val_data)
        self.log.log_samples("val_data", step, records)
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

    def dataloader_state(self) -> dict[str, Any]:
        return self.rollouts.dataloader_state(self.state.step + 1)

    def shutdown(self) -> None:
        try:
            rollouts = getattr(self, "rollouts", None)
            if rollouts is not None:
                rollouts.stop()
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
    spec = generation_spec(config)
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


def main(config: Mapping[str, Any], runtime: Runtime | None = None) -> int:
    """``nrl train grpo``: synchronous, or asynchronous with ``grpo.async_grpo.enabled`` (the same loop)."""
    return GRPO.main(config, runtime)


def _mixed_versions(versions: list[int]) -> dict[str, list[int]]:
    """``token_weight_versions`` for a response sampled under several weight versions; nothing otherwise."""
    return {"token_weight_versions": versions} if len(set(versions)) > 1 else {}
