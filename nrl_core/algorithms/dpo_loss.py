"""DPO's loss (NeMo RL's ``DPOLossFn`` semantics) over the pair batches of
:func:`nrl_core.data.preference.preference_batch`.

For a pair with chosen response ``c`` and rejected ``r``, a response's reward is
``sum_t (logprob_t - reference_logprob_t)`` over its response tokens (the mean with
``preference_average_log_probs``), and

    preference_loss = -log sigmoid(beta * (reward_c - reward_r))           beta = reference_policy_kl_penalty
    sft_loss        = -sum_t logprob_t of the chosen response               (the mean with sft_average_log_probs)
    loss            = preference_loss_weight * preference_loss + sft_loss_weight * sft_loss

each averaged over the valid pairs of the global batch. Like every core loss its metrics are
additive (a micro-batch's share of the global value), so backends sum them; ``accuracy`` is the
fraction of pairs whose chosen reward is higher and ``rewards_*_mean`` are the unscaled rewards,
as NeMo RL logs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nrl_core.algorithms.loss import ConfiguredLoss
from nrl_core.contracts import TokenBatch
from nrl_core.data.preference import check_pairs


@dataclass(frozen=True, kw_only=True)
class DPOLoss(ConfiguredLoss):
    """Reads ``token_mask``, ``reference_logprobs`` (per token), ``chosen``, ``pair`` and
    ``sample_mask`` (per sequence) from ``batch.fields``; rows come in (chosen, rejected) pairs."""

    reference_policy_kl_penalty: float = 0.05
    preference_loss_weight: float = 1.0
    sft_loss_weight: float = 0.0
    preference_average_log_probs: bool = False
    sft_average_log_probs: bool = False

    def __call__(
        self, logprobs: torch.Tensor, batch: TokenBatch, *, global_valid_tokens: float, global_valid_seqs: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        f = batch.fields
        check_pairs(batch, "DPO")
        sample = f["sample_mask"].to(logprobs.dtype)
        mask = f["token_mask"].to(logprobs.dtype) * sample.unsqueeze(1)
        tokens = mask.sum(1).clamp_min(1)
        rewards = ((logprobs - f["reference_logprobs"].to(logprobs.dtype)) * mask).sum(1)
        if self.preference_average_log_probs:
            rewards = rewards / tokens
        chosen, rejected, valid = rewards[0::2], rewards[1::2], sample[0::2]
        pairs = max(global_valid_seqs / 2, 1.0)  # every valid pair counts two sequences

        preference = -(torch.nn.functional.logsigmoid(self.reference_policy_kl_penalty * (chosen - rejected))
                       * valid).sum() / pairs
        nll = -(logprobs * mask).sum(1)
        if self.sft_average_log_probs:
            nll = nll / tokens
        sft = (nll[0::2] * valid).sum() / pairs
        loss = self.preference_loss_weight * preference + self.sft_loss_weight * sft
        with torch.no_grad():
            metrics = {
                "loss": float(loss),
                "preference_loss": float(preference),
                "sft_loss": float(sft),
                "accuracy": float(((chosen > rejected).to(valid.dtype) * valid).sum() / pairs),
                "rewards_chosen_mean": float((chosen * valid).sum() / pairs),
                "rewards_rejected_mean": float((rejected * sample[1::2]).sum() / pairs),
                "num_valid_samples": float(valid.sum()),
            }
        return loss, metrics

