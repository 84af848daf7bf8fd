"""The top-k distillation loss of NeMo RL (``DistillationLossFn``): a KL between the teacher's and
the student's next-token distributions restricted to the teacher's ``k`` likeliest tokens.

Both distributions are renormalised over those ``k`` tokens; with ``zero_outside_topk`` the
student's keeps its full-vocabulary probabilities (forward KL only: the reverse one would need the
student's entropy over the whole vocabulary). The loss is a mean over the batch's valid tokens
(``token_mask`` x ``sample_mask``), so micro-batch losses add up to the global one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nrl_core.api import TokenBatch

TEACHER_IDS = "teacher_topk_ids"
TEACHER_LOGPROBS = "teacher_topk_logprobs"


class TopkDistillationLoss:
    """Called by a training backend once per micro-batch with the student's logprobs ``[b, t, k]``
    at the teacher's top-k ids (``gather_ids_field``, contract 10)."""

    gather_ids_field = TEACHER_IDS

    def __init__(self, kl_type: str = "mixed", mixed_kl_weight: float = 0.5, zero_outside_topk: bool = False) -> None:
        self.kl_type = kl_type
        self.mixed_kl_weight = float(mixed_kl_weight)
        self.zero_outside_topk = bool(zero_outside_topk)

    @classmethod
    def from_config(cls, loss_fn: Mapping[str, Any]) -> TopkDistillationLoss:
        return cls(loss_fn["kl_type"], loss_fn["mixed_kl_weight"], loss_fn["zero_outside_topk"])

    def per_token(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        """The KL at every position from both models' logprobs at the teacher's top-k ids."""
        teacher = teacher.float().log_softmax(-1)
        student = student if self.zero_outside_topk else student.log_softmax(-1)
        forward = (teacher.exp() * (teacher - student)).sum(-1)
        if self.kl_type == "forward":
            return forward
        reverse = (student.exp() * (student - teacher)).sum(-1)
        if self.kl_type == "reverse":
            return reverse
        return self.mixed_kl_weight * forward + (1.0 - self.mixed_kl_weight) * reverse

    def __call__(self, logprobs: torch.Tensor, batch: TokenBatch, *, global_valid_tokens: float,
                 global_valid_seqs: float) -> tuple[torch.Tensor, dict[str, float]]:
        fields = batch.fields
        teacher = fields[TEACHER_LOGPROBS].to(logprobs.device)
        mask = (fields["token_mask"] * fields["sample_mask"].unsqueeze(1)).to(logprobs.device)
        width = min(logprobs.shape[1], mask.shape[1])
        kl = self.per_token(logprobs[:, :width], teacher[:, :width]) * mask[:, :width]
        loss = kl.sum() / max(float(global_valid_tokens), 1.0)
        return loss, {"loss": float(loss.detach()), "num_valid_samples": float((fields["sample_mask"] > 0).sum())}
