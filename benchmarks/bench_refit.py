"""Refit throughput: nrl's whole refit vs vLLM's own layerwise reload vs a plain memory copy.

For four dense model sizes (Llama shapes, float32), and with ``--sizes moe,dense-like-moe`` a
mixture-of-experts model (Qwen3-MoE, 16 experts of 8 layers: 384 expert tensors) against a dense
Llama of the same bytes (0.2% apart), which moves the same data in 16x fewer, larger tensors:

* ``memcpy``: copying the state dict into preallocated tensors (the hardware's ceiling);
* ``vllm_reload``: vLLM's own ``reload_weights`` (layerwise reload) with the same state dict,
  called directly on the engine, in the process that holds the engine: the reference (for a MoE
  model with the CPU expert prepack vLLM skips, without which its output is wrong);
* ``nrl_in_process``: :func:`nrl_core.refit.refit` from an HF weight source in this process
  (export, manifest check, checkpoint check, layerwise reload, prefix-cache reset), against the
  reload in this process;
* ``nrl_cross_process``: the source in one Ray actor, the vLLM worker in another, shared memory,
  against the reload inside the vLLM worker's actor: the atomic refit (the whole export, then the
  load);
* ``nrl_pipelined``: the same, pipelined (``pipelined_import``, the default for vLLM): the source
  publishes each chunk of a bucket as it writes it and the engine loads it while the source writes
  the next;
* ``vllm_reload_beside_export``: vLLM's reload inside the engine's actor while the training actor
  exports the same model into shared memory at the same time, without any import: the load of a
  perfectly overlapped refit, so its ratio to the reload alone is the most any pipelined refit
  can reach on this machine (the two processes share its cores).

A second line per size splits the pipelined refit's time (median of ``--repeats``): ``start``
until the engine takes the first chunk, ``stream`` until it has loaded the last one's tensors,
``finish`` until the refit returns, and ``round_trip``, a small call to each actor at once.

Each figure is the best of ``--repeats``, nrl and its reference taken in turns, so that both see
the same machine (a shared 2-core VM moves by 20-30% from one minute to the next).

    python benchmarks/bench_refit.py [--sizes small,bench-L2,bench,bench-L24] [--repeats 15] [--no-cross-process]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

SIZES = {  # name -> (tiny_models family, size, config overrides)
    "small": ("llama", "small", {}),
    "bench-L2": ("llama", "bench", {"num_hidden_layers": 2}),
    "bench": ("llama", "bench", {}),
    "bench-L24": ("llama", "bench", {"num_hidden_layers": 24}),
    "moe": ("qwen3_moe", "bench", {}),  # 166.0 MB
    "dense-like-moe": ("llama", "bench", {"intermediate_size": 2816}),  # 165.7 MB
}
DEFAULT_SIZES = ("small", "bench-L2", "bench", "bench-L24")
BUCKET = 256 * 2**20


def _best_in_turns(fns: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Run each timing function once to warm up, then ``repeats`` times in turns; the best of each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(fn())
    return {name: min(values) for name, values in times.items()}


def _timed(fn: Callable[[], Any]) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return run


def _config(model_dir: str) -> dict:
    return {"policy": {"model_name": model_dir, "precision": "float32", "max_total_sequence_length": 256, "seed": 0,
                       "generation": {"max_new_tokens": 8, "vllm_cfg": {"enforce_eager": True}}}}


def _state_dict(model_dir: str) -> list[tuple[str, Any]]:
    """The tensors of the model's checkpoint (for a MoE model, one per expert: what vLLM loads)."""
    from nrl_core.refit.hf_source import HFWeightSource

    return [item for bucket in HFWeightSource(model_dir).export_weights(1 << 62, "float32") for item in bucket]


def _vllm_reload(vllm_worker: Any, items: list[tuple[str, Any]]) -> None:
    from nrl_gen_vllm.cpu_moe import reloading

    with reloading():
        vllm_worker.reload_weights(weights_iterator=iter(items))


def _reload(worker: Any, items: list[tuple[str, Any]]) -> None:
    """vLLM's own reload, with the CPU MoE kernel's expert prepack that vLLM skips on a weight update
    run during it as nrl runs it (nothing to do for a dense model): the least a reload that leaves
    a MoE engine correct costs."""
    worker.llm.collective_rpc(_vllm_reload, args=(items,))


