"""On CPU, vLLM's sampled-token ranks without ``torch.compile``.

vLLM's sampler counts each sampled token's rank with ``batched_count_greater_than``, a function
``torch.compile`` builds with inductor: the first ``generate`` of every process traces it and
compiles a C++ kernel with the system compiler, which was about 5 s of the bench run's first step
on the 2-core machine (two compiler processes beside it). The kernel saves a rows x vocabulary
temporary on GPUs; on CPU the same count in row chunks bounds that temporary instead, and the ranks
are the same integers. nrl reads only the sampled token's logprob, but vLLM computes the rank
whenever logprobs are requested.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CHUNK_ELEMENTS", "count_at_least", "use_eager_rank_count"]

CHUNK_ELEMENTS = 2**24
"""Most elements compared at once (a 16 MiB boolean temporary)."""


def count_at_least(x: Any, values: Any, chunk_elements: int = CHUNK_ELEMENTS) -> Any:
    """Per row of ``x`` (rows x n), how many elements are >= that row's ``values`` (rows x 1)."""
    import torch

    rows = max(1, chunk_elements // max(1, x.shape[-1]))
    if x.shape[0] <= rows:
        return (x >= values).sum(-1)
    return torch.cat([(x[i:i + rows] >= values[i:i + rows]).sum(-1) for i in range(0, x.shape[0], rows)])


def use_eager_rank_count() -> bool:
    """Point vLLM's sampler at :func:`count_at_least`; False when this vLLM has no such hook."""
    try:
        from vllm.v1.sample import sampler
    except ImportError:
        return False
    if not hasattr(sampler, "batched_count_greater_than"):
        return False
    sampler.batched_count_greater_than = count_at_least
    return True
