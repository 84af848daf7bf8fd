"""Small worker classes for tests/core/test_cluster.py.

They live in their own module (not the test file) because Ray actors import them by path
(``cluster_workers:CollectiveWorker``); the test puts this directory on the workers' PYTHONPATH.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist


class CollectiveWorker:
    """Sums over the group, reports its environment, and fails on request."""

    lazy_imports = ("cluster_preloaded",)  # imported early when a group preloads this class

    def __init__(self, *, rank: int, world_size: int, tag: str = "") -> None:
        self.rank = rank
        self.world_size = world_size
        self.tag = tag
        self.built_at = time.time()

    def all_reduce(self, value: float) -> float:
        t = torch.tensor([float(value)])
        dist.all_reduce(t)
        return float(t.item())

    def whoami(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "tag": self.tag,
            "pid": os.getpid(),
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")},
            "nrl_test_mark": os.environ.get("NRL_TEST_MARK"),
            "forwarded": os.environ.get("NRL_CLUSTER_TEST_FORWARD"),
        }

    def main_group_timeout_s(self) -> float:
        from nrl_core.process_groups import main_group_timeout

        return main_group_timeout().total_seconds()

    def all_reduce_unless_rank(self, skipping_rank: int) -> float:
        """Every rank but ``skipping_rank`` enters an all-reduce that one never joins."""
        return 0.0 if self.rank == skipping_rank else self.all_reduce(1.0)

    def preloaded_before_build(self, module: str) -> bool | None:
        """Whether ``module`` (one that records its import time) was imported before this worker
        was built; None when it was never imported."""
        loaded = sys.modules.get(module)
        return None if loaded is None else loaded.IMPORTED_AT < self.built_at

    def echo(self, *args: Any, **kwargs: Any) -> tuple[int, tuple[Any, ...], dict[str, Any]]:
        return self.rank, args, kwargs

    def die_during_all_reduce(self, dying_rank: int, marker: str) -> float:
        """``dying_rank`` prints ``marker`` and exits at once; the others block in an all-reduce."""
        if self.rank == dying_rank:
            print(marker)  # no flush: the host must make sure this reaches the log anyway
            os._exit(1)
        time.sleep(0.2)
        return self.all_reduce(1.0)

    def odd_rank(self) -> int | None:
        """An answer from odd ranks only, as a shard owner answers and the others return None."""
        return self.rank if self.rank % 2 else None

    def explode(self, message: str) -> None:
        raise ValueError(message)

    def raise_example(self, cls: type) -> None:
        """Raise the example instance of an nrl error class (built here, in the worker)."""
        from nrl_core.testing.errors import example_error

        raise example_error(cls)

    def refuse(self, key_path: str, message: str) -> None:
        from nrl_core.errors import ConfigError

        raise ConfigError(key_path, message)

    def divide(self, a: float, b: float) -> float:
        return a / b


def algorithm_with_user_error(config: dict[str, Any]) -> int:
    """An ``nrl train`` entry whose worker refuses a config value (a user error)."""
    from nrl_core.cluster import WorkerGroup

    with WorkerGroup("cluster_workers:CollectiveWorker", 2, name="algo") as group:
        group.call("refuse", "policy.optimizer.kwargs.lr", "must be non-negative, got -0.1")
    return 0


def algorithm_with_bug(config: dict[str, Any]) -> int:
    """An ``nrl train`` entry whose worker divides by zero (a bug)."""
    from nrl_core.cluster import WorkerGroup

    with WorkerGroup("cluster_workers:CollectiveWorker", 1, name="algo") as group:
        group.call("divide", 1.0, 0.0)
    return 0


class FailingInit:
    """Rank 1 refuses to build."""

    def __init__(self, *, rank: int, world_size: int) -> None:
        if rank == 1:
            raise RuntimeError("rank 1 found an impossible setting")