def _reload_in_actor(worker: Any) -> float:
    """Runs inside the generation actor: vLLM's own reload of the checkpoint's state dict there."""
    items = getattr(worker, "bench_items", None)
    if items is None:
        items = worker.bench_items = _state_dict(worker.model_dir)
    start = time.perf_counter()
    _reload(worker, items)
    return time.perf_counter() - start


def _export_only(worker: Any) -> float:
    """Runs inside the training actor: a pipelined refit's export into shared memory (the same
    chunks, into the same buffers) and nothing else."""
    from nrl_core.refit.endpoints import PIPELINE_CHUNK_BYTES, _Chunked
    from nrl_core.refit.transports import RefitSession, SharedMemoryTransport

    transport = SharedMemoryTransport()
    session = transport.prepare(RefitSession())
    start = time.perf_counter()
    sender = transport.sender(session)
    for bucket in _Chunked(worker, PIPELINE_CHUNK_BYTES).export_weights(BUCKET, "float32"):
        sender.send(bucket)
    sender.close()
    seconds = time.perf_counter() - start
    transport.cleanup(session)
    return seconds


def _reload_beside_export(src: Any, sink: Any) -> float:
    """vLLM's reload in the engine's actor while the training actor exports into shared memory at
    the same time: what a perfectly overlapped refit's load costs on this machine."""
    from nrl_core.cluster._host import WorkerHost

    exporting = src.call_async(WorkerHost.execute, _export_only, on=0)
    seconds = sink.call(WorkerHost.execute, _reload_in_actor, on=0)
    src.get(exporting)
    return seconds


def _probe_stream(worker: Any) -> None:
    """Runs inside the generation actor: from now on each pipelined refit records, on the worker,
    when the engine took its first chunk and when the stream ended (``time.time``)."""
    from nrl_core.refit.channel import ChannelReader

    if getattr(ChannelReader, "_bench_probe", False):
        return
    handles = ChannelReader.handles

    def timed(self: Any) -> Iterator[Any]:
        marks = worker.bench_marks = {}
        for handle in handles(self):
            if "first" not in marks:
                marks["first"] = time.time()
            yield handle
        marks["end"] = time.time()  # the engine asked for more after the last chunk's tensors

    ChannelReader.handles = timed
    ChannelReader._bench_probe = True


def _stream_marks(worker: Any) -> dict[str, float]:
    return dict(getattr(worker, "bench_marks", {}))


def _phases(src: Any, sink: Any, repeats: int) -> dict[str, float]:
    """Where a pipelined refit's time goes, median seconds over ``repeats``: ``start`` (the call
    until the engine takes the first chunk: Ray's calls, the source's manifest and first chunk,
    the engine's reload set-up), ``stream`` (until the engine has loaded every chunk's tensors and
    asks for more), ``finish`` (the reload's end and Ray's return), and ``round_trip``: a small
    call to each actor at once, about the floor any refit between two actors pays."""
    import statistics

    from nrl_core.algorithms.refit_orchestrator import refit
    from nrl_core.cluster._host import WorkerHost
    from nrl_core.refit.plan import RefitPlan

    sink.call(WorkerHost.execute, _probe_stream, on=0)
    rows: dict[str, list[float]] = {"start": [], "stream": [], "finish": [], "round_trip": []}
    for _ in range(repeats):
        begin = time.time()
        refit(src.endpoint(0), sink.endpoint(0), RefitPlan(bucket_bytes=BUCKET, mode="pipelined"))
        done = time.time()
        marks = sink.call(WorkerHost.execute, _stream_marks, on=0)
        rows["start"].append(marks["first"] - begin)
        rows["stream"].append(marks["end"] - marks["first"])
        rows["finish"].append(done - marks["end"])
        begin = time.perf_counter()
        calls = [src.call_async(WorkerHost.execute, _stream_marks, on=0),
                 sink.call_async(WorkerHost.execute, _stream_marks, on=0)]
        src.get(calls[0])
        sink.get(calls[1])
        rows["round_trip"].append(time.perf_counter() - begin)
    return {key: statistics.median(values) for key, values in rows.items()}


