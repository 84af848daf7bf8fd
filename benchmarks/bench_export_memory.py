"""Peak memory of the HF export: streamed tensor by tensor against the whole state dict at once.

Each run is a fresh process that loads the model (``nrl tiny-model`` size ``gpu`` by default,
0.69B parameters, 2.8 GB in float32), waits for its memory to settle, and then exports it in
``--dtype`` from the weight stream a backend hands the export (``HFWeightSource.export_weights``,
buckets of the SDK's export size). A sampler thread reads the process's RSS every few
milliseconds; the figure is the peak above the settled baseline. ``streamed`` is
``write_hf_export`` (what every backend's ``export_hf`` calls); ``whole`` is the reference in the
same run: every bucket collected, then ``safetensors.torch.save_file``, as the export did before.
Runs alternate; prints each run, the medians, their ratio, and one JSON line.

    OMP_NUM_THREADS=1 python benchmarks/bench_export_memory.py [--size gpu] [--dtype bfloat16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

MODES = ("streamed", "whole")


class PeakRss:
    """The largest RSS of this process seen by a thread polling every ``interval`` seconds."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        process = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, process.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _one(mode: str, model_dir: str, dtype: str) -> dict[str, float]:
    """One export in this process; the peak RSS above the loaded model's, in bytes."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    from nrl_core.refit.hf_source import HFWeightSource
    from nrl_core.sdk.base import EXPORT_BUCKET_BYTES
    from nrl_core.sdk.hf_export import write_hf_export

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for param in model.parameters():  # resident and private, as a trained model is (not file pages mapped on demand)
        param.data = param.data.clone()
    gc.collect()
    time.sleep(1.0)
    baseline = psutil.Process().memory_info().rss
    stream = HFWeightSource(model).export_weights(EXPORT_BUCKET_BYTES, dtype)
    with tempfile.TemporaryDirectory() as out, PeakRss() as peak:
        start = time.perf_counter()
        if mode == "streamed":
            write_hf_export(stream, model.config, model_dir, out, dtype=dtype, writer=True)
        else:
            from safetensors.torch import save_file

            state = {name: tensor.contiguous().cpu() for bucket in stream for name, tensor in bucket}
            save_file(state, f"{out}/model.safetensors", metadata={"format": "pt"})
            del state
        seconds = time.perf_counter() - start
    return {"peak_above_model": float(peak.peak - baseline), "model_bytes": float(model_bytes), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="gpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--single", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single:
        print(json.dumps(_one(args.single, args.model, args.dtype)))
        return
    from nrl_core.testing.tiny_models import cached_tiny_model

    model = str(cached_tiny_model("llama", size=args.size))
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            proc = subprocess.run([sys.executable, __file__, "--single", mode, "--model", model, "--dtype", args.dtype],
                                  capture_output=True, text=True, check=True)
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[mode].append(result)
            print(f"round {r + 1} {mode:8s} peak above the model {result['peak_above_model'] / 2**20:8.1f} MiB "
                  f"in {result['seconds']:.1f} s")
    gib = runs["streamed"][0]["model_bytes"] / 2**30
    medians = {mode: statistics.median(x["peak_above_model"] for x in runs[mode]) for mode in MODES}
    ratio = medians["streamed"] / medians["whole"]
    print(f"model {gib:.2f} GiB in float32; export in {args.dtype}: streamed {medians['streamed'] / 2**20:.1f} MiB, "
          f"whole {medians['whole'] / 2**20:.1f} MiB (medians); streamed/whole {ratio:.3f}; "
          f"streamed / float32 model {medians['streamed'] / runs['streamed'][0]['model_bytes']:.3f}")
    print(json.dumps({"bench": "export_memory", "size": args.size, "dtype": args.dtype, "rounds": args.rounds,
                      "model_bytes": runs["streamed"][0]["model_bytes"], **{f"{m}_peak": medians[m] for m in MODES},
                      "ratio_streamed_over_whole": ratio}))


if __name__ == "__main__":
    main()
