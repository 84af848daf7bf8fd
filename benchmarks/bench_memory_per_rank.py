"""Memory per rank at data-parallel 1 and 2: the model's load and one SFT step on either backend.

Each world (1, then 2 ranks on gloo) is spawned fresh. Every rank imports what the worker needs,
reads its own post-import PSS as its baseline, and samples its own process (the process-tree
sampler on its own pid) while it builds the worker (``load``: DTensor's meta-device model, FSDP
layout and its own shards; Megatron's model from the converted checkpoint, DDP and the
distributed optimizer) and while it trains one step with the core's NLL loss (``step``: forward,
backward, Adam). Megatron's one-time conversion runs first, in a world of its own, so that no
load counts it. Prints each rank's peaks above its baseline and its optimizer-state bytes, the
DP-2/DP-1 ratios of the worst rank, and one JSON line. The default model is ``nrl tiny-model``'s
``gpu`` size.

It also prints ``nrl plan``'s prediction for a rank of each world against the measured peak.

    OMP_NUM_THREADS=1 python benchmarks/bench_memory_per_rank.py [--backend dtensor|megatron] [--size gpu] [--layers N] [--vocab N] [--steps N] [--no-reference] [--head-in-root]
"""

from __future__ import annotations

import argparse
import importlib
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
    from process_tree_sampler import TreeSampler

    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.contracts import TokenBatch, import_object

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    args.port, args.threads = port, 1
    spec, policy = bench_policy(model, args)
    import_object(spec.worker)  # the worker's own imports belong to the baseline
    if args.head_in_root:  # DTensor's output head in the root FSDP unit, as before 14df6b9: the reference
        importlib.import_module("nrl_backend_dtensor.worker").output_head_unit = lambda hf_model: None
    baseline = psutil.Process().memory_full_info().pss
    peaks = {}
    with TreeSampler(os.getpid(), interval=0.25, mem_interval=0.25) as load:
        worker = import_object(spec.worker)({"policy": policy}, rank=rank, world_size=world)
    peaks["load"] = load.peak("pss") - baseline
    if args.warm_only:
        out.put((rank, {}))
        dist.destroy_process_group()
        return
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 500, (args.batch, args.seq), generator=g)
    mask = torch.ones(args.batch, args.seq)
    mask[:, 0] = 0
    batch = TokenBatch(input_ids=ids, input_lengths=torch.full((args.batch,), args.seq), fields={"token_mask": mask})
    with TreeSampler(os.getpid(), interval=0.25, mem_interval=0.25) as step:
        for _ in range(args.steps):  # from the second on, the optimizer's state is there during backward
            loss = worker.train(batch, NLLLoss())["loss"]
    peaks["step"] = step.peak("pss") - baseline
    stats = getattr(worker, "load_stats", None)  # absent before sharded loading: every rank read it all
    out.put((rank, {**peaks, "loss": loss, "bytes_read": stats.bytes_read if stats else -1,
                    "load_path": stats.path if stats else "whole", "optimizer_bytes": optimizer_bytes(worker)}))
    dist.destroy_process_group()


