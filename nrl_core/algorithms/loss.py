"""Losses the core owns; backends call them once per micro-batch (see ``contracts.LossFunction``)."""

from __future__ import annotations

import torch

from nrl_core.contracts import TokenBatch


class NLLLoss:
    """Negative log-likelihood of the tokens in ``token_mask``, averaged over every masked token
    of the global batch (so micro-batch and data-parallel splits do not change the result)."""

    def __call__(
        self, logprobs: torch.Tensor, batch: TokenBatch, *, global_valid_tokens: float, global_valid_seqs: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.fields["token_mask"].to(logprobs.dtype)
        loss = -(logprobs * mask).sum() / max(global_valid_tokens, 1.0)
        return loss, {"loss": float(loss.detach()), "num_valid_tokens": float(mask.sum())}
