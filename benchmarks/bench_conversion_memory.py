"""Peak memory of the one-time HF -> Megatron conversion: part by part against the whole model.

Each run is a fresh process, a world of one at tensor/pipeline/expert parallel 1 (as the converter
child runs), that converts ``nrl tiny-model`` size ``gpu`` by default (0.69B widths, float32) into a
fresh directory. A sampler thread reads the process's RSS every few milliseconds; the figure is
the peak above the baseline taken after imports and Megatron's set-up. ``parts`` is
``save_conversion`` (the model built on the meta device, one decoder layer or module given memory,
read, saved and dropped at a time); ``whole`` is the reference in the same run, the conversion as
it was before: every HF tensor read, mapped, loaded into a model built whole, then saved at once.
Runs alternate; prints each run, the medians against the model's float32 size, and one JSON line.

    OMP_NUM_THREADS=1 python benchmarks/bench_conversion_memory.py [--size gpu] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_export_memory import PeakRss  # noqa: E402

MODES = ("parts", "whole")


def _whole(model_dir: str, out_dir: str) -> None:
    """The conversion before it went part by part (the reference)."""
    import torch
    from megatron.core import dist_checkpointing
    from transformers import AutoConfig

    from nrl_backend_megatron.convert.mapping import hf_to_megatron, tied_embeddings
    from nrl_backend_megatron.convert.sharded import fine_grained, load_hf_state
    from nrl_backend_megatron.model import ParallelLayout, build_model, transformer_config
    from nrl_backend_megatron.weights import load_full_state

    hf_config = AutoConfig.from_pretrained(model_dir)
    state = hf_to_megatron(load_hf_state(model_dir), hf_config)
    config = transformer_config(hf_config, ParallelLayout(), params_dtype=torch.float32, bf16=False, fp16=False, moe={})
    model = build_model(hf_config, config, pre_process=True, post_process=True)
    with torch.no_grad():
        load_full_state(model, state, 0, 1, tied_embeddings(hf_config))
    del state
    dist_checkpointing.save(fine_grained(model.sharded_state_dict()), out_dir)


def _one(mode: str, model_dir: str) -> dict[str, float]:
    import gc

    import psutil
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from nrl_backend_megatron import cpu_shim
    from nrl_backend_megatron.convert.sharded import save_conversion

    cpu_shim.install()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    gc.collect()
    baseline = psutil.Process().memory_info().rss
    with tempfile.TemporaryDirectory() as out, PeakRss() as peak:
        if mode == "parts":
            save_conversion(model_dir, out, {}, {}, False)
        else:
            _whole(model_dir, out)
    dist.destroy_process_group()
    model_bytes = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    return {"peak_above_baseline": peak.peak - baseline, "model_bytes": model_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="gpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_one(args.one, args.model)))
        return
    from nrl_core.testing.tiny_models import cached_tiny_model

    model_dir = str(cached_tiny_model("llama", size=args.size))
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        for mode in MODES:
            proc = subprocess.run([sys.executable, __file__, "--one", mode, "--model", model_dir],
                                  capture_output=True, text=True, check=True)
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[mode].append(result)
            print(f"round {round_ + 1} {mode}: peak {result['peak_above_baseline'] / 2**20:.1f} MiB above the baseline")
    size = runs["parts"][0]["model_bytes"]
    medians = {mode: statistics.median(r["peak_above_baseline"] for r in runs[mode]) for mode in MODES}
    for mode in MODES:
        print(f"{mode}: median peak {medians[mode] / 2**20:.1f} MiB = {medians[mode] / size:.3f} of the "
              f"{size / 2**30:.2f} GiB float32 checkpoint")
    print(json.dumps({"model_bytes": size, **{f"{m}_median_bytes": medians[m] for m in MODES},
                      "parts_over_model": medians["parts"] / size, "whole_over_model": medians["whole"] / size}))


if __name__ == "__main__":
    main()
