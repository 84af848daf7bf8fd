"""Losses the core owns; backends call them once per micro-batch (see ``contracts.LossFunction``).

Metrics a loss returns are *additive*: each is the micro-batch's contribution to the global-batch
value (normalised by the global token or sequence count), so a backend sums them over
micro-batches and data-parallel ranks and gets the global figure whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

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


def kl_estimate(
    logprobs: torch.Tensor, reference_logprobs: torch.Tensor, kind: Literal["k1", "k2", "k3"],
    input_clamp: float | None = None, output_clamp: float | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token logprobs (Schulman's k1,
    k2, k3). ``input_clamp`` bounds the log-ratio and ``output_clamp`` the estimate, so one
    badly off token cannot dominate a step."""
    log_ratio = reference_logprobs - logprobs
    if input_clamp is not None:
        log_ratio = log_ratio.clamp(-input_clamp, input_clamp)
    if kind == "k1":
        kl = -log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    elif kind == "k3":
        kl = log_ratio.exp() - log_ratio - 1
    else:
        raise ValueError(f"unknown KL estimator '{kind}'; use k1, k2 or k3")
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


class ConfiguredLoss:
    """A dataclass loss whose fields are keys of a config section (``loss_fn``, ``dpo``)."""

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> Any:
        names = cls.__dataclass_fields__.keys()  # type: ignore[attr-defined]
        return cls(**{k: v for k, v in section.items() if k in names})


@dataclass(frozen=True, kw_only=True)
class ClippedPGLoss(ConfiguredLoss):
    """GRPO's clipped policy-gradient loss with a reference-KL penalty.

    Reads these per-token ``batch.fields`` (aligned with ``input_ids``): ``token_mask``,
    ``advantages``, ``prev_logprobs`` (policy logprobs before this update), ``generation_logprobs``
    (what the inference engine reported) and ``reference_logprobs``; and per-sequence
    ``sample_mask`` (0 drops a sequence, e.g. overlong filtering).

    * ratio r = exp(logprobs - prev_logprobs); loss = max(-A r, -A clip(r, 1 - min, 1 + max)),
      and with ``ratio_clip_c`` (dual clip) capped at -A c for negative advantages;
    * ``force_on_policy_ratio``: ``prev_logprobs`` are this forward's own logprobs, detached (r is
      exactly 1, its gradient that of the logprobs), so no separate pass computes them; right
      whenever the batch feeds one optimizer step, because every micro-batch's forward then runs
      under the weights a separate pass would use (GRPO decides: ``grpo_config.on_policy_ratio``);
    * ``sequence_level_importance_ratios`` (GSPO): r is exp of the sequence's mean log-ratio;
    * ``use_importance_sampling_correction``: each token is weighted by
      exp(prev_logprobs - generation_logprobs), correcting for the engine's numerics differing
      from the trainer's (truncated at ``truncated_importance_sampling_ratio`` when set);
    * KL: ``reference_policy_kl_penalty`` x k1/k2/k3 estimate, weighted by
      exp(logprobs - generation_logprobs) when ``use_on_policy_kl_approximation``;
    * ``token_level_loss``: average over every valid token of the global batch; otherwise average
      per sequence, then over sequences.
    """

    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    ratio_clip_c: float | None = None
    reference_policy_kl_penalty: float = 0.0
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    kl_input_clamp_value: float | None = 20.0
    kl_output_clamp_value: float | None = 10.0
    use_on_policy_kl_approximation: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_ratio: float | None = None
    token_level_loss: bool = True
    sequence_level_importance_ratios: bool = False
    force_on_policy_ratio: bool | None = False

    def __call__(
        self, logprobs: torch.Tensor, batch: TokenBatch, *, global_valid_tokens: float, global_valid_seqs: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        f = batch.fields
        mask = f["token_mask"].to(logprobs.dtype)
        if "sample_mask" in f:
            mask = mask * f["sample_mask"].to(logprobs.dtype).unsqueeze(1)
        advantages = f["advantages"].to(logprobs.dtype)
        prev = logprobs.detach() if self.force_on_policy_ratio else f["prev_logprobs"].to(logprobs.dtype)
        generation = f["generation_logprobs"].to(logprobs.dtype)

        log_ratio = logprobs - prev
        if self.sequence_level_importance_ratios:
            per_seq = (log_ratio * mask).sum(1) / mask.sum(1).clamp_min(1)
            log_ratio = per_seq.unsqueeze(1).expand_as(logprobs)
        ratio = log_ratio.exp()
        clipped = ratio.clamp(1 - self.ratio_clip_min, 1 + self.ratio_clip_max)
        pg = torch.maximum(-advantages * ratio, -advantages * clipped)
        if self.ratio_clip_c is not None:
            pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * self.ratio_clip_c), pg)
        if self.use_importance_sampling_correction:
            weights = (prev - generation).exp().detach()
            if self.truncated_importance_sampling_ratio is not None:
                weights = weights.clamp(max=self.truncated_importance_sampling_ratio)
            pg = pg * weights

        kl = torch.zeros_like(logprobs)
        if self.reference_policy_kl_penalty:
            kl = kl_estimate(logprobs, f["reference_logprobs"].to(logprobs.dtype), self.reference_policy_kl_type,
                             self.kl_input_clamp_value, self.kl_output_clamp_value)
            if self.use_on_policy_kl_approximation:
                kl = kl * torch.nan_to_num((logprobs - generation).exp().detach(), nan=0.0, posinf=0.0, neginf=0.0)
            kl = self.reference_policy_kl_penalty * kl

        mean = self._mean_fn(mask, global_valid_tokens, global_valid_seqs)
        pg_loss, kl_loss = mean(pg), mean(kl)
        loss = pg_loss + kl_loss
        token_mean = self._mean_fn(mask, global_valid_tokens, global_valid_seqs, token_level=True)
        with torch.no_grad():
            metrics = {
                "loss": float(loss),
                "pg_loss": float(pg_loss),
                "kl_penalty": float(kl_loss),
                "probs_ratio": float(token_mean(ratio)),
                "probs_ratio_clamped": float(token_mean(clipped)),
                "clip_fraction": float(token_mean((ratio != clipped).to(ratio.dtype))),
                "token_mult_prob_error": float(token_mean((generation - prev).abs().exp())),
                "num_valid_tokens": float(mask.sum()),
            }
        return loss, metrics

    def _mean_fn(self, mask: torch.Tensor, tokens: float, seqs: float, token_level: bool | None = None):
        token_level = self.token_level_loss if token_level is None else token_level
        if token_level:
            return lambda x: (x * mask).sum() / max(tokens, 1.0)
        lengths = mask.sum(1).clamp_min(1)
        return lambda x: ((x * mask).sum(1) / lengths).sum() / max(seqs, 1.0)
