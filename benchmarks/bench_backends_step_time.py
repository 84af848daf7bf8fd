"""Training step time: the DTensor backend vs the Megatron backend, same tiny model and batch.

Each backend runs in its own spawned process (world of 1, gloo, so Megatron's CPU shim never
touches the DTensor run), is built through the plugin registry exactly as ``nrl train`` would
(section validated by the plugin's own schema), does ``--warmup`` steps and then ``--steps`` timed
``train`` calls with the core's NLL loss. Prints per-backend median seconds per step, the ratio
megatron/dtensor, and one JSON line.

    python benchmarks/bench_backends_step_time.py [--size small] [--batch 8] [--seq 64] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp


def _policy(model: str, args: argparse.Namespace, backend: str, spec: Any) -> dict[str, Any]:
    section = spec.config_schema.validate({"enabled": True}, f"policy.{spec.config_key}")
    if backend == "megatron":
        section = spec.config_schema.validate({"enabled": True, "optimizer": {"lr": 1e-4, "weight_decay": 0.0,
                                                                             "clip_grad": 1.0}},
                                              f"policy.{spec.config_key}")
    return {"model_name": model, "precision": "float32", "train_global_batch_size": args.batch,
            "train_micro_batch_size": args.micro, "logprob_batch_size": args.micro,
            "max_total_sequence_length": args.seq, "max_grad_norm": 1.0, "seed": 0,
            "optimizer": None if backend == "megatron" else {
                "name": "torch.optim.AdamW", "kwargs": {"lr": 1e-4, "weight_decay": 0.0}},
            "hf_config_overrides": {}, "sequence_packing": {"enabled": False}, spec.config_key: section}


def _run(rank: int, backend: str, model: str, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), OMP_NUM_THREADS=str(args.threads))
    torch.set_num_threads(args.threads)
    import torch.distributed as dist

    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.contracts import TokenBatch, import_object
    from nrl_core.plugins import get_plugin_manager

    dist.init_process_group("gloo", rank=0, world_size=1)
    spec = get_plugin_manager().training_backends().get(backend, "policy")
    worker = import_object(spec.worker)({"policy": _policy(model, args, backend, spec)}, rank=0, world_size=1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 500, (args.batch, args.seq), generator=g)
    mask = torch.ones(args.batch, args.seq)
    mask[:, 0] = 0
    batch = TokenBatch(input_ids=ids, input_lengths=torch.full((args.batch,), args.seq), fields={"token_mask": mask})
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        losses.append(worker.train(batch, NLLLoss())["loss"])
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    out.put((backend, statistics.median(times), losses))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--family", default="llama")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    from nrl_backend_megatron.parallel import KEY  # noqa: F401  (fails early if the plugin is missing)
    from nrl_core.testing.tiny_models import cached_tiny_model

    model = str(cached_tiny_model(args.family, size=args.size))
    os.environ.setdefault("NRL_MEGATRON_CHECKPOINT_DIR", tempfile.mkdtemp(prefix="nrl-bench-mcore-"))
    ctx = mp.get_context("spawn")
    results = {}
    for backend in ("dtensor", "megatron"):
        from nrl_backend_megatron.parallel import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
        queue = ctx.Queue()
        proc = ctx.Process(target=_run, args=(0, backend, model, args, queue))
        proc.start()
        name, seconds, losses = queue.get(timeout=900)
        proc.join()
        results[name] = {"seconds_per_step": seconds, "losses": losses}
        print(f"{name:9s} {seconds * 1000:9.1f} ms/step  losses {losses[0]:.4f} -> {losses[-1]:.4f}")
    ratio = results["megatron"]["seconds_per_step"] / results["dtensor"]["seconds_per_step"]
    print(f"ratio megatron/dtensor: {ratio:.2f}")
    print(json.dumps({"bench": "backends_step_time", "size": args.size, "batch": args.batch, "seq": args.seq,
                      "ratio_megatron_over_dtensor": ratio, **{k: v["seconds_per_step"] for k, v in results.items()}}))


if __name__ == "__main__":
    main()
