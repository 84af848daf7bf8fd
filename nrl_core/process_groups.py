"""One timeout for every process group nrl creates: ``distributed_timeout_minutes``.

A collective that one rank never reaches blocks the others until the group's timeout; NeMo RL's
motivating case is the one-time HF->Megatron conversion, which rank 0 runs while every other rank
waits at a barrier on the *main* group. So the key (in the training backend's section, e.g.
``policy.megatron_cfg.distributed_timeout_minutes``) must reach the group the worker host creates,
the subgroups a backend creates, and the refit's broadcast group, not only Megatron's subgroups.
Unset, every group gets :data:`DEFAULT_TIMEOUT_S` (torch's own default for gloo and NCCL).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_KEY", "distributed_timeout_s", "main_group_timeout"]

DEFAULT_TIMEOUT_S = 1800.0
TIMEOUT_KEY = "distributed_timeout_minutes"


def distributed_timeout_s(config: Mapping[str, Any], section_key: str) -> float:
    """Seconds from ``policy.<section_key>.distributed_timeout_minutes``, or the default when the
    training backend's section has no such key or leaves it null."""
    section = (config.get("policy") or {}).get(section_key) or {}
    minutes = section.get(TIMEOUT_KEY) if isinstance(section, Mapping) else None
    return DEFAULT_TIMEOUT_S if minutes is None else float(minutes) * 60.0


def main_group_timeout() -> datetime.timedelta:
    """The timeout of this process's default group, for the subgroups a backend creates:
    ``torch.distributed.new_group`` otherwise falls back to torch's default, not the world's."""
    import torch
    import torch.distributed as dist

    group = dist.distributed_c10d._get_default_group()
    device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
    return group._get_backend(device).options._timeout
