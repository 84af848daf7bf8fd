"""Memory a refit adds to the engine's process, on each path a run can take, against issue 59's bound.

Each path runs in a fresh process: a first refit (the one-time allocations: vLLM's reload state,
reused shared-memory buffers, a broadcast group), then ``REFITS`` more, each sampled by
``process_tree_sampler.py`` on the engine's pid every 20 ms: its peak PSS above the PSS just
before it (shared pages divided among the processes that map them). The second refit's figure
includes the C allocator's warm-up (glibc keeps freed heap for reuse, per thread arena, so the
first refits grow the process until its free lists cover a refit); the steady figure is the
largest over the third refit on, the settled figure the largest of the last three (with
``--refits`` above four, after a longer warm-up: the async engine's child grows its heap over its
first few refits), and ``retained`` what the process holds after the last refit above its PSS
before the second. The bound is one bucket plus vLLM's per-layer staging (the
largest decoder layer's bytes: its layerwise reload holds a layer's tensors until the layer is
complete) plus 10%.

* ``colocated``: vLLM's engine in this process, as a colocated training rank hosts it; the source
  hands out fresh copies, as a sharded backend's gathered buckets are (``GatheredSource``).
* ``colocated-async``: vLLM's async engine here; its weights live in its engine-core child, whose
  pid is sampled (the parts reach it through ``/dev/shm`` files).
* ``shared-memory``, ``broadcast``: a source actor and a vLLM engine in an actor of its own (not
  colocated), the engine actor's pid sampled.
* ``async-shared-memory``, ``in-flight``: the async engine in an actor (the actor and its child
  sampled), refitted as a run between steps does and as an in-flight update does.

    OMP_NUM_THREADS=1 python benchmarks/bench_refit_paths_memory.py [--paths ...] [--size bench] [--layers 24] [--bucket-mb 16] [--rounds 3] [--refits 4] [--by-kind]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PATHS = ("colocated", "colocated-async", "shared-memory", "broadcast", "async-shared-memory", "in-flight")


def _config(model_dir: str, async_engine: bool) -> dict[str, Any]:
    vllm_cfg = {"enforce_eager": True, "async_engine": async_engine}
    return {"policy": {"model_name": model_dir, "precision": "float32", "max_total_sequence_length": 256, "seed": 0,
                       "generation": {"max_new_tokens": 8, "vllm_cfg": vllm_cfg}}}


def largest_layer_bytes(model_dir: str) -> int:
    """The bytes of the largest module vLLM reloads at once: a decoder layer, or a top-level module."""
    import math

    from nrl_gen_vllm.checkpoint import checkpoint_shapes

    modules: dict[str, int] = {}
    for name, shape in checkpoint_shapes(model_dir).items():
        parts = name.split(".")
        module = ".".join(parts[:3]) if len(parts) > 3 and parts[1] == "layers" else ".".join(parts[:-1])
        modules[module] = modules.get(module, 0) + 4 * math.prod(shape)  # float32 refits
    return max(modules.values())


def _engine_child(pid: int) -> int:
    """The async engine's engine-core process: the child of ``pid`` that vLLM started."""
    import psutil

    children = [p for p in psutil.Process(pid).children() if "python" in (p.name() or "").lower() or p.cmdline()]
    if not children:
        raise RuntimeError("the async engine has no child process to sample")
    return max(children, key=lambda p: p.memory_info().rss).pid


REFITS = 4
"""Refits sampled after the first by default: the second refit (warm-up) and three steady ones."""


BY_KIND = False
"""``--by-kind``: each refit is sampled by kind of mapping instead (smaps_kinds.py): no USS, and
slower refits on the colocated paths, whose sampler shares the refitting process."""


def _sampled(pid: int, run: Any) -> dict[str, Any]:
    """Each refit's peak PSS above the PSS before it, and what the last left above the first's start;
    with :data:`BY_KIND`, also each refit's growth by kind of mapping at its peak and after it."""
    from process_tree_sampler import TreeSampler
    from smaps_kinds import PeakByKind

    peaks, uss_peaks, seconds, by_kind = [], [], [], []
    start = TreeSampler(pid).sample().pss
    for _ in range(REFITS):
        sampler = PeakByKind(pid) if BY_KIND else TreeSampler(pid, interval=0.02, mem_interval=0.02)
        baseline = None if BY_KIND else sampler.sample()
        with sampler:
            began = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - began)
        if isinstance(sampler, PeakByKind):
            peaks.append(max(sampler.peak.total() - sampler.before.total(), 0))
            by_kind.append({"peak": sampler.growth("peak"), "after": sampler.growth("after")})
        else:
            peaks.append(max(sampler.peak("pss"), baseline.pss) - baseline.pss)
            uss_peaks.append(max(sampler.peak("uss"), baseline.uss) - baseline.uss)
    return {"peaks": peaks, "uss_peaks": uss_peaks, "seconds": seconds, "by_kind": by_kind,
            "retained": TreeSampler(pid).sample().pss - start}


def _colocated(path: str, model_dir: str, bucket: int) -> dict[str, Any]:
    from bench_refit_memory import GatheredSource

    from nrl_core.algorithms.refit_orchestrator import refit
    from nrl_core.refit.plan import RefitPlan
    from nrl_gen_vllm.worker import VllmGenerationWorker

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    worker = VllmGenerationWorker(_config(model_dir, path == "colocated-async"))
    source = GatheredSource(model_dir)
    plan = RefitPlan(bucket_bytes=bucket, mode="pipelined")
    try:
        refit(source, worker, plan)
        gc.collect()
        pid = _engine_child(os.getpid()) if path == "colocated-async" else os.getpid()
        return _sampled(pid, lambda: refit(source, worker, plan))
    finally:
        worker.shutdown()


