"""Memory per rank at data-parallel 1 and 2: the model's load and one SFT step on the DTensor backend.

Each world (1, then 2 ranks on gloo) is spawned fresh. Every rank imports what the worker needs,
reads its own post-import PSS as its baseline, and samples its own process (the process-tree
sampler on its own pid) while it builds the worker (``load``: meta-device model, FSDP layout, its
shards read from the checkpoint, optimizer) and while it trains one step with the core's NLL loss
(``step``: forward, backward, AdamW). Prints each rank's peaks above its baseline, the DP-2/DP-1
ratio of the worst rank per phase, and one JSON line. The default model is ``nrl tiny-model``'s
``gpu`` size.

    OMP_NUM_THREADS=1 python benchmarks/bench_memory_per_rank.py [--size gpu] [--batch 2] [--seq 64]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))


def _rank(rank: int, world: int, port: int, model: str, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import psutil
    import torch
    import torch.distributed as dist
    from bench_backends_step_time import _policy
    from process_tree_sampler import TreeSampler

    from nrl_backend_dtensor.plugin import nrl_training_backends
    from nrl_backend_dtensor.worker import DTensorPolicyWorker
    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.contracts import TokenBatch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spec = next(s for s in nrl_training_backends() if s.name == "dtensor")
    args.port, args.threads = port, 1
    policy = _policy(model, args, "dtensor", spec)
    baseline = psutil.Process().memory_full_info().pss
    peaks = {}
    with TreeSampler(os.getpid(), interval=0.25, mem_interval=0.25) as load:
        worker = DTensorPolicyWorker({"policy": policy}, rank=rank, world_size=world)
    peaks["load"] = load.peak("pss") - baseline
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 500, (args.batch, args.seq), generator=g)
    mask = torch.ones(args.batch, args.seq)
    mask[:, 0] = 0
    batch = TokenBatch(input_ids=ids, input_lengths=torch.full((args.batch,), args.seq), fields={"token_mask": mask})
    with TreeSampler(os.getpid(), interval=0.25, mem_interval=0.25) as step:
        loss = worker.train(batch, NLLLoss())["loss"]
    peaks["step"] = step.peak("pss") - baseline
    stats = getattr(worker, "load_stats", None)  # absent before sharded loading: every rank read it all
    out.put((rank, {**peaks, "loss": loss, "bytes_read": stats.bytes_read if stats else -1,
                    "load_path": stats.path if stats else "whole"}))
    dist.destroy_process_group()


def _world(world: int, model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, model, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="gpu")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    args.micro = args.batch // 2 or 1
    from nrl_core.testing.tiny_models import cached_tiny_model

    model = str(cached_tiny_model("llama", size=args.size))
    runs = {world: _world(world, model, args) for world in (1, 2)}
    for world, ranks in runs.items():
        for rank, r in enumerate(ranks):
            print(f"DP {world} rank {rank}: load {r['load'] / 2**30:6.2f} GiB, step {r['step'] / 2**30:6.2f} GiB above "
                  f"its post-import PSS; read {r['bytes_read'] / 2**30:.2f} GiB ({r['load_path']}); loss {r['loss']:.4f}")
    ratios = {phase: max(r[phase] for r in runs[2]) / runs[1][0][phase] for phase in ("load", "step")}
    print(f"worst DP-2 rank / DP-1 rank: load {ratios['load']:.3f}, step {ratios['step']:.3f}")
    print(json.dumps({"bench": "memory_per_rank", "backend": "dtensor", "size": args.size, "dp1": runs[1],
                      "dp2": runs[2], "ratio_load": ratios["load"], "ratio_step": ratios["step"]}))


if __name__ == "__main__":
    main()
