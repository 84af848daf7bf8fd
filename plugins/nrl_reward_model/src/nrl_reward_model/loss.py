"""The Bradley-Terry loss of NeMo RL's reward models (``PreferenceLossFn``).

For a pair with chosen response ``c`` and rejected ``r`` the model's scores are its value head at
each sequence's last token, and

    loss = -log sigmoid(score_c - score_r)

averaged over the valid pairs of the global batch. Metrics are NeMo RL's (``accuracy``: pairs
whose chosen score is higher; ``rewards_*_mean``: the mean scores), each a micro-batch's share of
the global value so that backends sum them.
"""

from __future__ import annotations

import torch

from nrl_core.api import TokenBatch, check_pairs, last_token_values


class BradleyTerryLoss:
    """Called once per micro-batch with the value head's ``[b, t]`` outputs (``reads_values``,
    contract 11); rows come in (chosen, rejected) pairs as :func:`nrl_core.data.preference.preference_batch`
    lays them out."""

    reads_values = True

    def __call__(self, values: torch.Tensor, batch: TokenBatch, *, global_valid_tokens: float,
                 global_valid_seqs: float) -> tuple[torch.Tensor, dict[str, float]]:
        check_pairs(batch, "the reward model")
        scores = last_token_values(values, batch.input_lengths)
        sample = batch.fields["sample_mask"].to(scores)
        chosen, rejected, valid = scores[0::2], scores[1::2], sample[0::2]
        pairs = max(float(global_valid_seqs) / 2, 1.0)  # every valid pair counts two sequences
        loss = -(torch.nn.functional.logsigmoid(chosen - rejected) * valid).sum() / pairs
        with torch.no_grad():
            metrics = {
                "loss": float(loss),
                "accuracy": float(((chosen > rejected).to(valid.dtype) * valid).sum() / pairs),
                "rewards_chosen_mean": float((chosen * valid).sum() / pairs),
                "rewards_rejected_mean": float((rejected * sample[1::2]).sum() / pairs),
                "num_valid_samples": float(valid.sum()),
            }
        return loss, metrics
