"""GPU check: both training backends on real devices, in one command, with only PyTorch preinstalled.

For each backend (DTensor FSDP2, Megatron-Core) on every visible GPU (NCCL, bf16), on a small
model built locally (no downloads; ``nrl_core.testing.tiny_models``):

* **logits vs HF**: the backend's token logprobs of a batch against Hugging Face ``transformers``
  in fp32 on the same weights (max absolute difference, with the tolerance it must meet);
* **tokens/s and MFU**: timed optimizer steps after a warm-up; MFU = 6 x parameters x tokens/s
  over the devices' dense bf16 peak (``PEAK_FLOPS``; null for an unknown device);
* **offload**: device memory the driver reports free (``torch.cuda.mem_get_info``, what a
  colocated engine can allocate) before the worker is built, before ``offload_before_refit`` and
  after ``offload_after_refit``; at least :data:`GIVEN_BACK` of what the worker held must come back
  (``memory_allocated`` would pass without ``empty_cache``), and ``prepare_for_training`` brings
  the model back (the loss of the next step is finite).

Ray and vLLM are not needed: ranks are ``torch.multiprocessing`` processes, the workers are built
directly, as under torchrun. ``--dry-run`` runs the same code on the CPU (gloo, fp32, a tiny model,
two ranks) in about a minute; CI runs it (tests/core/test_gpu_check.py).

    python benchmarks/gpu/gpu_check.py [--dry-run] [--out results.json]   # or scripts/gpu_check.sh
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT, ROOT / "nrl_backend_dtensor" / "src", ROOT / "nrl_backend_megatron" / "src"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

#: Dense bf16 peak per device (FLOP/s), matched against ``torch.cuda.get_device_name()``.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}
BACKENDS = ("dtensor", "megatron")
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25}  # max |logprob - HF fp32 logprob|; bf16 rounds every matmul
GIVEN_BACK = 0.9  # share of the device memory the worker held that offload must return to the driver


def _settings(dry_run: bool) -> dict[str, Any]:
    if dry_run:
        return {"size": "tiny", "rows": 4, "seq": 32, "steps": 2, "precision": "float32"}
    return {"size": "bench", "rows": 32, "seq": 512, "steps": 5, "precision": "bfloat16"}


def _batch(rows: int, seq: int, vocab: int, seed: int = 0) -> Any:
    from nrl_core.contracts import TokenBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (rows, seq), generator=g)
    mask = torch.ones(rows, seq)
    mask[:, 0] = 0
    return TokenBatch(input_ids=ids, input_lengths=torch.full((rows,), seq), fields={"token_mask": mask})


def _policy(model: str, settings: dict[str, Any], world: int) -> dict[str, Any]:
    micro = max(1, settings["rows"] // (world * 2))
    return {"model_name": model, "trust_remote_code": False, "precision": settings["precision"],
            "train_global_batch_size": settings["rows"], "train_micro_batch_size": micro,
            "logprob_batch_size": micro, "max_total_sequence_length": settings["seq"], "max_grad_norm": 1.0,
            "hf_config_overrides": {}, "seed": 1234, "logprob_chunk_size": None,
            "sequence_packing": {"enabled": False}, "dynamic_batching": {"enabled": False}}


def _config(backend: str, model: str, settings: dict[str, Any], world: int) -> dict[str, Any]:
    policy = _policy(model, settings, world)
    if backend == "dtensor":
        policy["optimizer"] = {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-4, "foreach": False}}
        policy["scheduler"] = None
        policy["dtensor_config"] = {"enabled": True, "cpu_offload": False, "sequence_parallel": False,
                                    "activation_checkpointing": False, "tensor_parallel_size": 1,
                                    "context_parallel_size": 1, "custom_parallel_plan": None,
                                    "fully_parallel_save": True, "fully_parallel_load": True, "async_save": False,
                                    "load_rng": False}
    else:
        from nrl_backend_megatron.schema import MEGATRON_CFG_SCHEMA

        policy["optimizer"] = None
        policy["megatron_cfg"] = MEGATRON_CFG_SCHEMA.validate(
            {"enabled": True, "optimizer": {"lr": 1e-4, "min_lr": 1e-4, "weight_decay": 0.0, "clip_grad": 1.0}},
            "policy.megatron_cfg")
    return {"policy": policy}


def _hf_logprobs(model_dir: str, batch: Any) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch.input_ids).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(lp.shape[0], 1), lp], 1)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _free(cuda: bool) -> int:
    """Device memory free for any allocator (another process's, vLLM's), not only torch's view."""
    return int(torch.cuda.mem_get_info()[0]) if cuda else 0


def _peak(cuda: bool) -> float | None:
    if not cuda:
        return None
    name = torch.cuda.get_device_name()
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


