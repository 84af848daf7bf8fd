"""``PreferenceRun``: what the algorithms that learn from preference pairs share (DPO, and
reward-model training in nrl-reward-model). Pairs come from NeMo RL's preference formats, each
batch keeps every (chosen, rejected) pair in one micro-batch on every backend, the workers count
sequences (two per pair) where the config counts pairs, and validation computes the training loss
and its metrics over held-out pairs. A subclass writes ``step`` and :meth:`held_out_outputs`."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nrl_core.algorithms.base import AlgorithmRun
from nrl_core.algorithms.runtime import Runtime
from nrl_core.algorithms.setup import load_tokenizer
from nrl_core.config.checks import data_parallel_size
from nrl_core.contracts import LossFunction, TokenBatch
from nrl_core.data.preference import PreferencePair, pair_order, preference_batch, prepare_preference_data


class PreferenceRun(AlgorithmRun):
    """See the module docstring; ``val_batches`` of the section counts validation batches (0 or
    below: all of them)."""

    summary_prefixes = ("val/", "train/loss", "train/accuracy")

    def __init__(self, config: Mapping[str, Any], loss_fn: LossFunction, *, runtime: Runtime | None = None) -> None:
        self.tokenizer = load_tokenizer(config)
        runtime = runtime if runtime is not None else Runtime.for_process()
        data = prepare_preference_data(config["data"], self.tokenizer, runtime.plugins,
                                       max_length=config["policy"]["max_total_sequence_length"])
        self.val_data: list[PreferencePair] = data.val or []
        self.loss_fn = loss_fn
        super().__init__(config, batch_size=int(config["policy"]["train_global_batch_size"]), train_data=data.train,
                         runtime=runtime)
        self.dp_size = data_parallel_size(config, self.choice.training, self.runtime.plugins)

    def worker_config(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        """Workers count sequences: two per pair (NeMo RL doubles the batch sizes the same way)."""
        doubled = copy.deepcopy(dict(config))
        for key in ("train_global_batch_size", "train_micro_batch_size"):
            doubled["policy"][key] = 2 * int(config["policy"][key])
        return doubled

    def batch(self, pairs: Sequence[PreferencePair]) -> TokenBatch:
        return preference_batch(pairs, self.tokenizer.pad_token_id, self.dp_size)

    def held_out_outputs(self, batch: TokenBatch, index: int) -> torch.Tensor:
        """What the loss reads for held-out batch number ``index`` (logprobs, values), computed
        without training; may add the fields the loss needs to ``batch``."""
        raise NotImplementedError

    def validate(self, step: int) -> dict[str, float]:
        """The loss and its metrics over the section's ``val_batches`` batches of held-out pairs,
        weighted by pairs as if computed over all of them at once."""
        if not self.val_data:
            return {}
        size, count = int(self.cfg["val_global_batch_size"]), int(self.cfg["val_batches"])
        end = len(self.val_data) if count <= 0 else min(len(self.val_data), size * count)
        totals: dict[str, float] = {}
        pairs = 0.0
        for index, start in enumerate(range(0, end, size)):
            batch = self.batch(self.val_data[start:min(start + size, end)])
            outputs = self.held_out_outputs(batch, index)
            order = pair_order(batch)  # laid out for the data-parallel shards; the loss reads pairs
            batch = batch.select(order)
            outputs = outputs[order][:, :batch.input_ids.shape[1]]
            tokens, seqs = batch.loss_counts()
            _, metrics = self.loss_fn(outputs, batch, global_valid_tokens=tokens, global_valid_seqs=seqs)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + (value if key == "num_valid_samples" else value * seqs / 2)
            pairs += seqs / 2
        return {f"val/{k}": (v if k == "num_valid_samples" else v / max(pairs, 1.0)) for k, v in totals.items()}
