"""On-policy distillation (NeMo RL's ``distillation``): the student samples responses with its
generation engine, the teacher scores every response token with its ``k`` likeliest next tokens,
and the student is trained to match them (:class:`~nrl_algo_distillation.loss.TopkDistillationLoss`).

One step: prompts -> the student's responses (refit first if stale) -> the teacher's top-k at every
position -> optimizer steps on the KL. The teacher is a second policy group built from the
``teacher`` section on the student's devices, inference only. Validation decodes the held-out
prompts, scores them with the environment and measures the same KL on them (``val/kl``).
Everything else (checkpoints, resume, logging) is :class:`~nrl_core.algorithms.base.AlgorithmRun`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nrl_algo_distillation.config import check_distillation
from nrl_algo_distillation.loss import TEACHER_IDS, TEACHER_LOGPROBS, TopkDistillationLoss
from nrl_core.api import (
    AlgorithmRun,
    DatumSpec,
    Generation,
    GenerationOutput,
    PhaseTimer,
    Policy,
    RolloutGroup,
    Runtime,
    Scorer,
    SingleTurnSampler,
    TokenBatch,
    build_environment,
    choose_backends,
    data_parallel_size,
    env_metrics,
    load_tokenizer,
    merge_groups,
    model_config,
    prepare_data,
    prompt_limits,
    repeat_prompts,
    rollout_batch,
    validates_greedily,
)


class Distillation(AlgorithmRun):
    section = "distillation"
    summary_prefixes = ("val/", "train/loss")

    def __init__(self, config: Mapping[str, Any], *, runtime: Runtime | None = None) -> None:
        check_distillation(config)
        cfg = config["distillation"]
        self.group_size = int(cfg["num_generations_per_prompt"])
        self.k = int(cfg["topk_logits_k"])
        self.tokenizer = load_tokenizer(config)
        data = prepare_data(config["data"], self.tokenizer, limits=prompt_limits(config))
        self.val_data: list[DatumSpec] = (data.val or [])[: cfg["max_val_samples"]]
        self.loss_fn = TopkDistillationLoss.from_config(config["loss_fn"])
        self.env = build_environment(config)
        super().__init__(config, batch_size=int(cfg["num_prompts_per_step"]), train_data=data.train,
                         with_generation=True, runtime=runtime)
        teacher_config = model_config(config, "teacher")
        teacher_backend = choose_backends(teacher_config, generation=False).training
        self.teacher = Policy(teacher_config, teacher_backend, colocated_generation=False, beside=self.policy,
                              name="teacher", reference_policy=False)  # it never trains
        self.teacher.offload_before_refit()  # inference only: no optimizer state or gradients in use,
        self.teacher.offload_after_refit()  # and its weights leave the devices between its passes
        # a pass over a batch needs whole micro-batches on every data-parallel rank (Megatron's pipeline)
        self.teacher_rows = rows_per_pass(teacher_config, data_parallel_size(teacher_config, teacher_backend))
        self.student_rows = rows_per_pass(config, data_parallel_size(config, self.choice.training))
        assert self.choice.generation is not None
        self.generation = Generation(config, self.choice.generation, self.policy)
        self.sampler = SingleTurnSampler(self.generation, Scorer(config, self.tokenizer, self.env), self.group_size,
                                         int(cfg["val_batch_size"]),
                                         val_greedy=validates_greedily(config["policy"]["generation"]))

    # ------------------------------------------------------------------ one step

    def step(self, prompts: Sequence[DatumSpec]) -> dict[str, float]:
        timer = PhaseTimer()
        groups, result = self.sampler.sample(prompts, timer)
        batch = self.rollouts_batch(groups)
        with timer("teacher_topk"):
            self.add_teacher_topk(batch)
        with timer("training"):
            train_metrics = self.train(batch)
        self.generation.mark_stale()
        rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
        return {"train/reward": float(rewards.mean()),
                "train/response_length": float(batch.fields["response_lengths"].mean()),
                **env_metrics(result), **{f"train/{k}": v for k, v in train_metrics.items()}, **timer.metrics()}

    def rollouts_batch(self, groups: Sequence[RolloutGroup]) -> TokenBatch:
        prompt_ids = repeat_prompts([g.prompt.prompt_ids for g in groups], self.group_size)
        return self.sequences(prompt_ids, merge_groups(groups))

    def sequences(self, prompt_ids: list[list[int]], outputs: GenerationOutput) -> TokenBatch:
        """Prompts and responses as the padded batch both models read, every response token counted."""
        batch = rollout_batch(prompt_ids, outputs, pad_token_id=self.tokenizer.pad_token_id,
                              max_total_length=self.config["policy"]["max_total_sequence_length"])
        batch.fields["sample_mask"] = torch.ones(batch.size)
        return batch

    def add_teacher_topk(self, batch: TokenBatch) -> None:
        """The teacher's top-k logprobs and ids at every position, as the loss reads them. The two
        models take turns on the devices: the student's optimizer state and gradients leave them
        while the teacher's weights are back (as NeMo RL does before its teacher's pass)."""
        self.policy.offload_before_refit()
        self.teacher.prepare_for_training()
        logprobs, ids = self.teacher.get_topk_logprobs(padded(batch, self.teacher_rows), self.k)
        self.teacher.offload_after_refit()
        self.policy.prepare_for_training()
        batch.fields[TEACHER_LOGPROBS], batch.fields[TEACHER_IDS] = logprobs[:batch.size], ids[:batch.size]

    def train(self, batch: TokenBatch) -> dict[str, float]:
        """One optimizer step per ``policy.train_global_batch_size`` responses; metrics averaged."""
        return self.policy.train_steps(batch, self.loss_fn, int(self.config["policy"]["train_global_batch_size"]))

    # ------------------------------------------------------------------ validation

    def validate(self, step: int) -> dict[str, float]:
        """The held-out prompts decoded by the student and scored by the environment (every one
        written to ``val_data_step<step>.jsonl``), and the distillation KL on those responses."""
        if not self.val_data:
            return {}
        rewards, records = self.sampler.validate(self.val_data)
        self.log.log_samples("val_data", step, records)
        outputs = GenerationOutput(token_ids=[r["response_token_ids"] for r in records],
                                   logprobs=[[0.0] * len(r["response_token_ids"]) for r in records],
                                   finish_reasons=["stop"] * len(records), weight_version=-1)
        batch = padded(self.sequences([r["prompt_token_ids"] for r in records], outputs), self.student_rows)
        self.add_teacher_topk(batch)
        student = self.policy.get_gathered_logprobs(batch, TEACHER_IDS)
        mask = batch.fields["token_mask"] * batch.fields["sample_mask"].unsqueeze(1)
        kl = (self.loss_fn.per_token(student, batch.fields[TEACHER_LOGPROBS]) * mask).sum() / mask.sum().clamp_min(1)
        return {"val/reward": sum(rewards) / len(rewards), "val/accuracy": sum(r > 0 for r in rewards) / len(rewards),
                "val/kl": float(kl)}

    # ------------------------------------------------------------------ state beyond the policy

    def extra_state(self) -> dict[str, Any]:
        return {"generation": self.generation.sampling_states(), "generation_stale": self.generation.stale}

    def restore_extra_state(self, info: Mapping[str, Any]) -> None:
        """The engines started from the HF checkpoint: the restored student's weights go into them,
        then their sampling position, so a resumed run continues exactly. The teacher is frozen:
        nothing of it is saved."""
        self.generation.load_policy_weights()
        self.generation.load_sampling_states(info.get("generation", []))
        self.generation.stale = bool(info.get("generation_stale", True))

    def shutdown(self) -> None:
        try:
            for part in ("generation", "env", "teacher"):  # a run that failed to build lacks the later ones
                if hasattr(self, part):
                    getattr(self, part).shutdown()
        finally:
            super().shutdown()


def rows_per_pass(config: Mapping[str, Any], dp_size: int) -> int:
    """Rows a logprob pass over a batch must come in multiples of: whole micro-batches on every
    data-parallel rank."""
    return dp_size * int(config["policy"]["logprob_batch_size"] or 1)


def padded(batch: TokenBatch, multiple: int) -> TokenBatch:
    """``batch`` with copies of its first row, weighted 0, up to a multiple of ``multiple`` rows."""
    extra = -batch.size % multiple
    if not extra:
        return batch
    out = batch.select(list(range(batch.size)) + [0] * extra)
    out.fields["sample_mask"][batch.size:] = 0.0
    return out


def main(config: Mapping[str, Any], runtime: Runtime | None = None) -> int:
    """``nrl train distillation``."""
    return Distillation.main(config, runtime)
