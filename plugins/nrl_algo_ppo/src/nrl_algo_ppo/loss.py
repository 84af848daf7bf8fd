"""The critic's loss (NeMo RL's ``MseValueLossFn``), called by a training backend once per
micro-batch with the value head's outputs (``reads_values``, contract 11):

    loss = 0.5 x scale x sum_t max((V_t - R_t)^2, (clip(V_t, V_old - c, V_old + c) - R_t)^2) / N

over the response tokens (``token_mask`` x ``sample_mask``), ``N`` the global batch's valid tokens,
``V`` the head's outputs aligned with the tokens (:func:`nrl_algo_ppo.gae.token_values`), ``R`` the
returns and ``V_old`` the values the step began with; without ``cliprange`` only the first term.
Metrics are shares of the global values, so backends sum them over micro-batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nrl_algo_ppo.gae import token_values
from nrl_core.api import TokenBatch

RETURNS = "returns"
OLD_VALUES = "values"


class ClippedValueLoss:
    reads_values = True

    def __init__(self, scale: float = 1.0, cliprange: float | None = None) -> None:
        self.scale = float(scale)
        self.cliprange = float(cliprange) if cliprange else None

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> ClippedValueLoss:
        return cls(section["scale"], section["cliprange"])

    def __call__(self, values: torch.Tensor, batch: TokenBatch, *, global_valid_tokens: float,
                 global_valid_seqs: float) -> tuple[torch.Tensor, dict[str, float]]:
        fields = batch.fields
        mask = (fields["token_mask"] * fields["sample_mask"].unsqueeze(1)).to(values.device, torch.float32)
        width = min(values.shape[1], mask.shape[1])
        mask = mask[:, :width]
        predicted = token_values(values)[:, :width]
        returns = fields[RETURNS].to(predicted)[:, :width]
        squared = (predicted - returns).square()
        clipped_fraction = torch.zeros((), device=predicted.device)
        if self.cliprange is not None:
            old = fields[OLD_VALUES].to(predicted)[:, :width]
            kept = old + (predicted - old).clamp(-self.cliprange, self.cliprange)
            clipped = (kept - returns).square()
            clipped_fraction = ((clipped > squared).to(mask) * mask).sum()
            squared = torch.maximum(squared, clipped)
        count = max(float(global_valid_tokens), 1.0)
        loss = 0.5 * self.scale * (squared * mask).sum() / count
        with torch.no_grad():
            metrics = {
                "loss": float(loss),
                "vf_clipfrac": float(clipped_fraction) / count,
                "values_mean": float((predicted * mask).sum()) / count,
                "returns_mean": float((returns * mask).sum()) / count,
                "residual_sq_mean": float(((predicted - returns).square() * mask).sum()) / count,
                "num_valid_samples": float((fields["sample_mask"] > 0).sum()),
            }
        return loss, metrics
