"""Shared helpers for the Megatron backend tests: configs, batches, and a multi-process runner.

``run_world`` is a small private equivalent of ``nrl_core.testing.distributed.run_distributed``
(see its docstring for why): it starts ``world_size`` processes (from the same preloaded fork
server) on gloo with a free port, runs
``fn(rank, world_size, *args)`` in each and returns the per-rank results (sent as bytes).
"""

from __future__ import annotations

import io
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch

from nrl_core.long_lived import freeze_at_exit
from nrl_core.net import free_port
from nrl_core.testing.distributed import adopt_environment, rank_context


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, environ: dict, env: dict,
           queue: Any) -> None:
    adopt_environment(environ)
    freeze_at_exit()
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1", **env})
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(result, buffer)  # plain bytes: tensors must not travel as shared-memory handles
        queue.put((rank, "ok", buffer.getvalue()))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, env: dict | None = None,
              timeout: float = 240.0) -> list[Any]:
    """Spawn ``world_size`` gloo ranks running ``fn(rank, world_size, *args)``; per-rank results.

    Private rather than ``nrl_core.testing.distributed.run_distributed``: that one raced (a rank's
    result file read while incomplete) in these long multi-worker scenarios when last tried.
    """
    ctx = rank_context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, dict(os.environ), env or {}, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    for _ in range(world_size):
        rank, status, value = queue.get(timeout=timeout)
        if status == "error":
            errors.append(f"rank {rank}: {value}")
        results[rank] = torch.load(io.BytesIO(value), weights_only=False) if status == "ok" else value
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def make_config(model_path: str, *, megatron: dict | None = None, **policy: Any) -> dict:
    """A whole nrl config with a validated ``policy.megatron_cfg``."""
    from nrl_backend_megatron.schema import MEGATRON_CFG_SCHEMA

    cfg = {"enabled": True, "optimizer": {"lr": 1e-2, "min_lr": 1e-2, "weight_decay": 0.0, "clip_grad": 1.0}}
    for key, value in (megatron or {}).items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    base = {"model_name": str(model_path), "precision": "float32", "train_global_batch_size": 4,
            "train_micro_batch_size": 2, "logprob_batch_size": 2, "max_total_sequence_length": 32,
            "max_grad_norm": 1.0, "optimizer": None, "hf_config_overrides": {},
            "sequence_packing": {"enabled": False}, "seed": 1234}
    base.update(policy)
    base["megatron_cfg"] = MEGATRON_CFG_SCHEMA.validate(cfg, "policy.megatron_cfg")
    return {"policy": base}


def make_batch(vocab: int = 512, rows: int = 4, width: int = 12, seed: int = 0):
    from nrl_core.contracts import TokenBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (rows, width), generator=g)
    lengths = torch.tensor([width - (i % 3) * 2 for i in range(rows)])
    mask = torch.zeros(rows, width)
    for i, n in enumerate(lengths.tolist()):
        ids[i, n:] = 3
        mask[i, 1:n] = 1.0
    return TokenBatch(input_ids=ids, input_lengths=lengths, fields={"token_mask": mask})
