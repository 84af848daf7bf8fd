"""Direct Preference Optimization (NeMo RL's DPO): train the policy to prefer the chosen response of
each pair over the rejected one, relative to the frozen reference model (the initial weights).

One step: a batch of ``policy.train_global_batch_size`` pairs → one ``TokenBatch`` that keeps
every pair in one micro-batch on every backend → the reference model's logprobs → one optimizer
step on :class:`~nrl_core.algorithms.dpo_loss.DPOLoss`. Validation computes the same loss and
metrics on held-out pairs without training. Checkpoints, resume and logging are
:class:`~nrl_core.algorithms.base.AlgorithmRun`'s.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

from nrl_core.algorithms.base import AlgorithmRun
from nrl_core.algorithms.dpo_loss import DPOLoss
from nrl_core.algorithms.setup import PhaseTimer, load_tokenizer
from nrl_core.config.checks import data_parallel_size
from nrl_core.contracts import TokenBatch
from nrl_core.data.preference import PreferencePair, preference_batch, prepare_preference_data


class DPO(AlgorithmRun):
    section = "dpo"
    summary_prefixes = ("val/", "train/loss", "train/accuracy")

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.tokenizer = load_tokenizer(config)
        data = prepare_preference_data(config["data"], self.tokenizer,
                                       max_length=config["policy"]["max_total_sequence_length"])
        self.val_data: list[PreferencePair] = data.val or []
        self.loss_fn = DPOLoss.from_config(config["dpo"])
        super().__init__(config, batch_size=int(config["policy"]["train_global_batch_size"]), train_data=data.train)
        self.dp_size = data_parallel_size(config, self.choice.training)
        self._val_reference: dict[int, Any] = {}  # the reference model never changes: one pass per val batch

    def worker_config(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        """Workers count sequences: two per pair (NeMo RL doubles the batch sizes the same way)."""
        doubled = copy.deepcopy(dict(config))
        for key in ("train_global_batch_size", "train_micro_batch_size"):
            doubled["policy"][key] = 2 * int(config["policy"][key])
        return doubled

    def batch(self, pairs: Sequence[PreferencePair]) -> TokenBatch:
        return preference_batch(pairs, self.tokenizer.pad_token_id, self.dp_size)

    def step(self, pairs: Sequence[PreferencePair]) -> dict[str, float]:
        timer = PhaseTimer()
        batch = self.batch(pairs)
        with timer("reference_logprobs"):
            batch.fields["reference_logprobs"] = self.policy.get_reference_logprobs(batch)
        with timer("training"):
            metrics = self.policy.train(batch, self.loss_fn)
        return {**{f"train/{k}": v for k, v in metrics.items()}, **timer.metrics()}

    def validate(self, step: int) -> dict[str, float]:
        """The loss and its metrics over ``dpo.val_batches`` batches of held-out pairs (0: all of
        them), weighted by pairs as if computed over all of them at once."""
        if not self.val_data:
            return {}
        size, count = int(self.cfg["val_global_batch_size"]), int(self.cfg["val_batches"])
        end = len(self.val_data) if count == 0 else min(len(self.val_data), size * count)
        totals: dict[str, float] = {}
        pairs = 0.0
        for index, start in enumerate(range(0, end, size)):
            batch = self.batch(self.val_data[start:min(start + size, end)])
            if index not in self._val_reference:
                self._val_reference[index] = self.policy.get_reference_logprobs(batch)
            batch.fields["reference_logprobs"] = self._val_reference[index]
            tokens, seqs = batch.loss_counts()
            _, metrics = self.loss_fn(self.policy.get_logprobs(batch), batch, global_valid_tokens=tokens,
                                      global_valid_seqs=seqs)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + (value if key == "num_valid_samples" else value * seqs / 2)
            pairs += seqs / 2
        return {f"val/{k}": (v if k == "num_valid_samples" else v / max(pairs, 1.0)) for k, v in totals.items()}


main = DPO.main
