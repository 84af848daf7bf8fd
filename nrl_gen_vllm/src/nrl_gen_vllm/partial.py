"""Which of a refit's tensors one engine rank loads (``partial_import``, contract 14), and which
block of each (``sliced_import``).

Under expert parallelism each rank of a vLLM engine holds some of each MoE layer's experts, and
vLLM's loaders skip the checkpoint tensors of the others (the layer's ``expert_map`` gives them no
local slot). Those tensors are exactly what a rank names as not wanted, so a refit never sends
them to it. Everything else (attention, norms, routers, shared experts, and tensor-parallel
weights, which each rank slices itself) is wanted.

Under tensor parallelism a rank's loaders copy out only its block of most tensors. vLLM has no
table of those blocks (each layer's loader computes its own), so a rank learns them from its
first refit, which arrives whole: the read counter (``refit_reads.py``) records the box of each
tensor the loaders read, and the rank names those boxes in every later refit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from nrl_core.api import WeightSlice, WeightSpec


def experts_elsewhere(names: Iterable[str], held: Mapping[str, Iterable[int]]) -> frozenset[str]:
    """The ``names`` of per-expert tensors of the MoE layers in ``held`` (a layer's prefix, e.g.
    ``model.layers.0.mlp.experts``, mapped to the global ids of the experts this rank holds) whose
    expert this rank does not hold: ``model.layers.0.mlp.experts.5.gate_proj.weight`` when expert 5
    is another rank's."""
    held_ids = {layer: frozenset(int(e) for e in experts) for layer, experts in held.items()}
    elsewhere = set()
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                ids = held_ids.get(".".join(parts[:i]))
                if ids is not None and int(part) not in ids:
                    elsewhere.add(name)
    return frozenset(elsewhere)


def sliced_wants(manifest: Sequence[WeightSpec], wanted: Iterable[str],
                 learned: Mapping[str, Sequence[Sequence[int]] | None]) -> list[Any]:
    """``wanted`` (names of ``manifest``), each as the block ``learned`` holds for it when that is
    a box inside the tensor smaller than the whole; otherwise by name (whole)."""
    shapes = {spec.name: tuple(spec.shape) for spec in manifest}
    out: list[Any] = []
    for name in wanted:
        box = learned.get(name)
        shape = shapes.get(name, ())
        region = tuple((int(a), int(b)) for a, b in box) if box is not None else None
        if region is not None and len(region) == len(shape) and \
                all(0 <= a <= b <= size for (a, b), size in zip(region, shape)) and \
                any((a, b) != (0, size) for (a, b), size in zip(region, shape)):
            out.append(WeightSlice(name, region))
        else:
            out.append(name)
    return out
