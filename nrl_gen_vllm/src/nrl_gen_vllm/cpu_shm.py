"""Names for the shared-memory segments of vLLM's CPU tensor-parallel communicator.

vLLM on CPU moves tensor-parallel traffic through ``/dev/shm`` segments named after
``VLLM_DIST_IDENT`` (derived from the distributed init method, always ``env://`` with the
``external_launcher`` executor), the group and its ranks. Two engines with the same ranks on one
node, one after the other or side by side, therefore share names: the second fails with ``create
shm in SHMManager failed. errno: 17`` (the segment exists), and a killed engine leaves its segments
behind, so the next engine on that node fails the same way. The names become unique per engine
world here: rank 0 draws a token that every rank of the world receives at construction, the token
prefixes every segment name, and shutdown removes this world's segments.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

_PREFIX = "nrl"
_token: str | None = None


def use_unique_names() -> None:
    """Give this process's engine world its own segment names; collective over the default group
    (every rank calls it, as every rank builds its engine at the same time)."""
    global _token
    import torch.distributed as dist
    from vllm.distributed.device_communicators import cpu_communicator

    box = [secrets.token_hex(4) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    _token = str(box[0])
    shm = cpu_communicator._CPUSHMDistributed
    if not hasattr(shm, "_nrl_original"):
        shm._nrl_original = shm.make_group_name  # read through the class: the plain function
    original = shm._nrl_original

    def make_group_name(communicator: object) -> str:
        # shm_open names may not contain "/" after the first character; env:// puts two there
        return f"{_PREFIX}{_token}" + original(communicator).replace("/", "")

    shm.make_group_name = staticmethod(make_group_name)


def remove_segments() -> None:
    """Unlink this world's segments (safe while peers still map them; the memory goes with the last)."""
    if _token is None:
        return
    for path in Path("/dev/shm").glob(f"{_PREFIX}{_token}*"):
        try:
            os.unlink(path)
        except FileNotFoundError:  # a peer rank removed it first
            pass
