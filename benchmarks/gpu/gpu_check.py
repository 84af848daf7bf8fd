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
#: Bounds on |logprob - HF fp32 logprob| over the valid tokens: (max, mean). bf16 rounds every
#: matmul input to 8 bits of mantissa; fp32 differs from HF only in summation order.
TOLERANCE = {"float32": (1e-3, 1e-4), "bfloat16": (0.25, 0.02)}
#: Logprobs that must come out identical up to kernel nondeterminism: the reference pass before
#: any update, and the same weights after a checkpoint round trip.
SAME_WEIGHTS = 1e-4
GIVEN_BACK = 0.9  # share of the device memory the worker held that offload must return to the driver
KL_PENALTY = 0.01  # GRPO's loss with a reference-KL term, so the reference path is in the step
MOE_SLACK = 2.0  # a backend's MoE logprob error may be this many times HF's own at the same precision


def _settings(dry_run: bool) -> dict[str, Any]:
    if dry_run:
        return {"size": "tiny", "vocab": 512, "rows": 4, "seq": 32, "steps": 2, "precision": "float32",
                "moe_size": "tiny"}
    return {"size": "gpu", "vocab": 32768, "rows": 16, "seq": 1024, "steps": 4, "precision": "bfloat16",
            "moe_size": "bench"}