def bench_policy(model: str, args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The backend's spec and the policy section every rank trains with."""
    from bench_backends_step_time import _policy

    hooks = importlib.import_module(f"nrl_backend_{args.backend}.plugin")
    spec = next(s for s in hooks.nrl_training_backends() if s.name == args.backend)
    policy = _policy(model, args, args.backend, spec)
    if args.backend == "megatron":  # as NeMo RL's Megatron recipes train: optimizer state sharded over DP,
        section = policy[spec.config_key]  # its reduce-scatter and all-gather overlapped, bucket by bucket
        section["optimizer"]["use_distributed_optimizer"] = True
        section["distributed_data_parallel_config"].update(overlap_grad_reduce=True, overlap_param_gather=True)
    if args.no_reference:  # as an SFT run's workers are built: no reference copy
        from nrl_core.sdk.reference import INIT_REFERENCE_KEY

        policy[INIT_REFERENCE_KEY] = False
    return spec, policy


def predicted(model: str, args: argparse.Namespace, world: int) -> int:
    """``nrl plan``'s prediction for one rank of this run on the CPU (its device and host lines
    together: on the CPU they are the same memory)."""
    from nrl_core.contracts import import_object
    from nrl_core.plan.memory import TrainingRole, training_plan
    from nrl_core.plan.model_shape import ModelShape

    spec, policy = bench_policy(model, args)
    layout = import_object(spec.memory_layout)(policy, world, "cpu")
    role = TrainingRole("policy", layout, trains=True, micro_tokens=args.micro * args.seq,
                        reference=not args.no_reference)
    plan = training_plan(ModelShape.from_model_path(model), role)
    return plan.device_bytes + plan.host_bytes


def optimizer_bytes(worker: Any) -> int:
    """Bytes of optimizer state this rank holds (Adam's moments and step; Megatron's per leaf)."""
    import torch

    opt = getattr(getattr(worker, "opt", None), "optimizer", None) or worker.optimizer
    leaves = getattr(opt, "chained_optimizers", None) or [opt]
    states = [getattr(leaf, "optimizer", leaf).state for leaf in leaves]
    local = [getattr(t, "to_local", lambda t=t: t)() for state in states for per_param in state.values()
             for t in per_param.values() if torch.is_tensor(t)]  # a DTensor's own shard
    return sum(t.numel() * t.element_size() for t in local)


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
    parser.add_argument("--backend", choices=("dtensor", "megatron"), default="dtensor")
    parser.add_argument("--size", default="gpu")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers instead of the size's")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1, help="SFT steps sampled as the step phase")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size instead of the test cache's")
    parser.add_argument("--head-in-root", action="store_true",
                        help="DTensor: keep the output head in the root FSDP unit (the layout before 14df6b9)")
    parser.add_argument("--no-reference", action="store_true",
                        help="workers keep no reference copy, as an SFT run's (the default keeps one, as DPO's)")
    args = parser.parse_args()
    args.micro = args.batch // 2 or 1
    from nrl_core.testing.tiny_models import cached_tiny_model

    layers = {} if args.layers is None else {"num_hidden_layers": args.layers}
    if args.vocab is not None:
        layers["vocab_size"] = args.vocab
    model = str(cached_tiny_model("llama", size=args.size, **layers))
    args.warm_only = args.backend == "megatron"
    if args.warm_only:  # the one-time conversion, outside every measured load
        _world(1, model, args)
        args.warm_only = False
    runs = {world: _world(world, model, args) for world in (1, 2)}
    for world, ranks in runs.items():
        for rank, r in enumerate(ranks):
            print(f"DP {world} rank {rank}: load {r['load'] / 2**30:6.2f} GiB, step {r['step'] / 2**30:6.2f} GiB above "
                  f"its post-import PSS; read {r['bytes_read'] / 2**30:.2f} GiB ({r['load_path']}); optimizer state "
                  f"{r['optimizer_bytes'] / 2**30:.2f} GiB; loss {r['loss']:.4f}")
    plan = {world: predicted(model, args, world) for world in runs}
    for world, ranks in runs.items():
        peak = max(max(r["load"], r["step"]) for r in ranks)
        print(f"DP {world}: nrl plan predicts {plan[world] / 2**30:.2f} GiB per rank, measured peak "
              f"{peak / 2**30:.2f} GiB: {plan[world] / peak - 1:+.1%}")
    ratios = {phase: max(r[phase] for r in runs[2]) / runs[1][0][phase] for phase in ("load", "step", "optimizer_bytes")}
    print(f"worst DP-2 rank / DP-1 rank: load {ratios['load']:.3f}, step {ratios['step']:.3f}, "
          f"optimizer state {ratios['optimizer_bytes']:.3f}")
    print(json.dumps({"bench": "memory_per_rank", "backend": args.backend, "size": args.size, "layers": args.layers,
                      "vocab": args.vocab, "steps": args.steps, "head_in_root": args.head_in_root,
                      "dp1": runs[1], "dp2": runs[2], "plan": plan, **{f"ratio_{k}": v for k, v in ratios.items()}}))


if __name__ == "__main__":
    main()
