"""PPO with a value model (NeMo RL's ``ppo``): the policy samples, a critic values every response
token, GAE turns rewards and values into advantages for the policy and returns for the critic, and
both train for ``ppo.ppo_epochs`` passes over the step's rollouts.

One step: prompts -> responses (refit first if stale) -> rewards (scaled and shaped as GRPO's) ->
the critic's values and the policy's logprobs of what was sampled -> advantages and returns
(:mod:`nrl_algo_ppo.gae`) -> ``ppo_epochs`` x (the critic's optimizer steps on
:class:`~nrl_algo_ppo.loss.ClippedValueLoss`, then the policy's on the configured clipped
policy-gradient loss; the policy waits ``policy_training_start_step`` steps while the critic warms
up). The critic is a second training group built from the ``value`` section on the policy's
devices; the two take turns on them. Checkpoints hold both (``policy/`` and ``value/``).

With ``ppo.async_ppo.enabled`` the rollouts come from the core's trajectory collector, as async
GRPO's do (:mod:`nrl_core.algorithms.async_rollouts`): generation runs ahead by at most
``max_trajectory_age_steps`` weight versions, and values and logprobs are computed when a step
takes its rollouts, as in NeMo RL.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from nrl_algo_ppo.config import check_ppo, critic_config, uses_reference_policy
from nrl_algo_ppo.gae import GAEConfig, advantages_and_returns, explained_variance, terminal_rewards, token_values
from nrl_algo_ppo.loss import OLD_VALUES, RETURNS, ClippedValueLoss
from nrl_core.api import (
    AlgorithmRun,
    AsyncRollouts,
    DatumSpec,
    Generation,
    PhaseTimer,
    Policy,
    RewardKL,
    RolloutBatch,
    RolloutGroup,
    Runtime,
    Scorer,
    SingleTurnSampler,
    TokenBatch,
    build_environment,
    build_loss,
    choose_backends,
    env_metrics,
    load_tokenizer,
    merge_groups,
    prepare_data,
    prompt_limits,
    repeat_prompts,
    rollout_batch,
    validates_greedily,
)

logger = logging.getLogger(__name__)


class PPO(AlgorithmRun):
    section = "ppo"
    summary_prefixes = ("val/", "train/reward", "train/critic/explained_var")

    def __init__(self, config: Mapping[str, Any], *, runtime: Runtime | None = None) -> None:
        check_ppo(config)
        cfg = config["ppo"]
        self.group_size = int(cfg["num_generations_per_prompt"])
        self.tokenizer = load_tokenizer(config)
        data = prepare_data(config["data"], self.tokenizer, limits=prompt_limits(config))
        self.val_data: list[DatumSpec] = (data.val or [])[: cfg["max_val_samples"]]
        # several optimizer steps per rollout: the ratio needs the logprobs the step began with
        self.loss_fn = build_loss(config, force_on_policy_ratio=False)
        self.value_loss = ClippedValueLoss.from_config(config["value_loss_fn"])
        self.gae = GAEConfig.from_section(cfg["adv_estimator"])
        self.reward_kl = RewardKL(config["loss_fn"])
        self.env = build_environment(config)
        super().__init__(config, batch_size=int(cfg["num_prompts_per_step"]), train_data=data.train,
                         with_generation=True, runtime=runtime)
        critic = critic_config(config)
        self.critic = Policy(critic, choose_backends(critic, generation=False).training, colocated_generation=False,
                             beside=self.policy, name="value")
        self.critic_turn_over()
        assert self.choice.generation is not None
        self.generation = Generation(config, self.choice.generation, self.policy)
        self.sampler = SingleTurnSampler(self.generation, Scorer(config, self.tokenizer, self.env, section="ppo"),
                                         self.group_size, int(cfg["val_batch_size"]),
                                         val_greedy=validates_greedily(config["policy"]["generation"]))
        age = cfg["async_ppo"]
        self.rollouts = AsyncRollouts(self.sampler, self.train_loader, self.generation,
                                      prompts_per_step=int(cfg["num_prompts_per_step"]),
                                      max_age=int(age["max_trajectory_age_steps"]), last_step=self.max_steps,
                                      age_key="ppo.async_ppo.max_trajectory_age_steps",
                                      in_flight=bool(age["in_flight_weight_updates"]),
                                      recompute_kv_cache=bool(age["recompute_kv_cache_after_weight_updates"]),
                                      ) if age["enabled"] else None

    def trained_models(self) -> dict[str, Policy]:
        return {"policy": self.policy, "value": self.critic}

    @contextlib.contextmanager
    def on_devices(self, name: str) -> Iterator[None]:
        """The critic is saved and restored on its devices, then leaves them to the policy again."""
        if name != "value":
            yield
            return
        self.policy_turn_over()
        try:
            yield
        finally:
            self.critic_turn_over()

    # ------------------------------------------------------------------ one step

    def start(self) -> None:
        if self.rollouts is not None:
            self.rollouts.start(self.state.step + 1)

    def step_data(self, step: int) -> Any:
        """The step's prompts, or with ``async_ppo`` its rollouts from the collector."""
        return self.rollouts.batch_for(step) if self.rollouts is not None else super().step_data(step)

    def step(self, data: Sequence[DatumSpec] | RolloutBatch) -> dict[str, float]:
        if isinstance(data, RolloutBatch):
            groups, timer, metrics = data.groups, data.timer, dict(data.metrics)
        else:
            timer = PhaseTimer()
            groups, result = self.sampler.sample(data, timer)
            metrics = env_metrics(result)
        metrics.update(self.train_on(groups, timer))
        if isinstance(data, RolloutBatch):
            metrics.update(self.rollouts.after_step(data))  # the collector's refit
        return {**metrics, **timer.metrics()}

    def train_on(self, groups: Sequence[RolloutGroup], timer: PhaseTimer) -> dict[str, float]:
        """Values, logprobs, advantages and the ``ppo_epochs`` passes over ``groups``."""
        rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
        batch = self.rollouts_batch(groups)
        with timer("values"):
            batch.fields[OLD_VALUES] = self.values(batch)
        with timer("logprobs"):
            batch.fields["prev_logprobs"] = self.policy.get_logprobs(batch)
            if uses_reference_policy(self.config):
                batch.fields["reference_logprobs"] = self.policy.get_reference_logprobs(batch)
        metrics = self.mask_mismatched(batch)
        mask = batch.fields["token_mask"] * batch.fields["sample_mask"].unsqueeze(1)
        if bool((mask > 0).any()):
            token_rewards = terminal_rewards(rewards, mask) - self.reward_kl(batch.fields)
            advantages, returns = advantages_and_returns(token_rewards, batch.fields[OLD_VALUES], mask, self.gae)
            batch.fields["advantages"], batch.fields[RETURNS] = advantages.float(), returns.float()
            metrics.update(self.advantage_metrics(batch, mask))
            with timer("training"):
                metrics.update(self.train(batch,
                                          train_policy=self.state.step >= int(self.cfg["policy_training_start_step"])))
        else:  # NeMo RL's loss is zero here and its step changes nothing the gradients drive: skipped
            logger.warning("PPO step %d: every response was filtered out (ppo.overlong_filtering, "
                           "ppo.seq_logprob_error_threshold), so this step trains neither model", self.state.step + 1)
        return {"train/reward": float(rewards.mean()),
                "train/response_length": float(batch.fields["response_lengths"].mean()),
                "train/truncated_fraction": float(batch.fields["truncated"].mean()),
                "train/weight_version": float(min(g.output.weight_version for g in groups)), **metrics}

    def rollouts_batch(self, groups: Sequence[RolloutGroup]) -> TokenBatch:
        prompt_ids = repeat_prompts([g.prompt.prompt_ids for g in groups], self.group_size)
        batch = rollout_batch(prompt_ids, merge_groups(groups), pad_token_id=self.tokenizer.pad_token_id,
                              max_total_length=self.config["policy"]["max_total_sequence_length"])
        truncated = batch.fields["truncated"]  # a response cut at the limit says nothing about its answer
        batch.fields["sample_mask"] = 1.0 - truncated if self.cfg["overlong_filtering"] else torch.ones_like(truncated)
        return batch

    def values(self, batch: TokenBatch) -> torch.Tensor:
        """The critic's value of the state each token was sampled in, ``[B, T]``."""
        self.policy_turn_over()
        try:
            return token_values(self.critic.get_values(batch))
        finally:
            self.critic_turn_over()

    def mask_mismatched(self, batch: TokenBatch) -> dict[str, float]:
        """Each response's mean ``exp|generation - policy logprob|`` (1: the engine and the policy
        agree); above ``ppo.seq_logprob_error_threshold`` a response trains neither model."""
        mask = batch.fields["token_mask"]
        gap = (batch.fields["generation_logprobs"] - batch.fields["prev_logprobs"]).abs().exp()
        error = (gap * mask).sum(1) / mask.sum(1).clamp_min(1)
        counted = (batch.fields["sample_mask"] > 0) & (mask.sum(1) > 0)  # as NeMo RL: valid responses only
        metrics = {"train/mean_seq_mult_prob_error": float(error[counted].mean()) if bool(counted.any()) else 1.0}
        threshold = self.cfg["seq_logprob_error_threshold"]
        if threshold is not None:
            keep = (error <= float(threshold)).float()
            metrics["train/num_masked_seqs_by_logprob_error"] = float((batch.fields["sample_mask"] * (1 - keep)).sum())
            batch.fields["sample_mask"] = batch.fields["sample_mask"] * keep
        return metrics

    @staticmethod
    def advantage_metrics(batch: TokenBatch, mask: torch.Tensor) -> dict[str, float]:
        """The step's advantages and how much of the returns' variance the critic explained before
        training on them."""
        valid = mask > 0
        advantages, returns = batch.fields["advantages"][valid], batch.fields[RETURNS][valid]
        if not len(advantages):
            return {}
        return {"train/advantages/mean": float(advantages.mean()), "train/advantages/min": float(advantages.min()),
                "train/advantages/max": float(advantages.max()), "train/returns_mean": float(returns.mean()),
                "train/critic/explained_var": explained_variance(batch.fields[RETURNS], batch.fields[OLD_VALUES],
                                                                 mask)}

    def train(self, batch: TokenBatch, *, train_policy: bool) -> dict[str, float]:
        """``ppo_epochs`` passes, each the critic's optimizer steps then the policy's (once it
        trains); metrics of the last pass, as NeMo RL logs them."""
        critic: dict[str, float] = {}
        policy: dict[str, float] = {}
        for _ in range(int(self.cfg["ppo_epochs"])):
            self.policy_turn_over()
            critic = self.critic.train_steps(batch, self.value_loss, int(self.config["value"]["train_global_batch_size"]))
            self.critic_turn_over()
            if train_policy:
                policy = self.policy.train_steps(batch, self.loss_fn,
                                                 int(self.config["policy"]["train_global_batch_size"]))
        if train_policy or self.rollouts is not None:
            # asynchronous: the engines take a new weight version every step, trained or not (the
            # collector's staleness bound counts versions), as NeMo RL's do during critic warm-up
            self.generation.mark_stale()
        return {**{f"train/critic/{k}": v for k, v in critic.items()}, **{f"train/{k}": v for k, v in policy.items()}}

    # ------------------------------------------------------------------ the two models on one set of devices

    def policy_turn_over(self) -> None:
        """The policy's optimizer state and weights leave the devices; the critic's come back."""
        self.policy.offload_before_refit()
        self.policy.offload_after_refit()
        self.critic.prepare_for_training()

    def critic_turn_over(self) -> None:
        """The critic leaves the devices (how a step begins: generation and the policy use them)."""
        self.critic.offload_before_refit()
        self.critic.offload_after_refit()
        self.policy.prepare_for_training()

    # ------------------------------------------------------------------ validation and state

    def validate(self, step: int) -> dict[str, float]:
        """The held-out prompts decoded by the policy and scored by the environment (every one
        written to ``val_data_step<step>.jsonl``)."""
        if not self.val_data:
            return {}
        with self.rollouts.engines() if self.rollouts is not None else contextlib.nullcontext():
            rewards, records = self.sampler.validate(self.val_data)
        self.log.log_samples("val_data", step, records)
        return {"val/reward": sum(rewards) / len(rewards), "val/accuracy": sum(r > 0 for r in rewards) / len(rewards)}

    def extra_state(self) -> dict[str, Any]:
        return {"generation": self.generation.sampling_states(), "generation_stale": self.generation.stale}

    def restore_extra_state(self, info: Mapping[str, Any]) -> None:
        """The engines started from the HF checkpoint: the restored policy's weights go into them,
        then their sampling position, so a resumed run continues exactly."""
        self.generation.load_policy_weights()
        self.generation.load_sampling_states(info.get("generation", []))
        self.generation.stale = bool(info.get("generation_stale", True))

    def dataloader_state(self) -> dict[str, Any]:
        """Asynchronous: the position of the next step's prompts (what the collector drew beyond
        them is regenerated after a resume, as in async GRPO)."""
        if self.rollouts is not None:
            return self.rollouts.dataloader_state(self.state.step + 1)
        return super().dataloader_state()

    def shutdown(self) -> None:
        try:
            if getattr(self, "rollouts", None) is not None:
                self.rollouts.stop()
            for part in ("generation", "env", "critic"):  # a run that failed to build lacks the later ones
                if hasattr(self, part):
                    getattr(self, part).shutdown()
        finally:
            super().shutdown()


def main(config: Mapping[str, Any], runtime: Runtime | None = None) -> int:
    """``nrl train ppo``."""
    return PPO.main(config, runtime)
