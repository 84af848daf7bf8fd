"""Memory of a colocated refit: loading each bucket as it is exported against staging the model.

One process holds the training side and a vLLM engine, as a colocated rank does. The training
side hands out copies (``GatheredSource``: what a sharded backend's export is, full tensors
gathered for the bucket), so whatever the engine keeps of them is memory the refit adds. A
sampler thread reads the process's RSS every few milliseconds; the figure is the peak above the
RSS before the refit. ``pipelined`` is a plan in ``RefitMode.PIPELINED`` (the engine declares
``pipelined_import``: each bucket loads before the next is exported); ``staged`` is the same refit
in ``RefitMode.STAGED`` (every bucket kept until the manifest check, then loaded), the reference
in the same run. Runs alternate; prints each run, the medians against the model's bytes and the
bucket, and one JSON line.

``--engine async``: vLLM's async engine, whose workers run in a child process (the tensors reach
it through ``/dev/shm`` files, in parts when pipelined). The figure is then the peak PSS of this
process and its children (``process_tree_sampler.py``: shared-memory pages counted once) above the
tree's PSS before the refit.

    OMP_NUM_THREADS=1 python benchmarks/bench_refit_memory.py [--engine sync|async] [--size bench] [--layers 24] [--bucket-mb 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_export_memory import PeakRss  # noqa: E402

MODES = ("pipelined", "staged")


class GatheredSource:
    """An HF weight source whose buckets are fresh copies, as a sharded backend's gathered ones are."""

    def __init__(self, model_dir: str) -> None:
        from nrl_core.refit.hf_source import HFWeightSource

        self.source = HFWeightSource(model_dir)

    def weight_manifest(self, dtype: str) -> list[Any]:
        return self.source.weight_manifest(dtype)

    def export_weights(self, bucket_bytes: int, dtype: str) -> Any:
        for bucket in self.source.export_weights(bucket_bytes, dtype):
            yield [(name, tensor.clone()) for name, tensor in bucket]


def _one(mode: str, model_dir: str, bucket: int, engine: str = "sync") -> dict[str, int]:
    """One refit of ``mode`` in this fresh process, after a first refit (the one-time allocations)."""
    import psutil
    from process_tree_sampler import TreeSampler

    from nrl_core.algorithms.refit_orchestrator import refit
    from nrl_core.refit.buckets import manifest_bytes
    from nrl_core.refit.plan import RefitPlan
    from nrl_gen_vllm.worker import VllmGenerationWorker

    vllm_cfg = {"enforce_eager": True, "async_engine": engine == "async"}
    config = {"policy": {"model_name": model_dir, "precision": "float32", "max_total_sequence_length": 256, "seed": 0,
                         "generation": {"max_new_tokens": 8, "vllm_cfg": vllm_cfg}}}
    worker = VllmGenerationWorker(config)
    source = GatheredSource(model_dir)
    refit(source, worker, RefitPlan(bucket_bytes=bucket, mode="pipelined"))
    gc.collect()
    plan = RefitPlan(bucket_bytes=bucket, mode="pipelined" if mode == "pipelined" else "staged")
    if engine == "async":  # the engine's workers in a child process: the tree's PSS
        sampler = TreeSampler(os.getpid(), interval=0.02, mem_interval=0.02)
        baseline = sampler.sample().pss
        with sampler:
            refit(source, worker, plan)
        peak = max(sample.pss for sample in sampler.samples if sample.pss is not None)
    else:
        baseline = psutil.Process().memory_info().rss
        with PeakRss() as sampled:
            refit(source, worker, plan)
        peak = sampled.peak
    worker.shutdown()
    return {"peak_above_baseline": peak - baseline, "model_bytes": manifest_bytes(source.weight_manifest("float32"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="bench")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--bucket-mb", type=float, default=16.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine", choices=("sync", "async"), default="sync")
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    bucket = int(args.bucket_mb * 2**20)
    if args.one:
        print(json.dumps(_one(args.one, args.model, bucket, args.engine)))
        return
    import subprocess

    from nrl_core.testing.tiny_models import cached_tiny_model

    model_dir = str(cached_tiny_model("llama", args.size, num_hidden_layers=args.layers))
    peaks: dict[str, list[int]] = {mode: [] for mode in MODES}
    model_bytes = 0
    for round_ in range(args.rounds):
        for mode in MODES:
            proc = subprocess.run([sys.executable, __file__, "--one", mode, "--model", model_dir, "--bucket-mb",
                                   str(args.bucket_mb), "--engine", args.engine], capture_output=True, text=True,
                                  check=True)
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            model_bytes = result["model_bytes"]
            peaks[mode].append(result["peak_above_baseline"])
            print(f"round {round_ + 1} {mode}: {result['peak_above_baseline'] / 2**20:.1f} MiB above the RSS before "
                  "the refit")
    medians = {mode: statistics.median(values) for mode, values in peaks.items()}
    for mode in MODES:
        print(f"{mode}: median {medians[mode] / 2**20:.1f} MiB = {medians[mode] / model_bytes:.3f} of the "
              f"{model_bytes / 2**20:.1f} MiB model, {medians[mode] / bucket:.2f} buckets of {args.bucket_mb:g} MiB")
    print(json.dumps({"model_bytes": model_bytes, "bucket_bytes": bucket, **{f"{m}_median_bytes": medians[m] for m in MODES},
                      **{f"{m}_runs": peaks[m] for m in MODES}}))


if __name__ == "__main__":
    main()
