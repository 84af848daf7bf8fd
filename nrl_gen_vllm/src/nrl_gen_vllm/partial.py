"""Which of a refit's tensors one engine rank loads (``partial_import``, contract 14).

Under expert parallelism each rank of a vLLM engine holds some of each MoE layer's experts, and
vLLM's loaders skip the checkpoint tensors of the others (the layer's ``expert_map`` gives them no
local slot). Those tensors are exactly what a rank names as not wanted, so a refit never sends
them to it. Everything else (attention, norms, routers, shared experts, and tensor-parallel
weights, which each rank slices itself) is wanted whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


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
