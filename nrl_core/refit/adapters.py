"""Adapter-only refit (``policy.refit.adapters``): the same transports and manifest check as a
weight refit, with a LoRA run's adapters in place of its weights.

:class:`AdapterSource` shows a training worker's adapters where a refit reads weights, and
:class:`AdapterSink` hands what arrives to the generation worker's ``import_adapter``, so the
refit's code paths stay one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from nrl_core.contracts import WeightSpec


class AdapterSource:
    """A training worker (an ``AdapterExporter``) seen as a refit source of its adapters."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def weight_manifest(self, dtype: str) -> list[WeightSpec]:
        return list(self.worker.adapter_manifest(dtype))

    def export_weights(self, bucket_bytes: int, dtype: str) -> Iterator[list[tuple[str, Any]]]:
        return self.worker.export_adapter(bucket_bytes, dtype)


class AdapterSink:
    """A generation worker (an ``AdapterServer``) seen as a refit sink of adapters."""

    def __init__(self, worker: Any, adapter_config: Mapping[str, Any]) -> None:
        self.worker = worker
        self.adapter_config = dict(adapter_config)

    def import_weights(self, buckets: Iterable[list[tuple[str, Any]]], manifest: list[WeightSpec]) -> int:
        return int(self.worker.import_adapter(buckets, manifest, self.adapter_config))


def plain_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A PEFT ``LoraConfig.to_dict()`` as plain JSON values (sets as sorted lists, enums as
    strings): what ``adapter_config`` returns and the engine writes as ``adapter_config.json``."""
    import json

    return json.loads(json.dumps(dict(config), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
