"""Which combinations of ``loss_fn`` keys make sense: one rule set for ``nrl config check`` and for
losses built in code. Imports nothing heavy, so config checks can use it without torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TRUNCATION_TYPES = ("tis", "icepop", "seq-mask-tis")


def loss_config_problem(cfg: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first inconsistent combination of ``loss_fn`` keys, as (key, what is wrong and how to
    fix it), or None. One rule set for ``nrl config check`` and for losses built in code."""
    get = cfg.get
    clip_c = get("ratio_clip_c")
    if clip_c is not None and clip_c <= 1:
        return "loss_fn.ratio_clip_c", f"must be greater than 1 (dual clip, usually 3) or null, got {clip_c}"
    if get("sequence_level_importance_ratios") and get("token_level_loss", True):
        return ("loss_fn.sequence_level_importance_ratios",
                "sequence-level ratios (GSPO) average per sequence; set loss_fn.token_level_loss: false")
    if get("use_cispo"):
        for key in ("disable_ppo_ratio", "force_on_policy_ratio", "sequence_level_importance_ratios"):
            if get(key):
                return "loss_fn.use_cispo", f"CISPO weighs each token by its clipped ratio, which loss_fn.{key} removes; set one of them false"
        if clip_c is not None:
            return "loss_fn.use_cispo", "CISPO replaces the clipped objective that dual clipping bounds; set loss_fn.ratio_clip_c: null"
        if not get("token_level_loss", True):
            return "loss_fn.use_cispo", "CISPO is a token-level loss; set loss_fn.token_level_loss: true"
    kind, high, low = (get("truncated_importance_sampling_type"), get("truncated_importance_sampling_ratio"),
                       get("truncated_importance_sampling_ratio_min"))
    if kind is None and high is None:
        return None
    if kind is not None and kind not in TRUNCATION_TYPES:
        return "loss_fn.truncated_importance_sampling_type", f"must be one of {', '.join(TRUNCATION_TYPES)} or null, got {kind!r}"
    if not get("use_importance_sampling_correction"):
        return ("loss_fn.truncated_importance_sampling_ratio" if kind is None else "loss_fn.truncated_importance_sampling_type",
                "truncates the importance-sampling weights; set loss_fn.use_importance_sampling_correction: true")
    if high is None or high <= 0:
        return "loss_fn.truncated_importance_sampling_ratio", f"must be a positive upper bound with truncated importance sampling, got {high}"
    if low is not None and low > high:
        return "loss_fn.truncated_importance_sampling_ratio_min", f"{low} exceeds truncated_importance_sampling_ratio {high}"
    if kind in ("icepop", "seq-mask-tis") and low is None:
        return "loss_fn.truncated_importance_sampling_ratio_min", f"{kind} keeps weights within [min, max]; set the lower bound"
    if kind == "seq-mask-tis" and get("sequence_level_importance_ratios"):
        return ("loss_fn.truncated_importance_sampling_type",
                "seq-mask-tis masks sequences of token-level weights; it cannot be combined with sequence_level_importance_ratios")
    return None
