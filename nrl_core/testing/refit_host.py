"""Engine-free workers for refit tests and benchmarks: a seeded random weight source and a sink
that records what arrived, built by a :class:`~nrl_core.cluster.worker_group.WorkerGroup` like any
backend's worker (``rank``/``world_size`` keywords) or directly in one process.
"""

from __future__ import annotations

from typing import Any


class RandomWeightSource:
    """A weight source of seeded random tensors (``{name: shape}``), for engine-free refit tests."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int = 0, dtype: str = "float32",
                 rank: int = 0, world_size: int = 1) -> None:
        import torch

        from nrl_core.refit.buckets import parse_dtype

        gen = torch.Generator().manual_seed(seed)
        self.tensors = {name: torch.randn(shape, generator=gen).to(parse_dtype(dtype)) for name, shape in shapes.items()}
        self.exports = 0  # how many times export_weights ran (a sharded backend's collective)

    def weight_manifest(self, dtype: str) -> list[Any]:
        from nrl_core.refit.buckets import manifest_of

        return manifest_of(self._named(dtype))

    def _named(self, dtype: str) -> Any:
        from nrl_core.refit.buckets import parse_dtype

        return ((name, t.to(parse_dtype(dtype))) for name, t in self.tensors.items())

    def export_weights(self, bucket_bytes: int, dtype: str) -> Any:
        from nrl_core.refit.buckets import iter_buckets

        self.exports += 1
        return iter_buckets(self._named(dtype), bucket_bytes)

    def checksums(self) -> dict[str, float]:
        return {name: float(t.double().sum()) for name, t in self.tensors.items()}


class RecordingSink:
    """A generation-side stand-in that verifies the manifest and keeps a copy of what arrived."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.weight_version = 0
        self.received: dict[str, Any] = {}
        self.buckets = 0

    def import_weights(self, buckets: Any, manifest: list[Any]) -> int:
        from nrl_core.refit.buckets import spec_of
        from nrl_core.refit.manifest import verify

        staged = []
        for bucket in buckets:
            self.buckets += 1
            staged.extend(bucket)
        verify([spec_of(n, t) for n, t in staged], manifest)
        self.received = {name: t.clone() for name, t in staged}
        self.weight_version += 1
        return self.weight_version

    def checksums(self) -> dict[str, float]:
        return {name: float(t.double().sum()) for name, t in self.received.items()}


