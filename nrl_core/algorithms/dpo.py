"""Direct Preference Optimization (NeMo RL's DPO): train the policy to prefer the chosen response of
each pair over the rejected one, relative to the frozen reference model (the initial weights).

One step: a batch of ``policy.train_global_batch_size`` pairs → one ``TokenBatch`` that keeps
every pair in one micro-batch on every backend → the reference model's logprobs → one optimizer
step on :class:`~nrl_core.algorithms.dpo_loss.DPOLoss`. Validation computes the same loss and
metrics on held-out pairs without training (:class:`~nrl_core.algorithms.preference_run.
PreferenceRun`). Checkpoints, resume and logging are :class:`~nrl_core.algorithms.base.AlgorithmRun`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from nrl_core.algorithms.dpo_loss import DPOLoss
from nrl_core.algorithms.preference_run import PreferenceRun
from nrl_core.algorithms.setup import PhaseTimer
from nrl_core.contracts import TokenBatch
from nrl_core.data.preference import PreferencePair

if TYPE_CHECKING:
    from nrl_core.algorithms.runtime import Runtime


class DPO(PreferenceRun):
    section = "dpo"

    def __init__(self, config: Mapping[str, Any], *, runtime: Runtime | None = None) -> None:
        super().__init__(config, DPOLoss.from_config(config["dpo"]), runtime=runtime)
        self._val_reference: dict[int, Any] = {}  # the reference model never changes: one pass per val batch

    def step(self, pairs: Sequence[PreferencePair]) -> dict[str, float]:
        timer = PhaseTimer()
        batch = self.batch(pairs)
        with timer("reference_logprobs"):
            batch.fields["reference_logprobs"] = self.policy.get_reference_logprobs(batch)
        with timer("training"):
            metrics = self.policy.train(batch, self.loss_fn)
        return {**{f"train/{k}": v for k, v in metrics.items()}, **timer.metrics()}

    def held_out_outputs(self, batch: TokenBatch, index: int) -> torch.Tensor:
        if index not in self._val_reference:
            self._val_reference[index] = self.policy.get_reference_logprobs(batch)
        batch.fields["reference_logprobs"] = self._val_reference[index]
        return self.policy.get_logprobs(batch)


main = DPO.main
