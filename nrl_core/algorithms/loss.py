"""Losses the core owns; backends call them once per micro-batch (see ``contracts.LossFunction``).

Metrics a loss returns are *additive*: each is the micro-batch's contribution to the global-batch
value (normalised by the global token or sequence count), so a backend sums them over
micro-batches and data-parallel ranks and gets the global figure whatever the split.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from nrl_core.config.loss_rules import loss_config_problem
from nrl_core.contracts import TokenBatch


class NLLLoss:
    """Negative log-likelihood of the tokens in ``token_mask`` of the sequences ``sample_mask``
    keeps, averaged over every such token of the global batch (so micro-batch and data-parallel
    splits do not change the result)."""

    def __call__(
        self, logprobs: torch.Tensor, batch: TokenBatch, *, global_valid_tokens: float, global_valid_seqs: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.fields["token_mask"].to(logprobs.dtype)
        if "sample_mask" in batch.fields:
            mask = mask * batch.fields["sample_mask"].to(logprobs.dtype).unsqueeze(1)
        loss = -(logprobs * mask).sum() / max(global_valid_tokens, 1.0)
        return loss, {"loss": float(loss.detach()), "num_valid_tokens": float(mask.sum())}


def kl_estimate(
    logprobs: torch.Tensor, reference_logprobs: torch.Tensor, kind: Literal["k1", "k2", "k3"],
    input_clamp: float | None = None, output_clamp: float | None = None,
    importance_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token logprobs (Schulman's k1,
    k2, k3), NeMo RL's ``calculate_kl``. ``input_clamp`` bounds the log-ratio and ``output_clamp``
    the estimate, so one badly off token cannot dominate a step. ``importance_weights`` multiply the
    estimate before the output clamp, so a weighted token stays within it too; where the input clamp
    is active a weight is detached, so the clamp stops its gradient as it stops the estimate's."""
    log_ratio = reference_logprobs - logprobs
    if input_clamp is not None:
        clamped = log_ratio.clamp(-input_clamp, input_clamp)
        if importance_weights is not None:
            importance_weights = torch.where(log_ratio == clamped, importance_weights, importance_weights.detach())
        log_ratio = clamped
    if kind == "k1":
        kl = -log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    elif kind == "k3":
        kl = log_ratio.exp() - log_ratio - 1
    else:
        raise ValueError(f"unknown KL estimator '{kind}'; use k1, k2 or k3")
    if importance_weights is not None:
        kl = importance_weights * kl
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


