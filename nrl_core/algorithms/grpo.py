"""Group Relative Policy Optimization, with NeMo RL's configuration semantics.

One step: refit the engines if stale, generate ``num_generations_per_prompt`` responses per
prompt, score them, compute group-relative advantages, compute the policy's and the reference's
logprobs of what was sampled, train with the clipped policy-gradient loss; the loop in
:class:`~nrl_core.algorithms.base.AlgorithmRun` then logs, validates and checkpoints.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch

from nrl_core.algorithms.advantages import group_advantages
from nrl_core.algorithms.base import AlgorithmRun
from nrl_core.algorithms.generation import Generation
from nrl_core.algorithms.loss import ClippedPGLoss
from nrl_core.algorithms.rollouts import repeat_prompts, rollout_batch
from nrl_core.algorithms.setup import PhaseTimer, build_environment, load_tokenizer
from nrl_core.contracts import EnvSample, GenerationOutput, TokenBatch
from nrl_core.data import DatumSpec, prepare_data
from nrl_core.errors import ConfigError

logger = logging.getLogger(__name__)


class GRPO(AlgorithmRun):
    section = "grpo"
    summary_prefixes = ("val/", "train/reward")

    def __init__(self, config: Mapping[str, Any]) -> None:
        if config["policy"]["generation"] is None:
            raise ConfigError("policy.generation", "GRPO generates rollouts; configure a generation backend")
        _check_batch_sizes(config)
        _warn_truncated_sampling(config["policy"]["generation"])
        self.group_size = int(config["grpo"]["num_generations_per_prompt"])
        self.tokenizer = load_tokenizer(config)
        data = prepare_data(config["data"], self.tokenizer)
        self.val_data: list[DatumSpec] = (data.val or [])[: config["grpo"]["max_val_samples"]]
        self.loss_fn = ClippedPGLoss.from_config(config["loss_fn"])
        self.env = build_environment(config)
        super().__init__(config, batch_size=int(config["grpo"]["num_prompts_per_step"]), train_data=data.train,
                         colocated_generation=bool(config["policy"]["generation"]["colocated"]["enabled"]),
                         with_generation=True)
        assert self.choice.generation is not None
        self.generation = Generation(config, self.choice.generation, self.policy)

    def step(self, prompts: Sequence[DatumSpec]) -> dict[str, float]:
        timer = PhaseTimer()
        with timer("refit"):
            self.generation.refresh()
        prompt_ids = repeat_prompts([d.prompt_ids for d in prompts], self.group_size)
        with timer("generation"):
            rollouts = self.generation.generate(prompt_ids)
        with timer("reward"):
            rewards, env_metrics = self.score(prompts, rollouts)
        advantages = group_advantages(rewards, self.group_size, leave_one_out=self.cfg["use_leave_one_out_baseline"],
                                      normalize=self.cfg["normalize_rewards"])
        batch = self.training_batch(prompt_ids, rollouts, advantages)
        with timer("logprobs"):
            batch.fields["prev_logprobs"] = self.policy.get_logprobs(batch)
            batch.fields["reference_logprobs"] = (self.policy.get_reference_logprobs(batch)
                                                  if self.loss_fn.reference_policy_kl_penalty
                                                  else batch.fields["prev_logprobs"])
        with timer("training"):
            train_metrics = self.train(batch)
        self.generation.mark_stale()
        return {**self.rollout_metrics(rewards, rollouts, batch), **env_metrics,
                **{f"train/{k}": v for k, v in train_metrics.items()}, **timer.metrics(),
                "throughput/tokens_per_second": float(batch.input_lengths.sum()) / sum(timer.seconds.values())}

    # ------------------------------------------------------------------ pieces of a step

    def score(self, prompts: Sequence[DatumSpec], rollouts: GenerationOutput) -> tuple[torch.Tensor, dict[str, float]]:
        texts = self.tokenizer.batch_decode(rollouts.token_ids, skip_special_tokens=True)
        samples = [EnvSample(prompt=prompts[i // self.group_size].prompt_text, response=text,
                             metadata=prompts[i // self.group_size].metadata) for i, text in enumerate(texts)]
        result = self.env.score(samples)
        return torch.tensor(result.rewards, dtype=torch.float32), {f"env/{k}": v for k, v in result.metrics.items()}

    def training_batch(self, prompt_ids: list[list[int]], rollouts: GenerationOutput,
                       advantages: torch.Tensor) -> TokenBatch:
        batch = rollout_batch(prompt_ids, rollouts, pad_token_id=self.tokenizer.pad_token_id,
                              max_total_length=self.config["policy"]["max_total_sequence_length"])
        batch.fields["advantages"] = advantages.unsqueeze(1) * batch.fields["token_mask"]
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

    def validate(self) -> dict[str, float]:
        """Greedy answers to the validation prompts, scored by the environment."""
        if not self.val_data:
            return {}
        self.generation.refresh()
        rewards: list[float] = []
        size = int(self.cfg["val_batch_size"])
        for start in range(0, len(self.val_data), size):
            chunk = self.val_data[start:start + size]
            out = self.generation.generate([d.prompt_ids for d in chunk], greedy=True)
            texts = self.tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
            result = self.env.score([EnvSample(prompt=d.prompt_text, response=t, metadata=d.metadata)
                                     for d, t in zip(chunk, texts)])
            rewards.extend(result.rewards)
        return {"val/reward": sum(rewards) / len(rewards), "val/accuracy": sum(r > 0 for r in rewards) / len(rewards)}

    @staticmethod
    def rollout_metrics(rewards: torch.Tensor, rollouts: GenerationOutput, batch: TokenBatch) -> dict[str, float]:
        return {"train/reward": float(rewards.mean()),
                "train/response_length": float(batch.fields["response_lengths"].mean()),
                "train/truncated_fraction": float(batch.fields["truncated"].mean()),
                "train/weight_version": float(rollouts.weight_version)}

    # ------------------------------------------------------------------ state beyond the policy

    def extra_state(self) -> dict[str, Any]:
        return {"generation": self.generation.sampling_states(), "generation_stale": self.generation.stale}

    def restore_extra_state(self, info: Mapping[str, Any]) -> None:
        """The engines started from the HF checkpoint: load the restored policy's weights into them
        now, then put back their sampling position and weight label and whether the saved run
        would have refit before its next step, so the resumed run continues exactly."""
        self.generation.update_weights()
        self.generation.load_sampling_states(info.get("generation", []))
        self.generation.stale = bool(info.get("generation_stale", True))

    def shutdown(self) -> None:
        try:
            self.generation.shutdown()
            self.env.shutdown()
        finally:
            super().shutdown()


def _check_batch_sizes(config: Mapping[str, Any]) -> None:
    grpo, policy = config["grpo"], config["policy"]
    rollouts = grpo["num_prompts_per_step"] * grpo["num_generations_per_prompt"]
    if rollouts % policy["train_global_batch_size"]:
        raise ConfigError("policy.train_global_batch_size",
                          f"{policy['train_global_batch_size']} does not divide the {rollouts} rollouts per step "
                          f"(grpo.num_prompts_per_step x num_generations_per_prompt); make it a divisor")



def _warn_truncated_sampling(generation: Mapping[str, Any]) -> None:
    """The policy's logprobs follow the sampling temperature but not top-p/top-k truncation, which
    vLLM's reported logprobs do: say so rather than let the importance ratios drift unexplained."""
    top_k = generation.get("top_k")
    if generation["top_p"] < 1 or (top_k is not None and top_k > 0):
        logger.warning("policy.generation.top_p/top_k truncate sampling: vLLM reports logprobs renormalised over "
                       "the kept tokens, the policy over the whole vocabulary, so train/token_mult_prob_error "
                       "will exceed 1; set top_p: 1.0 and top_k: null for exact importance ratios")


main = GRPO.main