def _batch(rows: int, seq: int, vocab: int, seed: int = 0) -> Any:
    """Rows of four lengths (seq down to 5/8 of it), padded on the right: packing has work to do."""
    from nrl_core.contracts import TokenBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (rows, seq), generator=g)
    lengths = torch.tensor([seq - (i % 4) * (seq // 8) for i in range(rows)])
    mask = torch.zeros(rows, seq)
    for i, n in enumerate(lengths.tolist()):
        ids[i, n:] = 3
        mask[i, 1:n] = 1.0
    return TokenBatch(input_ids=ids, input_lengths=lengths, fields={"token_mask": mask})


def _rl_batch(batch: Any, logprobs: torch.Tensor, reference: torch.Tensor) -> Any:
    """``batch`` with the fields GRPO's loss reads: advantages of both signs, on-policy logprobs."""
    from nrl_core.contracts import TokenBatch

    mask = batch.fields["token_mask"]
    signs = torch.tensor([1.0, -1.0]).repeat((batch.input_ids.shape[0] + 1) // 2)[: batch.input_ids.shape[0]]
    fields = dict(batch.fields, advantages=signs[:, None] * mask, prev_logprobs=logprobs * mask,
                  generation_logprobs=logprobs * mask, reference_logprobs=reference * mask,
                  sample_mask=torch.ones(batch.input_ids.shape[0]))
    return TokenBatch(input_ids=batch.input_ids, input_lengths=batch.input_lengths, fields=fields)


def _policy(model: str, settings: dict[str, Any], world: int) -> dict[str, Any]:
    micro = max(1, settings["rows"] // (world * 2))
    tokens = micro * settings["seq"]
    return {"model_name": model, "trust_remote_code": False, "precision": settings["precision"],
            "train_global_batch_size": settings["rows"], "train_micro_batch_size": micro,
            "logprob_batch_size": micro, "max_total_sequence_length": settings["seq"], "max_grad_norm": 1.0,
            "hf_config_overrides": {}, "seed": 1234, "logprob_chunk_size": None,
            "sequence_packing": {"enabled": True, "train_mb_tokens": tokens, "logprob_mb_tokens": tokens},
            "dynamic_batching": {"enabled": False}}


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


def _hf_logprobs(model_dir: str, batch: Any, cuda: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """HF ``transformers`` in ``dtype`` (fp32: no TF32) on the same weights, on the device when
    there is one."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if cuda else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    ids = batch.input_ids.to(device)
    attention = (torch.arange(ids.shape[1])[None] < batch.input_lengths[:, None]).long().to(device)
    rows = []
    with torch.no_grad():
        for i in range(ids.shape[0]):  # one row at a time: a 32k-vocabulary fp32 logits tensor per row
            logits = model(ids[i : i + 1], attention_mask=attention[i : i + 1]).logits.float()
            rows.append(torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[i : i + 1, 1:, None])[..., 0].cpu())
    del model
    if cuda:
        torch.cuda.empty_cache()
    lp = torch.cat(rows)
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


def _worker_class(backend: str) -> Any:
    if backend == "dtensor":
        from nrl_backend_dtensor.worker import DTensorPolicyWorker

        return DTensorPolicyWorker
    from nrl_backend_megatron.worker import MegatronPolicyWorker

    return MegatronPolicyWorker


def _gather(shard: Any, batch: Any) -> torch.Tensor:
    from nrl_core.testing.distributed import gather_shards

    return gather_shards(shard, batch).float().cpu()


def _gaps(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> tuple[float, float]:
    """Largest and mean ``|a - b|`` over the valid tokens."""
    diff = (a - b).abs()[valid]
    return float(diff.max()), float(diff.mean())


def _max_diff(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> float:
    return _gaps(a, b, valid)[0]


def _logprobs_within(result: dict[str, Any]) -> bool:
    """The logprob gaps a check recorded against HF, within the bounds it recorded."""
    return (result["logprob_max_abs_diff"] <= result["tolerance"]["max"]
            and result["logprob_mean_abs_diff"] <= result["tolerance"]["mean"])


def _export_rate(worker: Any, cuda: bool) -> dict[str, float]:
    """The training half of a refit: every weight streamed in bf16 buckets, as a generation engine
    receives them, against a plain device-to-device copy of as many bytes (the memory's own speed)."""
    _sync(cuda)
    start = time.perf_counter()
    total = 0
    for bucket in worker.export_weights(1 << 30, "bfloat16"):
        total += sum(t.numel() * t.element_size() for _, t in bucket)
    _sync(cuda)
    seconds = time.perf_counter() - start
    device = "cuda" if cuda else "cpu"
    source = torch.empty(total, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    _sync(cuda)
    start = time.perf_counter()
    target.copy_(source)
    _sync(cuda)
    copy_seconds = time.perf_counter() - start
    del source, target
    return {"export_bytes": total, "export_seconds": seconds, "export_bytes_per_s": total / seconds,
            "copy_bytes_per_s": total / copy_seconds, "export_vs_copy": copy_seconds / seconds}


def check_backend(backend: str, model: str, settings: dict[str, Any], rank: int, world: int, batch: Any,
                  hf: torch.Tensor, n_params: int, workdir: Path, result: dict[str, Any]) -> dict[str, Any]:
    """The core's code paths on this rank, in a GRPO step's order: logprobs (packed) against HF,
    the reference pass, timed training steps with GRPO's loss and its KL term, the reference
    unchanged by them, a checkpoint round trip, the weight export of a refit, and the colocated
    hand-off (offload, prepare) measured with ``mem_get_info``. Collective over the ranks."""
    from nrl_core.algorithms.loss import ClippedPGLoss

    cuda = torch.cuda.is_available()
    valid = batch.fields["token_mask"].bool()
    memory = {"free_at_start": _free(cuda)}
    result["memory"] = memory  # filled as the check goes: a failure keeps what was measured
    start = time.perf_counter()
    worker = _worker_class(backend)(_config(backend, model, settings, world), rank=rank, world_size=world)
    _sync(cuda)
    result["startup_seconds"] = time.perf_counter() - start
    memory["free_after_build"] = _free(cuda)

    logprobs = _gather(worker.get_logprobs(batch), batch)
    reference = _gather(worker.get_reference_logprobs(batch), batch)
    largest, mean = _gaps(logprobs, hf, valid)
    result.update(logprob_max_abs_diff=largest, logprob_mean_abs_diff=mean,
                  reference_vs_policy_before_training=_max_diff(reference, logprobs, valid))

    loss = ClippedPGLoss(reference_policy_kl_penalty=KL_PENALTY)
    rl = _rl_batch(batch, logprobs, reference)
    worker.train(rl, loss)  # warm-up: allocations, kernels
    _sync(cuda)
    start = time.perf_counter()
    metrics = [worker.train(rl, loss) for _ in range(settings["steps"])]
    _sync(cuda)
    seconds = time.perf_counter() - start
    tokens = int(batch.input_lengths.sum())
    tokens_per_s = settings["steps"] * tokens / seconds
    peak = _peak(cuda)
    memory["free_after_training"] = _free(cuda)
    result.update(tokens_per_s=tokens_per_s, tokens_per_s_per_device=tokens_per_s / world,
                  mfu=6 * n_params * tokens_per_s / (peak * world) if peak else None,
                  losses=[float(m["loss"]) for m in metrics])

    trained = _gather(worker.get_logprobs(batch), batch)
    reference_after = _gather(worker.get_reference_logprobs(batch), batch)
    result.update(policy_moved=_max_diff(trained, logprobs, valid),
                  reference_after_training_vs_before=_max_diff(reference_after, reference, valid))

    checkpoint = workdir / backend / "checkpoint"
    worker.save_checkpoint(str(checkpoint))
    worker.finalize_checkpoint()
    worker.train(rl, loss)
    worker.load_checkpoint(str(checkpoint))
    result["checkpoint_round_trip_diff"] = _max_diff(_gather(worker.get_logprobs(batch), batch), trained, valid)

    result.update(_export_rate(worker, cuda))
    memory["free_before_offload"] = _free(cuda)
    worker.offload_before_refit()
    _sync(cuda)
    memory["free_after_offload_before_refit"] = _free(cuda)
    worker.offload_after_refit()
    _sync(cuda)
    memory["free_after_offload_after_refit"] = _free(cuda)
    if cuda:
        result["live_after_offload"] = _census()
    worker.prepare_for_training()
    result["loss_after_offload"] = float(worker.train(rl, loss)["loss"])
    memory["free_after_prepare"] = _free(cuda)
    held = memory["free_at_start"] - memory["free_before_offload"]
    given_back = memory["free_after_offload_after_refit"] - memory["free_before_offload"]
    result.update(device_bytes_held_by_worker=held, device_bytes_given_back=given_back)

    bound_max, bound_mean = TOLERANCE[settings["precision"]]
    result["tolerance"] = {"max": bound_max, "mean": bound_mean, "same_weights": SAME_WEIGHTS}
    finite = all(math.isfinite(v) for v in [*result["losses"], result["loss_after_offload"]])
    result["checks"] = {
        "logprobs_match_hf": _logprobs_within(result),
        "reference_equals_initial_policy": result["reference_vs_policy_before_training"] <= SAME_WEIGHTS,
        "training_moves_policy_not_reference": result["policy_moved"] > SAME_WEIGHTS
        and result["reference_after_training_vs_before"] <= SAME_WEIGHTS,
        "checkpoint_round_trip": result["checkpoint_round_trip_diff"] <= SAME_WEIGHTS,
        "finite_losses": finite,
        "offload_gives_back": not cuda or given_back >= GIVEN_BACK * held,
    }
    result["ok"] = all(result["checks"].values())
    _shutdown(worker)
    del worker  # the last reference: what stays after it is what a closed worker leaves behind
    _release(cuda)
    if cuda:
        result.update(allocated_after_close=int(torch.cuda.memory_allocated()), free_after_close=_free(cuda),
                      live_after_close=_census())
    return result


def check_moe(backend: str, model: str, settings: dict[str, Any], rank: int, world: int, batch: Any,
              hf: torch.Tensor, hf_same_precision: torch.Tensor, result: dict[str, Any]) -> dict[str, Any]:
    """A mixture-of-experts model (Qwen3-MoE shapes): packed logprobs against HF and a finite
    training step with GRPO's loss, through the same worker. Top-k routing is discontinuous: a
    router score that rounds differently picks another expert, so the bound is HF's own error at
    the backend's precision (HF in that precision against HF in fp32), times :data:`MOE_SLACK`."""
    from nrl_core.algorithms.loss import ClippedPGLoss

    cuda = torch.cuda.is_available()
    valid = batch.fields["token_mask"].bool()
    worker = _worker_class(backend)(_config(backend, model, settings, world), rank=rank, world_size=world)
    logprobs = _gather(worker.get_logprobs(batch), batch)
    (largest, mean), (own_max, own_mean) = _gaps(logprobs, hf, valid), _gaps(hf_same_precision, hf, valid)
    result.update(logprob_max_abs_diff=largest, logprob_mean_abs_diff=mean,
                  hf_same_precision_max_abs_diff=own_max, hf_same_precision_mean_abs_diff=own_mean)
    metrics = worker.train(_rl_batch(batch, logprobs, logprobs), ClippedPGLoss(reference_policy_kl_penalty=KL_PENALTY))
    result["loss"] = float(metrics["loss"])
    bound_max, bound_mean = TOLERANCE[settings["precision"]]
    result["tolerance"] = {"max": max(bound_max, MOE_SLACK * own_max), "mean": max(bound_mean, MOE_SLACK * own_mean)}
    result["checks"] = {"logprobs_match_hf": _logprobs_within(result), "finite_loss": math.isfinite(result["loss"])}
    result["ok"] = all(result["checks"].values())
    _shutdown(worker)
    del worker
    _release(cuda)
    return result


def _shutdown(worker: Any) -> None:
    shutdown = getattr(worker, "shutdown", None)
    if callable(shutdown):
        shutdown()


def _release(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def _census(top: int = 12) -> dict[str, Any]:
    """The device tensors still reachable, largest groups first: what an offload or a close left."""
    groups: dict[str, list[int]] = {}
    gc.collect()
    for obj in gc.get_objects():
        try:
            if not (torch.is_tensor(obj) and obj.is_cuda):
                continue
            key = f"{type(obj).__name__} {tuple(obj.shape)} {str(obj.dtype).removeprefix('torch.')}"
            count_bytes = groups.setdefault(key, [0, 0])
            count_bytes[0] += 1
            count_bytes[1] += obj.untyped_storage().nbytes()
        except Exception:  # noqa: BLE001 - a census skips what it cannot read
            continue
    largest = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    return {"allocated": int(torch.cuda.memory_allocated()), "reserved": int(torch.cuda.memory_reserved()),
            "tensors": {k: {"count": c, "storage_bytes": b} for k, (c, b) in largest}}


def _guarded(name: str, fn: Any, *args: Any) -> dict[str, Any]:
    """One check; an exception is its result, with the figures measured before it (the other
    checks still run and report)."""
    result: dict[str, Any] = {}
    try:
        return fn(*args, result)
    except Exception as exc:  # noqa: BLE001 - reported, with where it came from
        import traceback

        return {**result, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": traceback.format_exc()[-6000:], "check": name}


def _n_params(model: str) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).parameters())


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
    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (dry run)", "world": world,
        "backend": process_group_backend(cuda), "torch": torch.__version__, "python": sys.version.split()[0],
        "settings": settings, "results": {}}

    def publish() -> None:  # after every check, so a crash or a hang later keeps what ran
        if rank == 0:
            summary["ok"] = bool(summary["results"]) and all(r["ok"] for r in summary["results"].values())
            Path(out).write_text(json.dumps(summary, indent=1))

    workdir = Path(args["workdir"])
    if "dense" in args["models"]:
        model = args["model"]
        batch = _batch(settings["rows"], settings["seq"], settings["vocab"])
        hf = _hf_logprobs(model, batch, cuda)
        own_max, own_mean = _gaps(_hf_logprobs(model, batch, cuda, getattr(torch, settings["precision"])), hf,
                                  batch.fields["token_mask"].bool())
        n_params = _n_params(model)
        summary["model"] = {"family": "llama", "size": settings["size"], "parameters": n_params,
                            "hf_same_precision_max_abs_diff": own_max, "hf_same_precision_mean_abs_diff": own_mean}
        for backend in args["backends"]:
            summary["results"][backend] = _guarded(backend, check_backend, backend, model, settings, rank, world,
                                                   batch, hf, n_params, workdir)
            publish()
            dist.barrier()
    if "moe" in args["models"]:
        model = args["moe_model"]
        batch = _batch(settings["rows"], settings["seq"] // 2, 512, seed=1)
        hf = _hf_logprobs(model, batch, cuda)
        same = _hf_logprobs(model, batch, cuda, getattr(torch, settings["precision"]))
        summary["moe_model"] = {"family": "qwen3_moe", "size": settings["moe_size"], "parameters": _n_params(model)}
        for backend in args["backends"]:
            summary["results"][f"{backend}-moe"] = _guarded(f"{backend}-moe", check_moe, backend, model, settings,
                                                            rank, world, batch, hf, same)
            publish()
            dist.barrier()
    publish()
    dist.destroy_process_group()


def _report(summary: dict[str, Any]) -> str:
    s = summary["settings"]
    lines = [f"{summary['device']} x{summary['world']} ({summary['backend']}, {s['precision']}), batch "
             f"{s['rows']}x{s['seq']} packed, torch {summary['torch']}, Python {summary['python']}"]
    if "model" in summary:
        m = summary["model"]
        lines.append(f"dense: llama {m['size']} ({m['parameters'] / 1e6:.1f}M parameters); HF itself at "
                     f"{s['precision']} vs fp32: max {m['hf_same_precision_max_abs_diff']:.2e} "
                     f"mean {m['hf_same_precision_mean_abs_diff']:.2e}")
    if "moe_model" in summary:
        lines.append(f"moe: qwen3_moe {summary['moe_model']['size']} "
                     f"({summary['moe_model']['parameters'] / 1e6:.1f}M parameters)")
    for name, r in summary["results"].items():
        status = "ok  " if r["ok"] else "FAIL"
        if "error" in r:
            lines.append(f"  {name:13s} FAIL {r['error'].splitlines()[0][:300]}")
            continue
        failed = [k for k, v in r["checks"].items() if not v]
        if "logprob_max_abs_diff" not in r:
            lines.append(f"  {name:13s} {status}")
            continue
        detail = (f"logprobs vs HF fp32 max {r['logprob_max_abs_diff']:.2e} mean {r['logprob_mean_abs_diff']:.2e} "
                  f"(bounds {r['tolerance']['max']:.2g}, {r['tolerance']['mean']:.2g})")
        if "tokens_per_s" in r:
            mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
            mem = r["memory"]
            detail += (f"; {r['tokens_per_s']:.0f} tokens/s, MFU {mfu}; export {r['export_bytes_per_s'] / 1e9:.1f} GB/s "
                       f"({r['export_vs_copy']:.2f}x a device copy); offload gave back "
                       f"{r['device_bytes_given_back'] / 2**30:.2f} of {r['device_bytes_held_by_worker'] / 2**30:.2f} GiB "
                       f"held (>= {100 * GIVEN_BACK:.0f}%); free GiB build/train/offload/prepare "
                       f"{mem['free_after_build'] / 2**30:.1f}/{mem['free_after_training'] / 2**30:.1f}/"
                       f"{mem['free_after_offload_after_refit'] / 2**30:.1f}/{mem['free_after_prepare'] / 2**30:.1f}")
        lines.append(f"  {name:13s} {status} {detail}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, fp32, a tiny model, two ranks")
    parser.add_argument("--world", type=int, default=None, help="ranks (default: every visible GPU; 2 on a dry run)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated subset of dtensor,megatron")
    parser.add_argument("--models", default="dense,moe", help="comma-separated subset of dense,moe")
    parser.add_argument("--out", default=None, help="write the results as JSON here too (after every check)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; run with --dry-run to check the code path on the CPU")
        return 2
    world = args.world or (2 if args.dry_run else torch.cuda.device_count())
    backends = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        parser.error(f"unknown backends {unknown}; choose from {', '.join(BACKENDS)}")
    models = [m for m in args.models.split(",") if m]
    if set(models) - {"dense", "moe"}:
        parser.error(f"unknown models {sorted(set(models) - {'dense', 'moe'})}; choose from dense, moe")
    from nrl_core.net import free_port
    from nrl_core.testing.tiny_models import cached_tiny_model

    settings = _settings(args.dry_run)
    # built here once, for every rank
    model = str(cached_tiny_model("llama", size=settings["size"], vocab_size=settings["vocab"])) \
        if "dense" in models else None
    moe_model = str(cached_tiny_model("qwen3_moe", size=settings["moe_size"], init_std=0.02)) \
        if "moe" in models else None
    with tempfile.TemporaryDirectory(prefix="nrl-gpu-check-") as tmp:
        # the Megatron conversion goes to a private directory unless the caller chose one
        os.environ.setdefault("NRL_MEGATRON_CHECKPOINT_DIR", str(Path(tmp) / "converted"))
        out = args.out or str(Path(tmp) / "results.json")
        torch.multiprocessing.spawn(_rank, args=(world, free_port(), {
            "dry_run": args.dry_run, "backends": backends, "models": models, "model": model, "moe_model": moe_model,
            "workdir": tmp}, out), nprocs=world, join=True)
        summary = json.loads(Path(out).read_text())
    print(_report(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
