"""Router load-balance statistics of a mixture-of-experts model, one definition for every backend.

Why in the core: both training backends report these numbers for the same batch, and a user
comparing a Megatron run with a DTensor run must be comparing the same quantity. A backend hooks
its routers, wraps each training micro-batch's forward in :meth:`RouterStats.recording` (valid
tokens only: padding is routed too but says nothing about balance; recomputation in backward and
logprob passes happen outside and are not counted), feeds :meth:`RouterStats.add` from the hooks
while :attr:`RouterStats.active`, sums :meth:`RouterStats.totals` over its ranks and reads
:func:`balance_metrics`.

With ``c_i`` the tokens routed to expert ``i`` of a layer, ``P_i`` the router probability mass on
``i`` (softmax over all experts, summed over tokens), ``T`` the layer's tokens, ``k`` the top-k and
``E`` the experts, ``f_i = c_i / (k T)`` and ``p_i = P_i / T``:

* ``moe/load_balance``: ``E * sum_i f_i p_i``, the Switch Transformer load-balancing loss without
  its coefficient (Megatron's ``aux_loss`` before ``moe_aux_loss_coeff``), averaged over layers;
  1.0 when routing is uniform, up to ``E / k`` when collapsed;
* ``moe/expert_load_max`` and ``moe/expert_load_min``: the largest and smallest ``E * f_i`` over
  every layer's experts: 1.0 is a perfectly even share, 0 an expert that received no token.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class RouterStats:
    """Per-layer expert token counts, router probability mass and token counts (float64, CPU)."""

    def __init__(self, num_layers: int, num_experts: int, topk: int) -> None:
        import torch

        self.num_experts, self.topk = num_experts, topk
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.mass = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.tokens = torch.zeros(num_layers, 1, dtype=torch.float64)
        self.active = False
        self.valid: torch.Tensor | None = None

    def reset(self) -> None:
        for t in (self.counts, self.mass, self.tokens):
            t.zero_()

    @contextmanager
    def recording(self, valid: torch.Tensor | None) -> Iterator[None]:
        """Router calls inside count; ``valid`` (the forward's ``[b, S]`` real-token mask) is there
        for the hooks to flatten in their router's token order."""
        self.active, self.valid = True, valid
        try:
            yield
        finally:
            self.active, self.valid = False, None

    def add(self, layer: int, logits: torch.Tensor, chosen: torch.Tensor, valid: torch.Tensor | None) -> None:
        """One router call of layer ``layer`` (0-based): ``logits`` ``[N, E]``, ``chosen`` the
        experts each token went to (``[N, k]`` indices or an ``[N, E]`` boolean map), ``valid``
        ``[N]`` (None: every token)."""
        import torch

        with torch.no_grad():
            probs = torch.softmax(logits.detach().double(), dim=-1)
            chosen = chosen.detach()
            if valid is not None:
                valid = valid.to(probs.device).bool()
                probs, chosen = probs[valid], chosen[valid]
            if chosen.dtype == torch.bool:
                counts = chosen.sum(0).double()
            else:
                counts = torch.bincount(chosen.reshape(-1).long(), minlength=self.num_experts).double()
            self.counts[layer] += counts.cpu()
            self.mass[layer] += probs.sum(0).cpu()
            self.tokens[layer] += float(probs.shape[0])

    def totals(self) -> torch.Tensor:
        """Everything as one ``[L, 2E + 1]`` tensor, to be summed over ranks in one collective."""
        import torch

        return torch.cat([self.counts, self.mass, self.tokens], dim=1)


def balance_metrics(totals: torch.Tensor, num_experts: int, topk: int) -> dict[str, float]:
    """The metrics (see the module docstring) of summed :meth:`RouterStats.totals`; layers that saw
    no token (dense layers, or none of this batch) are left out."""
    counts, mass, tokens = totals[:, :num_experts], totals[:, num_experts:2 * num_experts], totals[:, -1:]
    seen = tokens[:, 0] > 0
    if not bool(seen.any()):
        return {}
    counts, mass, tokens = counts[seen], mass[seen], tokens[seen]
    share = counts / (topk * tokens)  # f_i
    balance = num_experts * (share * mass / tokens).sum(1)
    return {"moe/load_balance": float(balance.mean()), "moe/expert_load_max": float((share * num_experts).max()),
            "moe/expert_load_min": float((share * num_experts).min())}
