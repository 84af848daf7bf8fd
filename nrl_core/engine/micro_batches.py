"""Which rows of a rank's shard go into which micro-batch, and what a forward is asked for.

The grouping is the same on every backend (fixed count, dynamic token budget, or packed bins), so
it lives here; how a group becomes model inputs (padding, packing layout) is the backend's. Every
rank of a step runs the same number of micro-batches (collectives inside the forward and the
gradient reduction need that): a rank with fewer gets padding micro-batches, which stand in one
real row and count for nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nrl_core.contracts import LossFunction, TokenBatch
from nrl_core.data import dynamic_micro_batches, pack_bins
from nrl_core.errors import ConfigError

KINDS = ("logprobs", "values", "topk", "gathered")


@dataclass(frozen=True)
class ForwardRequest:
    """What a forward returns, as a tuple of ``[n, T, ...]`` tensors aligned with the micro-batch's
    rows as in :class:`TokenBatch` (zeros past each row's length):

    * ``logprobs``: ``(logprobs [n, T],)`` of the input tokens under the sampling temperature;
    * ``values``: ``(values [n, T],)`` of a value head, unshifted;
    * ``topk``: ``(logprobs [n, T, k], ids [n, T, k])``, the ``k`` likeliest next tokens;
    * ``gathered``: ``(logprobs [n, T, k],)`` of the ids in ``batch.fields[ids_field]``.
    """

    kind: str = "logprobs"
    k: int = 0
    ids_field: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"forward request kind {self.kind!r}; one of {', '.join(KINDS)}")

    @classmethod
    def for_loss(cls, loss_fn: LossFunction) -> ForwardRequest:
        """What ``loss_fn`` reads: values (``reads_values``), gathered logprobs
        (``gather_ids_field``) or token logprobs."""
        if getattr(loss_fn, "reads_values", False):
            return cls("values")
        ids_field = getattr(loss_fn, "gather_ids_field", None)
        return cls("gathered", ids_field=ids_field) if ids_field else cls("logprobs")

    @property
    def shifted(self) -> bool:
        """Logprobs at position ``t`` read tokens before ``t``; a value head's read ``t`` itself."""
        return self.kind != "values"


@dataclass(kw_only=True)
class MicroBatch:
    """One micro-batch of a rank's shard. ``batch`` holds the rows ``rows`` (trimmed to their
    longest); a padding micro-batch has no ``rows`` and one stand-in row in ``batch``. ``inputs``
    is the backend's own layout of it, set in ``TrainingEngine.lay_out``."""

    rows: list[int]
    batch: TokenBatch
    train: bool
    packed: bool = False
    inputs: Any = None

    @property
    def padding(self) -> bool:
        return not self.rows


def token_budget(policy: Mapping[str, Any], *, train: bool) -> int | None:
    """The micro-batch token budget of sequence packing or dynamic batching (NeMo RL's
    ``train_mb_tokens``/``logprob_mb_tokens``, the latter falling back to the former), or None."""
    section = _token_section(policy)
    return None if section is None else _budget(section, policy, train=train)


def _budget(section: Mapping[str, Any], policy: Mapping[str, Any], *, train: bool) -> int:
    budget = section.get("train_mb_tokens" if train else "logprob_mb_tokens") or section.get("train_mb_tokens")
    return int(budget or policy["max_total_sequence_length"])


def _token_section(policy: Mapping[str, Any]) -> Mapping[str, Any] | None:
    packing = policy.get("sequence_packing") or {}
    dynamic = policy.get("dynamic_batching") or {}
    if packing.get("enabled") and dynamic.get("enabled"):
        raise ConfigError("policy.sequence_packing.enabled",
                          "sequence packing and dynamic batching cannot both be enabled; pick one")
    return packing if packing.get("enabled") else dynamic if dynamic.get("enabled") else None


def plan_micro_batches(local: TokenBatch, policy: Mapping[str, Any], *, train: bool, seed: int = 0,
                       group: Any = None) -> list[MicroBatch]:
    """Micro-batches covering every row of ``local`` once, as ``policy`` says; where the count
    depends on the data (packing, dynamic batching) it is made equal over ``group`` (None: the
    world) with padding micro-batches. Fixed-size plans need no collective: every rank's shard has
    the same size (``TrainingEngine.local_batch`` refuses a batch that does not divide)."""
    packed = bool((policy.get("sequence_packing") or {}).get("enabled"))
    section = _token_section(policy)
    lengths = [int(n) for n in local.input_lengths]
    if section is None:
        size = int(policy.get("train_micro_batch_size" if train else "logprob_batch_size") or local.size or 1)
        groups = [list(range(s, min(s + size, local.size))) for s in range(0, local.size, size)]
        return [MicroBatch(rows=g, batch=local.select(g), train=train) for g in groups]
    round_to = int(section.get("sequence_length_round") or 1)
    budget = _budget(section, policy, train=train)
    if packed:
        groups = [sorted(b) for b in pack_bins(lengths, budget, section.get("algorithm") or
                                               "modified_first_fit_decreasing", round_to=round_to, seed=seed)]
    else:
        groups = [sorted(g) for g in dynamic_micro_batches(lengths, budget, round_to=round_to)] if lengths else []
    count = _max_over(len(groups), group)
    # the shortest row stands in for a padding micro-batch: the cheapest real forward and backward
    stand_in = local.select([min(range(local.size), key=lambda r: lengths[r])]) if local.size else local
    out = [MicroBatch(rows=g, batch=local.select(g), train=train, packed=packed) for g in groups]
    return out + [MicroBatch(rows=[], batch=stand_in, train=train, packed=packed) for _ in range(count - len(groups))]


def _max_over(count: int, group: Any) -> int:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return count
    from nrl_core.device import all_reduce

    return int(all_reduce(torch.tensor([count], dtype=torch.long), op=dist.ReduceOp.MAX, group=group))
