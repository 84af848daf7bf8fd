"""A plain Hugging Face causal LM as a refit weight source.

Tests and benchmarks need a weight source that is not a training backend (the backends are
plugins; the core cannot depend on them), and a plain ``AutoModelForCausalLM`` is also the honest
reference for "the policy's current weights": perturb or train it, refit, and compare.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterator

from nrl_core.contracts import WeightSpec
from nrl_core.refit.buckets import Bucket, dtype_name, iter_buckets, parse_dtype

if TYPE_CHECKING:
    import torch


class HFWeightSource:
    """Offers ``weight_manifest`` / ``export_weights`` (the training-worker refit contract) over
    an HF model's ``state_dict`` (HF names, full tensors). Pass a model or a local model dir."""

    def __init__(self, model: "Any | str | os.PathLike[str]", dtype: str = "float32") -> None:
        if isinstance(model, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=parse_dtype(dtype))
        self.model = model

    def _named(self, dtype: str) -> Iterator[tuple[str, "torch.Tensor"]]:
        target = parse_dtype(dtype)
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach().to(target)

    def weight_manifest(self, dtype: str) -> list[WeightSpec]:
        name = dtype_name(parse_dtype(dtype))
        return [WeightSpec(name=n, shape=tuple(int(d) for d in t.shape), dtype=name)
                for n, t in self.model.state_dict().items()]

    def export_weights(self, bucket_bytes: int, dtype: str) -> Iterator[Bucket]:
        return iter_buckets(self._named(dtype), bucket_bytes)

