"""Reward-model training (NeMo RL's ``rm``): a Bradley-Terry model learns to score the chosen
response of each preference pair above the rejected one.

One step: ``policy.train_global_batch_size`` pairs -> one ``TokenBatch`` that keeps every pair in
one micro-batch on every backend -> one optimizer step on
:class:`~nrl_reward_model.loss.BradleyTerryLoss` over the value head's scores. Validation computes
the same loss and metrics on held-out pairs (the core's ``PreferenceRun``, which DPO uses too).
The best checkpoint is exported as a Hugging Face ``*ForSequenceClassification`` model, which
``env.reward_model`` (and ``transformers``) load. Checkpoints, resume and logging are the core's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nrl_core.api import PhaseTimer, PreferencePair, PreferenceRun, Runtime, TokenBatch
from nrl_reward_model.config import check_rm
from nrl_reward_model.loss import BradleyTerryLoss


class RewardModelTraining(PreferenceRun):
    section = "rm"

    def __init__(self, config: Mapping[str, Any], *, runtime: Runtime | None = None) -> None:
        check_rm(config)
        super().__init__(config, BradleyTerryLoss(), runtime=runtime)

    def step(self, pairs: Sequence[PreferencePair]) -> dict[str, float]:
        timer = PhaseTimer()
        with timer("training"):
            metrics = self.policy.train(self.batch(pairs), self.loss_fn)
        return {**{f"train/{k}": v for k, v in metrics.items()}, **timer.metrics()}

    def held_out_outputs(self, batch: TokenBatch, index: int) -> torch.Tensor:
        return self.policy.get_values(batch)


def main(config: Mapping[str, Any], runtime: Runtime | None = None) -> int:
    """``nrl train rm``."""
    return RewardModelTraining.main(config, runtime)