def _in_actors(path: str, model_dir: str, bucket: int) -> dict[str, Any]:
    from nrl_core.algorithms.refit_orchestrator import refit
    from nrl_core.cluster import WorkerGroup, init_ray, shutdown_ray
    from nrl_core.cluster._host import WorkerHost
    from nrl_core.refit.plan import RefitPlan

    init_ray({})
    async_engine = path in ("async-shared-memory", "in-flight")
    source = WorkerGroup("nrl_core.testing.refit_host:RankedHFSource", 1, name="source", init_kwargs={"model": model_dir},
                         distributed_backend="none")
    engine = WorkerGroup("nrl_gen_vllm.worker:VllmGenerationWorker", 1, name="engine", distributed_backend="none",
                         init_kwargs={"config": _config(model_dir, async_engine)}, in_flight=path == "in-flight")
    plan = RefitPlan(bucket_bytes=bucket, mode="pipelined", streams_in_flight=True,
                     transport="broadcast" if path == "broadcast" else None)
    if path == "in-flight":
        plan = plan.with_mode("in_flight")
    try:
        report = refit(source.endpoint(0), engine.endpoint(0), plan)
        expected = "broadcast" if path == "broadcast" else "shared_memory"
        if report.transport != expected:  # on a GPU machine the rule picks otherwise: say so, measure nothing
            raise RuntimeError(f"{path}: the refit went over {report.transport}, not {expected}")
        pid = engine.infos[0].pid
        return _sampled(pid, lambda: refit(source.endpoint(0), engine.endpoint(0), plan))
    finally:
        engine.call("shutdown")
        source.call(WorkerHost.nrl_refit_release)
        source.shutdown()
        engine.shutdown()
        shutdown_ray()


def _by_kind_mib(growth: dict[str, int]) -> str:
    return ", ".join(f"{kind} {delta / 2**20:+.1f}" for kind, delta in growth.items()) or "nothing"


def main() -> None:
    global REFITS, BY_KIND
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--size", default="bench")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--bucket-mb", type=float, default=16.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--refits", type=int, default=REFITS, help="sampled after the first (at least 4)")
    parser.add_argument("--by-kind", action="store_true",
                        help="sample each refit by kind of mapping (heap, anonymous, refit parts, files)")
    parser.add_argument("--one", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    bucket = int(args.bucket_mb * 2**20)
    REFITS, BY_KIND = max(args.refits, 4), args.by_kind
    if args.one:
        run = _colocated if args.one.startswith("colocated") else _in_actors
        print(json.dumps(run(args.one, args.model, bucket)))
        return
    from nrl_core.testing.tiny_models import cached_tiny_model

    model_dir = str(cached_tiny_model("llama", args.size, num_hidden_layers=args.layers))
    layer = largest_layer_bytes(model_dir)
    bound = 1.1 * (bucket + layer)
    print(f"bound: 1.1 x (bucket {bucket / 2**20:.1f} MiB + largest layer {layer / 2**20:.1f} MiB) = "
          f"{bound / 2**20:.1f} MiB")
    results: dict[str, list[dict[str, Any]]] = {path: [] for path in args.paths}
    for round_ in range(args.rounds):
        for path in args.paths:
            proc = subprocess.run([sys.executable, __file__, "--one", path, "--model", model_dir, "--bucket-mb",
                                   str(args.bucket_mb), "--refits", str(REFITS), *(["--by-kind"] if BY_KIND else [])],
                              capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{path}: failed\n{proc.stderr[-3000:]}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            results[path].append(result)
            uss = ", ".join(f"{p / 2**20:.1f}" for p in result["uss_peaks"]) or "not sampled by kind"
            print(f"round {round_ + 1} {path}: peaks " + ", ".join(f"{p / 2**20:.1f}" for p in result["peaks"])
                  + f" MiB (USS {uss}), retained {result['retained'] / 2**20:.1f} MiB, seconds "
                  + ", ".join(f"{t:.2f}" for t in result["seconds"]), flush=True)
            for refit_, kinds in enumerate(result["by_kind"], start=2):
                print(f"  refit {refit_} by kind, MiB: at the peak " + _by_kind_mib(kinds["peak"])
                      + "; after " + _by_kind_mib(kinds["after"]), flush=True)

    def mib(values: list[int]) -> str:
        return f"{statistics.median(values) / 2**20:.1f} ({', '.join(f'{v / 2**20:.1f}' for v in values)})"

    print("| path | second refit, median (runs) MiB | steady: largest of refits 3 on, median (runs) MiB | "
          "settled: largest of the last three, median (runs) MiB | retained, median (runs) MiB | "
          "steady within the bound | settled within the bound |")
    print("|---|---|---|---|---|---|---|")
    for path, runs in results.items():
        second = [r["peaks"][0] for r in runs]
        steady = [max(r["peaks"][1:]) for r in runs]
        settled = [max(r["peaks"][-3:]) for r in runs]
        retained = [r["retained"] for r in runs]
        print(f"| {path} | {mib(second)} | {mib(steady)} | {mib(settled)} | {mib(retained)} | "
              f"{'yes' if max(steady) <= bound else 'no'} | {'yes' if max(settled) <= bound else 'no'} |")
    print(json.dumps({"bound_bytes": bound, "bucket_bytes": bucket, "layer_bytes": layer, "runs": results}))


if __name__ == "__main__":
    main()
