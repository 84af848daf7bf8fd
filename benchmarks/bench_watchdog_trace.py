"""What the watchdog and the step trace cost a step: a ratio against the same steps without them.

A "step" is GRPO's phases (the step around refit, generation, hand-off, reward, logprobs and
training), each a fixed torch matmul workload, timed through :class:`PhaseTimer` exactly as the
algorithms time theirs. Rounds alternate between a run under a :class:`Watchdog` writing
``trace.json`` (its monitor thread running) and the same steps with no watchdog at all; the
figure is the median step time with over without. Under the watchdog every phase also records
``--ranks`` worker spans (what each rank's host writes per call it serves, :class:`WorkerSpans`),
serially in this process, so the workers' share is counted as if it were on the step's critical
path, and the monitor thread merges them into the trace at every tick (a run: every 10 s). The workload per phase is
far shorter than any real phase, so the ratio overstates the cost of a real step.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_watchdog_trace.py --rounds 10 --steps 40 --ranks 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nrl_core import timeline
from nrl_core.algorithms.setup import PhaseTimer
from nrl_core.watchdog import Watchdog, WatchdogSettings, phase

PHASES = ("refit", "generation", "hand_off", "reward", "logprobs", "training")


def step(a: torch.Tensor, matmuls: int, workers: list[timeline.WorkerSpans]) -> float:
    start = time.perf_counter()
    timer = PhaseTimer()
    with phase("step"):  # its end merges the workers' spans into trace.json
        for name in PHASES:
            with timer(name):
                wall, began = time.time(), time.perf_counter()
                for _ in range(matmuls):
                    a @ a
                for worker in workers:
                    worker.record(name, wall, time.perf_counter() - began)
    return time.perf_counter() - start


def steps(a: torch.Tensor, count: int, matmuls: int, log_dir: Path | None, ranks: int) -> list[float]:
    if log_dir is None:
        return [step(a, matmuls, []) for _ in range(count)]
    dog = Watchdog(WatchdogSettings(trace=True), log_dir)
    dog.merge_s = dog.tick_s  # merge at every tick (a run merges every 10 s): overstated on purpose
    with dog:
        directory = os.environ[timeline.TRACE_DIR_ENV]
        workers = [timeline.WorkerSpans(directory, "bench", rank) for rank in range(ranks)]
        for rank, worker in enumerate(workers):  # one file per rank, as separate processes would have
            worker.path = worker.path.with_name(f"bench-rank{rank}-pid{100000 + rank}.jsonl")
        return [step(a, matmuls, workers) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--size", type=int, default=256, help="matrix size of the phases' workload")
    parser.add_argument("--matmuls", type=int, default=4, help="matmuls per phase")
    parser.add_argument("--ranks", type=int, default=4, help="worker spans recorded per phase")
    args = parser.parse_args()
    torch.manual_seed(0)
    a = torch.randn(args.size, args.size)
    steps(a, 5, args.matmuls, None, 0)  # warm-up
    on: list[float] = []
    off: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            on += steps(a, args.steps, args.matmuls, Path(tmp) / f"run{r}", args.ranks)
            off += steps(a, args.steps, args.matmuls, None, 0)
        events = sum(1 for p in Path(tmp).glob("run*/trace.json") for line in p.open() if '"ph": "X"' in line)
    with_, without = statistics.median(on), statistics.median(off)
    print(f"step (median): {without * 1e3:.2f} ms without, {with_ * 1e3:.2f} ms with the watchdog and trace; "
          f"ratio {with_ / without:.4f} ({events} trace events, {args.ranks} ranks' spans per phase)")


if __name__ == "__main__":
    main()
