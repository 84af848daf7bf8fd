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


def module_of(name: str) -> str:
    """The module a weight belongs to, as a receiver loading module by module sees it: up to the
    first numbered part of its name (``model.layers.3``), else the name less its last part."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return name.rpartition(".")[0]


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group ``named`` in order into buckets whose total size stays within ``bucket_bytes`` (a
    single larger tensor forms its own bucket).

    A bucket also ends where a module ends (:func:`module_of`, a decoder layer) when the next
    module, if as large as the last whole one, would not fit in what is left. vLLM's layerwise
    reload keeps a module's tensors until it has all of them, so a module split over two buckets
    makes the receiver hold its part of the first bucket, or a copy of it, while the second
    arrives; a module larger than a bucket is split all the same.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: Bucket = []
    size = 0
    module: str | None = None
    module_bytes = last_module_bytes = 0
    for name, tensor in named:
        nbytes = tensor_nbytes(tensor)
        key = module_of(name)
        if key != module:
            if module is not None:
                last_module_bytes = module_bytes
            module, module_bytes = key, 0
            if bucket and size + last_module_bytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
        module_bytes += nbytes
    if bucket:
        yield bucket


def spec_of(name: str, tensor: torch.Tensor) -> WeightSpec:
    return WeightSpec(name=name, shape=tuple(int(d) for d in tensor.shape), dtype=dtype_name(tensor.dtype))


def manifest_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[WeightSpec]:
    """The manifest describing ``named`` (names, shapes, dtypes)."""
    return [spec_of(name, tensor) for name, tensor in named]


def manifest_bytes(manifest: Iterable[WeightSpec]) -> int:
    return sum(spec.nbytes for spec in manifest)
