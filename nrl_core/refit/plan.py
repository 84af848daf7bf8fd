"""How a run's refits move the weights, decided once per run: :class:`RefitPlan`.

A refit used to take its transport, sizes and three switches (in flight, pipelined, partial) as
separate arguments, recomputed by each caller. The plan holds them as what they are: a transport
override, one mode of landing the weights, what each engine rank receives, and the sizes. The run
builds it from its config and the engines' declared capabilities (:meth:`RefitPlan.for_run`); a
refit that differs (an in-flight one) is the same plan with another mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from nrl_core.refit.buckets import DEFAULT_BUCKET_BYTES, bucket_bytes_from_gb

__all__ = ["DEFAULT_PLAN", "Delivery", "RefitMode", "RefitPlan"]


class RefitMode(StrEnum):
    """How the weights land in the engines."""

    STAGED = "staged"
    """Every bucket arrives before any loads: a refit refused or failed part-way keeps the old weights."""
    PIPELINED = "pipelined"
    """Each bucket loads as it arrives (engines declaring ``pipelined_import``): one bucket of memory
    instead of the model's; a failure part-way leaves the engines refusing to generate until a refit
    succeeds."""
    IN_FLIGHT = "in_flight"
    """The engines (in actors of their own) import beside the generation they may be streaming;
    bucket by bucket as they arrive when the run's refits are pipelined (``streams_in_flight``)."""


class Delivery(StrEnum):
    """What each engine rank receives."""

    WHOLE = "whole"
    """Every tensor of the manifest."""
    WANTED = "wanted"
    """What the rank's ``refit_wants`` names (engines declaring ``partial_import``)."""


@dataclass(frozen=True)
class RefitPlan:
    """A run's refit: ``transport`` overrides the choice by placement (None: by placement);
    ``dtype`` None is each weight owner's default precision; ``timeout_s`` bounds a collective
    transport's own group; ``streams_in_flight``: in-flight imports, too, load each bucket as it
    arrives (the run's refits are pipelined). Strings are accepted for ``mode`` and ``delivery``."""

    transport: str | None = None
    mode: RefitMode = RefitMode.STAGED
    delivery: Delivery = Delivery.WHOLE
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    dtype: str | None = "float32"
    timeout_s: float | None = None
    streams_in_flight: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", RefitMode(self.mode))
        object.__setattr__(self, "delivery", Delivery(self.delivery))

    @property
    def pipelined(self) -> bool:
        return self.mode is RefitMode.PIPELINED

    @property
    def in_flight(self) -> bool:
        return self.mode is RefitMode.IN_FLIGHT

    @property
    def streams(self) -> bool:
        """Whether the engines load each bucket as it arrives: pipelined, or in flight in a run
        whose refits are pipelined."""
        return self.pipelined or (self.in_flight and self.streams_in_flight)

    @property
    def wanted(self) -> bool:
        return self.delivery is Delivery.WANTED

    def with_mode(self, mode: RefitMode | str) -> RefitPlan:
        return dataclasses.replace(self, mode=RefitMode(mode))

    @classmethod
    def for_run(cls, config: Mapping[str, Any], capabilities: frozenset[str] | set[str] = frozenset(),
                timeout_s: float | None = None) -> RefitPlan:
        """The plan of a validated config's refits into engines declaring ``capabilities``:
        ``policy.refit.transport`` (null: by placement); the bucket size from
        ``policy.refit_buffer_size_gb`` (NeMo RL's spelling, GiB) when set, else
        ``policy.refit.bucket_size_mb`` (MiB); the dtype from ``policy.precision``; pipelined when
        ``policy.refit.pipelined`` and the engines can (adapter-only refits never are: the engines'
        adapter import is atomic); each rank its wanted tensors when the engines can."""
        policy = config.get("policy", {}) or {}
        section = policy.get("refit") or {}
        gb, mb = policy.get("refit_buffer_size_gb"), section.get("bucket_size_mb")
        bucket_bytes = bucket_bytes_from_gb(gb) if gb else bucket_bytes_from_gb(mb / 1024) if mb else DEFAULT_BUCKET_BYTES
        pipelined = (bool(section.get("pipelined")) and "pipelined_import" in capabilities
                     and not section.get("adapters"))
        return cls(transport=section.get("transport"), bucket_bytes=bucket_bytes, dtype=policy.get("precision"),
                   timeout_s=timeout_s, mode=RefitMode.PIPELINED if pipelined else RefitMode.STAGED,
                   streams_in_flight=pipelined,
                   delivery=Delivery.WANTED if "partial_import" in capabilities else Delivery.WHOLE)


DEFAULT_PLAN = RefitPlan()
"""Staged, whole, by placement, the default bucket size, float32."""