def sequence_mean(x: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean of ``x`` over its ``token_mask`` tokens (0 for a sequence without any)."""
    return (x * token_mask).sum(1) / token_mask.sum(1).clamp_min(1)


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


class ConfiguredLoss:
    """A dataclass loss whose fields are keys of a config section (``loss_fn``, ``dpo``)."""

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> Any:
        names = cls.__dataclass_fields__.keys()  # type: ignore[attr-defined]
        return cls(**{k: v for k, v in section.items() if k in names})


#: The version of GRPO's loss and advantage semantics a run trains with; checkpoints record it so a
#: run resumed from a checkpoint written under another can say so. 1: nrl before NeMo RL parity
#: (docs/changelog.md); 2: NeMo RL's.
GRPO_SEMANTICS_VERSION = 2

@dataclass(frozen=True, kw_only=True)
class ClippedPGLoss(ConfiguredLoss):
    """GRPO's clipped policy-gradient loss with a reference-KL penalty, NeMo RL's ``ClippedPGLossFn``.

    Reads these per-token ``batch.fields`` (aligned with ``input_ids``): ``token_mask``,
    ``advantages``, ``prev_logprobs`` (policy logprobs before this update), ``generation_logprobs``
    (what the inference engine reported) and ``reference_logprobs``; and per-sequence
    ``sample_mask`` (0 drops a sequence, e.g. overlong filtering).

    * ratio r = exp(logprobs - prev_logprobs); loss = max(-A r, -A clip(r, 1 - min, 1 + max)),
      and with ``ratio_clip_c`` (dual clip) capped at -A c for negative advantages;
      ``disable_ppo_ratio``: -A logprobs (REINFORCE/RLOO); ``use_cispo``: -A sg(clip(r)) logprobs;
    * ``force_on_policy_ratio``: ``prev_logprobs`` are this forward's own logprobs, detached (r is
      exactly 1, its gradient that of the logprobs), so no separate pass computes them;
    * ``sequence_level_importance_ratios`` (GSPO): r is exp of the sequence's mean log-ratio, and
      the importance-sampling weight is one per sequence, exp of the summed log-ratio;
    * ``use_importance_sampling_correction``: each token (sequence, with GSPO) is weighted by
      exp(prev_logprobs - generation_logprobs), correcting for the engine's numerics or staleness;
      ``truncated_importance_sampling_type``: ``tis`` clamps the weights to [min (default 0), max],
      ``icepop`` zeroes tokens whose weight is outside, ``seq-mask-tis`` zeroes sequences whose
      geometric-mean weight is outside (a ratio without a type is ``tis``, as nrl had it);
    * KL: ``reference_policy_kl_penalty`` x the k1/k2/k3 estimate, each token's estimate weighted
      by exp(logprobs - sg(logprobs)) (value 1: the score-function term of the gradient, since the
      tokens were sampled from the policy being optimised) or, with
      ``use_on_policy_kl_approximation``, exp(logprobs - generation_logprobs); the weight is applied
      before the output clamp. ``use_kl_in_reward`` leaves the KL to the advantage estimator;
    * ``token_level_loss``: average over every valid token of the global batch; otherwise average
      per sequence, then over the ``sample_mask`` sequences of the global batch.
    """

    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    ratio_clip_c: float | None = None
    reference_policy_kl_penalty: float = 0.0
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    kl_input_clamp_value: float | None = 20.0
    kl_output_clamp_value: float | None = 10.0
    use_on_policy_kl_approximation: bool = False
    use_kl_in_reward: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = None
    truncated_importance_sampling_ratio: float | None = None
    truncated_importance_sampling_ratio_min: float | None = None
    token_level_loss: bool = True
    sequence_level_importance_ratios: bool = False
    force_on_policy_ratio: bool | None = False
    disable_ppo_ratio: bool = False
    use_cispo: bool = False

    def __post_init__(self) -> None:
        problem = loss_config_problem(vars(self))
        if problem is not None:
            raise ValueError(f"{problem[0]}: {problem[1]}")

    def __call__(
        self, logprobs: torch.Tensor, batch: TokenBatch, *, global_valid_tokens: float, global_valid_seqs: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        f = batch.fields
        token_mask = f["token_mask"].to(logprobs.dtype)
        sample_mask = (f["sample_mask"].to(logprobs.dtype) if "sample_mask" in f
                       else torch.ones(batch.size, dtype=logprobs.dtype, device=logprobs.device))
        mask = token_mask * sample_mask.unsqueeze(1)
        advantages = f["advantages"].to(logprobs.dtype)
        prev = logprobs.detach() if self.force_on_policy_ratio else f["prev_logprobs"].to(logprobs.dtype)
        generation = f["generation_logprobs"].to(logprobs.dtype)
        tokens, seqs = max(global_valid_tokens, 1.0), max(global_valid_seqs, 1.0)

        def token_mean(x: torch.Tensor) -> torch.Tensor:
            return (x * mask).sum() / tokens

        def mean(x: torch.Tensor) -> torch.Tensor:
            if self.token_level_loss:
                return token_mean(x)
            return (sequence_mean(x, token_mask) * sample_mask).sum() / seqs

        ratio, clipped = self._ratios(logprobs, prev, token_mask)
        pg = self._objective(logprobs, advantages, ratio, clipped)
        weights, truncation_metrics = self._importance_weights(prev, generation, token_mask, sample_mask, token_mean, seqs)
        if self.use_importance_sampling_correction:
            pg = weights * pg
        kl = self._kl(logprobs, f, generation)
        pg_loss = mean(pg)
        kl_loss = mean(kl) if kl is not None else torch.zeros_like(pg_loss)
        loss = pg_loss + kl_loss
        with torch.no_grad():
            if self.sequence_level_importance_ratios:
                sampling_ratio = (weights.squeeze(1) * sample_mask).sum() / seqs
            else:
                sampling_ratio = token_mean(weights)
            metrics = {
                "loss": float(loss),
                "pg_loss": float(pg_loss),
                "kl_penalty": float(kl_loss) / self.reference_policy_kl_penalty if kl is not None else 0.0,
                "probs_ratio": float(token_mean(ratio)),
                "probs_ratio_clamped": float(token_mean(clipped)),
                "clip_fraction": float(token_mean((ratio != clipped).to(ratio.dtype))),
                "sampling_importance_ratio": float(sampling_ratio),
                **mismatch_metrics(prev, generation, logprobs.detach(), token_mean, self.reference_policy_kl_type),
                **truncation_metrics,
                "num_valid_tokens": float(mask.sum()),
                "num_valid_samples": float(sample_mask.sum()),
            }
        return loss, metrics

    def _ratios(self, logprobs: torch.Tensor, prev: torch.Tensor,
                token_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ratio and its clipped value (the logprobs themselves with ``disable_ppo_ratio``)."""
        if self.force_on_policy_ratio:
            ratio = (logprobs - logprobs.detach()).exp()
            return ratio, ratio
        if self.disable_ppo_ratio:
            return logprobs, logprobs
        log_ratio = logprobs - prev
        if self.sequence_level_importance_ratios:
            log_ratio = sequence_mean(log_ratio, token_mask).unsqueeze(1).expand_as(logprobs)
        ratio = log_ratio.exp()
        return ratio, ratio.clamp(1 - self.ratio_clip_min, 1 + self.ratio_clip_max)

    def _objective(self, logprobs: torch.Tensor, advantages: torch.Tensor, ratio: torch.Tensor,
                   clipped: torch.Tensor) -> torch.Tensor:
        if self.use_cispo:
            pg = -advantages * clipped.detach() * logprobs
        else:
            pg = torch.maximum(-advantages * ratio, -advantages * clipped)
        if self.ratio_clip_c is not None:
            pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * self.ratio_clip_c), pg)
        return pg

    def _importance_weights(self, prev: torch.Tensor, generation: torch.Tensor, token_mask: torch.Tensor,
                            sample_mask: torch.Tensor, token_mean: Any, seqs: float
                            ) -> tuple[torch.Tensor, dict[str, float]]:
        """exp(prev - generation) per token, or per sequence (``[b, 1]``) with GSPO, after the
        configured truncation, with the fraction it put out of bounds (``is_oob_ratio``)."""
        with torch.no_grad():
            if self.sequence_level_importance_ratios:
                mask = token_mask * sample_mask.unsqueeze(1)
                weights = _finite(((prev - generation) * mask).sum(1).exp()).unsqueeze(1)
            else:
                weights = _finite((prev - generation).exp())
            kind = self.truncated_importance_sampling_type
            if kind is None and self.truncated_importance_sampling_ratio is not None:
                kind = "tis"
            if kind is None:
                return weights, {}
            high = float(self.truncated_importance_sampling_ratio)  # type: ignore[arg-type]
            low = float(self.truncated_importance_sampling_ratio_min or 0.0)
            if kind == "tis":
                outside = float(token_mean(((weights > high) | (weights < low)).to(weights.dtype)))
                return weights.clamp(low, high), {"is_oob_ratio": outside}
            if kind == "icepop":
                kept = (weights >= low) & (weights <= high)
                outside = float(token_mean((~kept).to(weights.dtype)))
                return torch.where(kept, weights, torch.zeros_like(weights)), {"is_oob_ratio": outside}
            log_weights = _finite(prev - generation)
            geometric = sequence_mean(log_weights, token_mask).exp()
            kept_sequences = ((geometric >= low) & (geometric <= high)).to(weights.dtype)
            outside = float(((1 - kept_sequences) * sample_mask).sum() / seqs)
            return weights * kept_sequences.unsqueeze(1), {"is_oob_ratio": outside}

    def _kl(self, logprobs: torch.Tensor, fields: Mapping[str, torch.Tensor],
            generation: torch.Tensor) -> torch.Tensor | None:
        """Per-token penalty, beta x the weighted KL estimate, or None without a KL term."""
        if not self.reference_policy_kl_penalty or self.use_kl_in_reward:
            return None
        sampler = generation if self.use_on_policy_kl_approximation else logprobs.detach()
        weights = _finite((logprobs - sampler).exp())
        return self.reference_policy_kl_penalty * kl_estimate(
            logprobs, fields["reference_logprobs"].to(logprobs.dtype), self.reference_policy_kl_type,
            self.kl_input_clamp_value, self.kl_output_clamp_value, importance_weights=weights)