def check_backend(backend: str, model: str, settings: dict[str, Any], rank: int, world: int,
                  reference: torch.Tensor, n_params: int) -> dict[str, Any]:
    """One backend on this rank: logprobs vs HF, timed steps, offload. Collective over the ranks."""
    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.testing.distributed import gather_shards

    cuda = torch.cuda.is_available()
    free_at_start = _free(cuda)
    if backend == "dtensor":
        from nrl_backend_dtensor.worker import DTensorPolicyWorker as Worker
    else:
        from nrl_backend_megatron.worker import MegatronPolicyWorker as Worker
    worker = Worker(_config(backend, model, settings, world), rank=rank, world_size=world)
    batch = _batch(settings["rows"], settings["seq"], 512)
    logprobs = gather_shards(worker.get_logprobs(batch), batch).float().cpu()
    diff = float((logprobs[:, 1:] - reference[:, 1:]).abs().max())

    loss = NLLLoss()
    worker.train(batch, loss)  # warm-up: allocations, kernels
    _sync(cuda)
    start = time.perf_counter()
    losses = [float(worker.train(batch, loss)["loss"]) for _ in range(settings["steps"])]
    _sync(cuda)
    seconds = time.perf_counter() - start
    tokens_per_s = settings["steps"] * settings["rows"] * settings["seq"] / seconds
    peak = _peak(cuda)
    mfu = 6 * n_params * tokens_per_s / (peak * world) if peak else None

    before = _free(cuda)
    worker.offload_before_refit()
    worker.offload_after_refit()
    _sync(cuda)
    offloaded = _free(cuda)
    worker.prepare_for_training()
    after_loss = float(worker.train(batch, loss)["loss"])
    restored = _free(cuda)
    held = free_at_start - before
    result = {"logprob_max_abs_diff": diff, "tolerance": TOLERANCE[settings["precision"]],
              "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / world, "mfu": mfu,
              "losses": losses, "loss_after_offload": after_loss,
              "device_bytes_held_by_worker": held, "device_bytes_free_before_offload": before,
              "device_bytes_free_after_offload": offloaded, "device_bytes_given_back": offloaded - before,
              "device_bytes_free_after_prepare": restored}
    result["ok"] = bool(diff <= result["tolerance"] and all(math.isfinite(v) for v in [*losses, after_loss])
                        and (not cuda or offloaded - before >= GIVEN_BACK * held))
    shutdown = getattr(worker, "shutdown", None)
    if callable(shutdown):
        shutdown()
    del worker
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def _rank(rank: int, world: int, port: int, args: dict[str, Any], out: str) -> None:
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not args["dry_run"]
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if cuda:
        torch.cuda.set_device(rank)
    from nrl_core.device import process_group_backend

    dist.init_process_group(process_group_backend(cuda), rank=rank, world_size=world)
    settings = _settings(args["dry_run"])
    model = args["model"]
    batch = _batch(settings["rows"], settings["seq"], 512)
    reference = _hf_logprobs(model, batch)
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
                       .parameters())
    results: dict[str, Any] = {}
    for backend in args["backends"]:
        results[backend] = check_backend(backend, model, settings, rank, world, reference, n_params)
        dist.barrier()
    if rank == 0:
        summary = {"device": torch.cuda.get_device_name() if cuda else "cpu (dry run)", "world": world,
                   "backend": process_group_backend(cuda), "torch": torch.__version__, "python": sys.version.split()[0],
                   "model": {"size": settings["size"], "parameters": n_params}, "settings": settings,
                   "results": results, "ok": all(r["ok"] for r in results.values())}
        Path(out).write_text(json.dumps(summary, indent=1))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _report(summary: dict[str, Any]) -> str:
    lines = [f"{summary['device']} x{summary['world']} ({summary['backend']}, {summary['settings']['precision']}), "
             f"llama {summary['model']['size']} ({summary['model']['parameters'] / 1e6:.1f}M parameters), "
             f"batch {summary['settings']['rows']}x{summary['settings']['seq']}"]
    for name, r in summary["results"].items():
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        lines.append(f"  {name:9s} {'ok  ' if r['ok'] else 'FAIL'} logprob diff vs HF {r['logprob_max_abs_diff']:.2e} "
                     f"(<= {r['tolerance']:g}); {r['tokens_per_s']:.0f} tokens/s ({r['tokens_per_s_per_device']:.0f} "
                     f"per device), MFU {mfu}; offload gave back {r['device_bytes_given_back'] / 2**20:.1f} of "
                     f"{r['device_bytes_held_by_worker'] / 2**20:.1f} MiB held (>= {100 * GIVEN_BACK:.0f}%)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, fp32, a tiny model, two ranks")
    parser.add_argument("--world", type=int, default=None, help="ranks (default: every visible GPU; 2 on a dry run)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated subset of dtensor,megatron")
    parser.add_argument("--out", default=None, help="write the results as JSON here too")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; run with --dry-run to check the code path on the CPU")
        return 2
    world = args.world or (2 if args.dry_run else torch.cuda.device_count())
    backends = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        parser.error(f"unknown backends {unknown}; choose from {', '.join(BACKENDS)}")
    from nrl_core.testing.tiny_models import cached_tiny_model

    model = str(cached_tiny_model("llama", size=_settings(args.dry_run)["size"]))  # built here once, for every rank
    with tempfile.TemporaryDirectory(prefix="nrl-gpu-check-") as tmp:
        # the Megatron conversion goes to a private directory unless the caller chose one
        os.environ.setdefault("NRL_MEGATRON_CHECKPOINT_DIR", str(Path(tmp) / "converted"))
        out = str(Path(tmp) / "results.json")
        torch.multiprocessing.spawn(_rank, args=(world, _free_port(), {"dry_run": args.dry_run, "backends": backends,
                                                                       "model": model},
                                                 out), nprocs=world, join=True)
        summary = json.loads(Path(out).read_text())
    print(_report(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
