"""A plain Hugging Face causal LM as a refit weight source.

Tests and benchmarks need a weight source that is not a training backend (the backends are
plugins; the core cannot depend on them), and a plain ``AutoModelForCausalLM`` is also the honest
reference for "the policy's current weights": perturb or train it, refit, and compare.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from nrl_core.contracts import WeightSpec
from nrl_core.refit.buckets import Bucket, dtype_name, iter_buckets, parse_dtype

if TYPE_CHECKING:
    import torch


def checkpoint_layout(model: Any, named: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Parameters of an HF model (one, to stream, or a whole state dict) as the tensors its
    checkpoint files store.

    Why: transformers fuses some weights in memory that checkpoints keep apart (a MoE layer's
    experts become one ``[experts, 2 * width, hidden]`` ``gate_up_proj``); refit sends what the
    files hold, since that is what a generation engine loads and checks a refit against, one
    tensor per expert. transformers' own reverse mapping does the split (views, no copies), so
    every family it converts is covered; a model it does not convert costs one check, cached.
    """
    from transformers.core_model_loading import revert_weight_conversion

    converts = getattr(model, "_nrl_checkpoint_layout_differs", None)
    if converts is None:
        meta = {k: v.to("meta") for k, v in model.state_dict().items()}
        converts = model._nrl_checkpoint_layout_differs = revert_weight_conversion(model, meta).keys() != meta.keys()
    return list(revert_weight_conversion(model, dict(named)).items()) if converts else list(named.items())


class HFWeightSource:
    """Offers ``weight_manifest`` / ``export_weights`` (the training-worker refit contract) over
    an HF model's ``state_dict`` (HF names, full tensors). Pass a model or a local model dir."""

    def __init__(self, model: Any | str | os.PathLike[str], dtype: str = "float32") -> None:
        if isinstance(model, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=parse_dtype(dtype))
        self.model = model

    def _named(self, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor cast as it is taken (the layout's split makes views), so a stream in
        another dtype holds one bucket of casts at a time, not the whole model."""
        target = parse_dtype(dtype)
        for name, tensor in checkpoint_layout(self.model, self.model.state_dict()):
            yield name, tensor.detach().to(target)

    def weight_manifest(self, dtype: str) -> list[WeightSpec]:
        name = dtype_name(parse_dtype(dtype))
        meta = {key: full.to("meta") for key, full in self.model.state_dict().items()}
        return [WeightSpec(name=n, shape=tuple(int(d) for d in t.shape), dtype=name)
                for n, t in checkpoint_layout(self.model, meta)]

    def export_weights(self, bucket_bytes: int, dtype: str) -> Iterator[Bucket]:
        return iter_buckets(self._named(dtype), bucket_bytes)