def mismatch_metrics(prev: torch.Tensor, generation: torch.Tensor, logprobs: torch.Tensor, token_mean: Any,
                     kl_type: Literal["k1", "k2", "k3"]) -> dict[str, float]:
    """How far the engine's sampling distribution is from the trainer's, NeMo RL's names:
    ``token_mult_prob_error`` (mean of exp|log p_gen - log p_train|, 1 when they agree),
    ``gen_kl_error`` KL(gen || train), ``policy_kl_error`` KL(train || gen), ``js_divergence_error``,
    and ``approx_entropy`` (the policy's entropy estimated from the engine's samples)."""
    mixture = torch.log(0.5 * prev.exp() + 0.5 * generation.exp())
    to_mixture, gen_to_mixture = kl_estimate(mixture, prev, "k3"), kl_estimate(mixture, generation, "k3")
    return {
        "token_mult_prob_error": float(token_mean((generation - prev).abs().exp())),
        "gen_kl_error": float(token_mean(kl_estimate(generation, prev, kl_type))),
        "policy_kl_error": float(token_mean(kl_estimate(prev, generation, kl_type))),
        "js_divergence_error": float(token_mean(0.5 * to_mixture + 0.5 * gen_to_mixture)),
        "approx_entropy": float(-token_mean((logprobs - generation).exp() * logprobs)),
    }
