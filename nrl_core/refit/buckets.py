"""Size-bounded weight buckets and manifests.

A refit streams the whole model, so the training side never materialises a second full copy: it
yields tensors in buckets of at most ``bucket_bytes`` (a single larger tensor forms its own
bucket), and the transport moves one bucket at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from nrl_core.contracts import WeightSpec

if TYPE_CHECKING:
    import torch

Bucket = list[tuple[str, "torch.Tensor"]]
"""One bucket: HF-named full tensors."""

DEFAULT_BUCKET_BYTES = 512 * 2**20
"""Default bucket size (512 MiB): large enough that per-bucket overhead is negligible, small
enough that a bucket's staging copy never dominates memory."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the spelling manifests use."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str | None) -> torch.dtype:
    """``"float32"`` (or ``"torch.float32"``, ``"bf16"``, ``"fp16"``...) -> the torch dtype. ``None``
    (``policy.precision`` left null) is this process's default precision
    (:func:`nrl_core.device.resolve_precision`), so every reader of the config resolves it alike."""
    import torch

    if name is None:
        from nrl_core.device import resolve_precision

        name = resolve_precision(None)
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    key = name.removeprefix("torch.")
    key = aliases.get(key, key)
    dtype = getattr(torch, key, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"'{name}' is not a torch dtype")
    return dtype


def refit_dtype(dtype: str | None) -> str:
    """The manifest spelling of a refit's ``dtype``; ``None`` resolves in the calling process (the
    weights' owner), not on a driver that may have no GPU."""
    return dtype_name(parse_dtype(dtype))


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucket_bytes_from_gb(gb: float) -> int:
    """``policy.refit_buffer_size_gb`` (GiB, may be fractional) -> bytes, at least 1 MiB."""
    return max(2**20, int(gb * 2**30))


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group ``named`` in order into buckets whose total size stays within ``bucket_bytes``.

    Order is preserved so a layer's weights tend to arrive together (vLLM's layerwise reload
    processes a layer as soon as all of its weights have arrived).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: Bucket = []
    size = 0
    for name, tensor in named:
        nbytes = tensor_nbytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def spec_of(name: str, tensor: torch.Tensor) -> WeightSpec:
    return WeightSpec(name=name, shape=tuple(int(d) for d in tensor.shape), dtype=dtype_name(tensor.dtype))


def manifest_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[WeightSpec]:
    """The manifest describing ``named`` (names, shapes, dtypes)."""
    return [spec_of(name, tensor) for name, tensor in named]


def manifest_bytes(manifest: Iterable[WeightSpec]) -> int:
    return sum(spec.nbytes for spec in manifest)