def measure(name: str, repeats: int, cross: bool) -> dict:
    import torch

    from nrl_core.algorithms.refit_orchestrator import refit
    from nrl_core.refit.buckets import manifest_bytes
    from nrl_core.refit.hf_source import HFWeightSource
    from nrl_core.refit.plan import RefitPlan
    from nrl_core.testing.tiny_models import cached_tiny_model
    from nrl_gen_vllm.worker import VllmGenerationWorker

    family, size, overrides = SIZES[name]
    model_dir = str(cached_tiny_model(family, size, **overrides))
    source = HFWeightSource(model_dir)
    nbytes = manifest_bytes(source.weight_manifest("float32"))
    items = _state_dict(model_dir)
    state = dict(items)
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    worker = VllmGenerationWorker(_config(model_dir))
    best = _best_in_turns({"memcpy": _timed(lambda: [dst[k].copy_(v) for k, v in state.items()]),
                           "vllm_reload": _timed(lambda: _reload(worker, items)),
                           "nrl_in_process": _timed(lambda: refit(source, worker, RefitPlan(bucket_bytes=BUCKET)))}, repeats)
    worker.shutdown()
    row = {"bytes": nbytes, "tensors": len(items), **{key: nbytes / seconds for key, seconds in best.items()}}
    if cross:
        from nrl_core.cluster import WorkerGroup
        from nrl_core.cluster._host import WorkerHost

        src = WorkerGroup("nrl_core.testing.refit_host:RankedHFSource", 1, name="bench-source",
                          init_kwargs={"model": model_dir}, distributed_backend="none")
        sink = WorkerGroup("nrl_gen_vllm.worker:VllmGenerationWorker", 1, name="bench-sink",
                           init_kwargs={"config": _config(model_dir)}, distributed_backend="none")
        best = _best_in_turns({"vllm_reload_in_actor": lambda: sink.call(WorkerHost.execute, _reload_in_actor, on=0),
                               "vllm_reload_beside_export": lambda: _reload_beside_export(src, sink),
                               "nrl_cross_process": _timed(lambda: refit(src.endpoint(0), sink.endpoint(0), RefitPlan(bucket_bytes=BUCKET))),
                               "nrl_pipelined": _timed(lambda: refit(src.endpoint(0), sink.endpoint(0), RefitPlan(bucket_bytes=BUCKET, mode="pipelined")))},
                              repeats)
        row.update({key: nbytes / seconds for key, seconds in best.items()})
        row["pipelined_phases_s"] = _phases(src, sink, repeats)
        sink.call("shutdown")
        src.call(WorkerHost.nrl_refit_release)
        src.shutdown()
        sink.shutdown()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default=",".join(DEFAULT_SIZES), help=f"of {', '.join(SIZES)}")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-cross-process", action="store_true")
    args = parser.parse_args()
    cross = not args.no_cross_process
    if cross:
        import ray

        env = {k: os.environ[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING") if k in os.environ}
        # One intra-op thread everywhere: what vLLM sets for itself in this process, and on two
        # cores the only setting where two busy processes do not stall each other's thread teams.
        env["OMP_NUM_THREADS"] = "1"
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    results = {}
    for name in args.sizes.split(","):
        results[name] = measure(name, args.repeats, cross)
        r = results[name]
        line = (f"{name:14s} {r['bytes'] / 1e6:8.1f} MB {r['tensors']:4d} tensors  memcpy {r['memcpy'] / 1e9:6.2f} GB/s  "
                f"vllm_reload {r['vllm_reload'] / 1e9:5.2f} GB/s  nrl_in_process {r['nrl_in_process'] / 1e9:5.2f} GB/s "
                f"({r['nrl_in_process'] / r['vllm_reload']:.0%} of vLLM, {r['nrl_in_process'] / r['memcpy']:.0%} of memcpy)")
        if cross:
            line += (f"  vllm_reload_in_actor {r['vllm_reload_in_actor'] / 1e9:5.2f} GB/s  "
                     f"nrl_cross_process {r['nrl_cross_process'] / 1e9:5.2f} GB/s "
                     f"({r['nrl_cross_process'] / r['vllm_reload_in_actor']:.0%} of vLLM, "
                     f"{r['nrl_cross_process'] / r['memcpy']:.0%} of memcpy)  "
                     f"nrl_pipelined {r['nrl_pipelined'] / 1e9:5.2f} GB/s "
                     f"({r['nrl_pipelined'] / r['vllm_reload_in_actor']:.0%} of vLLM)  "
                     f"vllm_reload_beside_export {r['vllm_reload_beside_export'] / 1e9:5.2f} GB/s "
                     f"({r['vllm_reload_beside_export'] / r['vllm_reload_in_actor']:.0%} of vLLM alone: the ceiling "
                     f"of any pipelined refit here)")
            phases = r["pipelined_phases_s"]
            line += ("\n" + " " * 15 + "pipelined, median ms: " +
                     ", ".join(f"{key} {seconds * 1e3:.1f}" for key, seconds in phases.items()))
        print(line, flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
