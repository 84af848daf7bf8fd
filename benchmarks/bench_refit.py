"""Refit throughput: nrl's whole refit vs vLLM's own layerwise reload vs a plain memory copy.

For four model sizes (Llama shapes, float32):

* ``memcpy``: copying the state dict into preallocated tensors (the hardware's ceiling);
* ``vllm_reload``: vLLM's own ``reload_weights`` (layerwise reload) with the same state dict,
  called directly on the in-process engine: the baseline;
* ``nrl_in_process``: :func:`nrl_core.refit.refit` from an HF weight source in this process
  (export, manifest check, checkpoint check, layerwise reload, prefix-cache reset);
* ``nrl_cross_process``: the source in one Ray actor, the vLLM worker in another, shared memory.

    python benchmarks/bench_refit.py [--sizes s,m,bench,l] [--repeats 3] [--no-cross-process]

Prints a table and one JSON line; bytes/s are best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

SIZES = {  # name -> (tiny_models size, config overrides)
    "small": ("small", {}),
    "bench-L2": ("bench", {"num_hidden_layers": 2}),
    "bench": ("bench", {}),
    "bench-L24": ("bench", {"num_hidden_layers": 24}),
}
BUCKET = 256 * 2**20


def _best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _config(model_dir: str) -> dict:
    return {"policy": {"model_name": model_dir, "precision": "float32", "max_total_sequence_length": 256,
                       "generation": {"max_new_tokens": 8, "vllm_cfg": {"enforce_eager": True}}}}


def measure(name: str, repeats: int, cross: bool) -> dict:
    import torch

    from nrl_core.refit import refit
    from nrl_core.refit.buckets import manifest_bytes
    from nrl_core.refit.hf_source import HFWeightSource
    from nrl_core.testing.tiny_models import cached_tiny_model
    from nrl_gen_vllm.worker import VllmGenerationWorker

    size, overrides = SIZES[name]
    model_dir = str(cached_tiny_model("llama", size, **overrides))
    source = HFWeightSource(model_dir)
    nbytes = manifest_bytes(source.weight_manifest("float32"))
    state = {k: v.detach() for k, v in source.model.state_dict().items()}
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    t_copy = _best(lambda: [dst[k].copy_(v) for k, v in state.items()], repeats)

    worker = VllmGenerationWorker(_config(model_dir))
    items = list(state.items())
    t_vllm = _best(lambda: worker.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(items)}),
                   repeats)
    t_nrl = _best(lambda: refit(source, worker, bucket_bytes=BUCKET), repeats)
    worker.shutdown()
    row = {"bytes": nbytes, "memcpy": nbytes / t_copy, "vllm_reload": nbytes / t_vllm, "nrl_in_process": nbytes / t_nrl}
    if cross:
        import ray

        from nrl_core.testing.refit_host import RefitTestHost

        host = ray.remote(RefitTestHost)
        src = host.remote("nrl_core.refit.hf_source:HFWeightSource", model_dir)
        sink = host.remote("nrl_gen_vllm.worker:VllmGenerationWorker", _config(model_dir))
        ray.get([src.pid.remote(), sink.pid.remote()])
        t_cross = _best(lambda: refit(src, sink, bucket_bytes=BUCKET), repeats)
        row["nrl_cross_process"] = nbytes / t_cross
        ray.get(sink.call.remote("shutdown"))
        ray.kill(src)
        ray.kill(sink)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-cross-process", action="store_true")
    args = parser.parse_args()
    cross = not args.no_cross_process
    if cross:
        import ray

        import torch

        env = {k: os.environ[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING") if k in os.environ}
        # Ray starts actors with one intra-op thread; give them the driver's, as the in-process
        # reference has, so the comparison is about the transfer and not the thread count.
        env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    results = {}
    for name in args.sizes.split(","):
        results[name] = measure(name, args.repeats, cross)
        r = results[name]
        line = (f"{name:10s} {r['bytes'] / 1e6:8.1f} MB  memcpy {r['memcpy'] / 1e9:6.2f} GB/s  "
                f"vllm_reload {r['vllm_reload'] / 1e9:5.2f} GB/s  nrl_in_process {r['nrl_in_process'] / 1e9:5.2f} GB/s "
                f"({r['nrl_in_process'] / r['vllm_reload']:.0%} of vLLM, {r['nrl_in_process'] / r['memcpy']:.0%} of memcpy)")
        if cross:
            line += (f"  nrl_cross_process {r['nrl_cross_process'] / 1e9:5.2f} GB/s "
                     f"({r['nrl_cross_process'] / r['vllm_reload']:.0%} of vLLM, "
                     f"{r['nrl_cross_process'] / r['memcpy']:.0%} of memcpy)")
        print(line, flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
