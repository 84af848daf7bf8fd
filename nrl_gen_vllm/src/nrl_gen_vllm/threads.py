"""Keep the host process's CPU threads as they were across a vLLM engine start.

vLLM's CPU worker expects to own its process: at start it replaces ``torch.set_num_threads``, for
the whole process, with a function that only logs "CPU backend doesn't allow to use
`torch.set_num_threads` after the thread binding" (it binds OpenMP threads to cores in its
multi-process executor; the in-process engine nrl runs binds nothing), and its serving setup may
lower torch's intra-op threads. In a colocated actor the same process also trains, and training
must keep every core the actor owns and the ability to set its thread count. Measured with vLLM
0.32 on CPU (``tests/vllm/test_kv_cache.py`` asserts it): thread count and affinity are unchanged
by the in-process engine, ``torch.set_num_threads`` is not; this restores all three.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["keep_process_threads"]


@contextlib.contextmanager
def keep_process_threads() -> Iterator[None]:
    """Restore ``torch.set_num_threads``, torch's intra-op thread count and the process's CPU
    affinity to what they were on entry."""
    import torch

    set_num_threads = torch.set_num_threads
    threads = torch.get_num_threads()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        if affinity is not None and os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)
        if torch.get_num_threads() != threads:
            set_num_threads(threads)