class PipelinedRecordingSink(RecordingSink):
    """A :class:`RecordingSink` that declares ``pipelined_import``: each tensor is kept the moment
    it is proven to be the manifest's, so a transfer that fails part-way leaves a mix (``torn``
    says why) until an import succeeds. ``on_first_tensor`` (a path) is created when the first
    tensor of an import arrives: a test's proof that loading began before the export ended."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(rank, world_size)
        self.torn: str | None = None
        self.on_first_tensor: str | None = None
        self.loaded = 0

    def import_weights_pipelined(self, buckets: Any, manifest: list[Any]) -> int:
        from nrl_core.refit.manifest import TornRefitError, verified_stream

        self.loaded = 0
        try:
            for name, tensor in verified_stream(buckets, manifest):
                if self.loaded == 0 and self.on_first_tensor:
                    open(self.on_first_tensor, "w").close()
                self.received[name] = tensor.clone()
                self.loaded += 1
        except BaseException as exc:
            if self.loaded == 0:  # nothing was kept: the sink holds what it held
                raise
            self.torn = f"failed after {self.loaded} tensors: {exc}"
            raise TornRefitError(self.torn) from exc
        self.torn = None
        self.weight_version += 1
        return self.weight_version


class PartialRecordingSink(RecordingSink):
    """A :class:`RecordingSink` that declares ``partial_import``: rank ``r`` loads the tensors whose
    names contain one of ``parts[r]`` (all of them when it has no entry); ``asked`` counts its
    ``refit_wants`` calls."""

    def __init__(self, parts: dict[int, list[str]] | None = None, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(rank, world_size)
        self.parts = (parts or {}).get(rank)
        self.asked = 0

    def refit_wants(self, manifest: list[Any]) -> list[str]:
        self.asked += 1
        return [spec.name for spec in manifest
                if self.parts is None or any(part in spec.name for part in self.parts)]


class SlicedRecordingSink(RecordingSink):
    """A :class:`RecordingSink` that declares ``partial_import`` and ``sliced_import``, as a rank of
    a tensor-parallel engine: rank ``r`` of ``world_size`` names the ``r``-th block of rows of each
    tensor whose first dimension ``world_size`` divides (the others whole) and keeps exactly what
    it reads out of what arrives: its blocks (``received``) and the bytes it copied (``copied``).
    ``expert_parallel``: as vLLM's expert parallelism, the rank names its contiguous share of a
    mixture-of-experts layer's experts whole, no other expert, and the router whole (replicated).
    ``overreach``: it also reads the row before its block, which it did not name."""

    def __init__(self, rank: int = 0, world_size: int = 1, expert_parallel: bool = False) -> None:
        super().__init__(rank, world_size)
        self.rank, self.world_size, self.copied, self.overreach = rank, world_size, 0, False
        self.expert_parallel = expert_parallel
        self.blocks: dict[str, tuple[int, int]] = {}

    def refit_wants(self, manifest: list[Any]) -> list[Any]:
        from nrl_core.refit.slices import WeightSlice

        experts = _experts_per_layer(manifest) if self.expert_parallel else 0
        wants: list[Any] = []
        for spec in manifest:
            expert = _expert_of(spec.name) if experts else None
            if expert is not None:
                if expert * self.world_size // experts == self.rank:
                    wants.append(spec.name)
                continue
            rows = spec.shape[0] // self.world_size if spec.shape else 0
            if self.world_size > 1 and rows and spec.shape[0] % self.world_size == 0 and not (
                    experts and ".mlp.gate." in spec.name):
                self.blocks[spec.name] = (self.rank * rows, (self.rank + 1) * rows)
                wants.append(WeightSlice(spec.name, (self.blocks[spec.name], *((0, d) for d in spec.shape[1:]))))
            else:
                wants.append(spec.name)
        return wants

    def import_weights(self, buckets: Any, manifest: list[Any]) -> int:
        from nrl_core.refit.buckets import spec_of
        from nrl_core.refit.manifest import verify

        staged = [item for bucket in buckets for item in bucket]
        verify([spec_of(n, t) for n, t in staged], manifest)
        received, copied = {}, 0
        for name, tensor in staged:
            start, stop = self.blocks.get(name, (0, tensor.shape[0] if tensor.dim() else 0))
            if self.overreach and start > 0:
                start -= 1
            block = tensor[start:stop].clone() if tensor.dim() else tensor.clone()
            received[name] = block
            copied += block.numel() * block.element_size()
        self.received, self.copied = received, copied
        self.weight_version += 1
        return self.weight_version


def _expert_of(name: str) -> int | None:
    """The expert index in an HF mixture-of-experts name (``...mlp.experts.<e>.``), else None."""
    _, marker, rest = name.partition(".mlp.experts.")
    return int(rest.split(".", 1)[0]) if marker and rest.split(".", 1)[0].isdigit() else None


def _experts_per_layer(manifest: list[Any]) -> int:
    return 1 + max((e for spec in manifest if (e := _expert_of(spec.name)) is not None), default=-1)


def fail_export_after(count: int) -> Any:
    """A ``WorkerHost.execute`` target that makes the hosted weight source raise after ``count``
    buckets of each export (an instance attribute shadowing the method; delete it to undo): a
    training side that fails mid-export."""

    def patch(worker: Any) -> None:
        real = type(worker).export_weights.__get__(worker)

        def export_weights(bucket_bytes: int, dtype: str) -> Any:
            for k, bucket in enumerate(real(bucket_bytes, dtype)):
                if k == count:
                    raise RuntimeError("the training side failed mid-export")
                yield bucket

        worker.export_weights = export_weights

    return patch


def perturb_weights(model: Any, seed: int, scale: float = 0.05) -> None:
    """Add seeded noise to every parameter: a deterministic stand-in for training steps (the same
    seed gives the same tensors in any process)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.add_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * scale)


def perturb_hosted_source(worker: Any, seed: int, scale: float = 0.05, fresh_from: str | None = None) -> None:
    """``WorkerHost.execute`` target: perturb the HF model of a hosted training-side weight source
    (first reloading it from the checkpoint ``fresh_from`` when given)."""
    if fresh_from is not None:
        from nrl_core.refit.hf_source import HFWeightSource

        worker.model = HFWeightSource(fresh_from).model
    perturb_weights(worker.model, seed, scale)


class RankedHFSource:
    """An HF weight source built the way worker groups build workers (``rank``/``world_size``
    keywords): a training-side stand-in for engine tests at world sizes above 1."""

    def __new__(cls, model: str, rank: int = 0, world_size: int = 1) -> Any:
        from nrl_core.refit.hf_source import HFWeightSource

        return HFWeightSource(model)
