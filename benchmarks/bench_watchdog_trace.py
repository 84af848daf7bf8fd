"""What the watchdog and the step trace cost a step: a ratio against the same steps without them.

A "step" is GRPO's phases (the step around refit, generation, hand-off, reward, logprobs and
training), each a fixed torch matmul workload, timed through :class:`PhaseTimer` exactly as the
algorithms time theirs. Rounds alternate between a run under a :class:`Watchdog` writing
``trace.json`` (its monitor thread running) and the same steps with no watchdog at all; the
figure is the median step time with over without. The workload per phase is far shorter than
any real phase, so the ratio overstates the cost of a real step.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_watchdog_trace.py --rounds 10 --steps 40
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nrl_core.algorithms.setup import PhaseTimer
from nrl_core.watchdog import Watchdog, WatchdogSettings, phase

PHASES = ("refit", "generation", "hand_off", "reward", "logprobs", "training")


def step(a: torch.Tensor, matmuls: int) -> float:
    start = time.perf_counter()
    timer = PhaseTimer()
    with phase("step"):
        for name in PHASES:
            with timer(name):
                for _ in range(matmuls):
                    a @ a
    return time.perf_counter() - start


def steps(a: torch.Tensor, count: int, matmuls: int, log_dir: Path | None) -> list[float]:
    if log_dir is None:
        return [step(a, matmuls) for _ in range(count)]
    with Watchdog(WatchdogSettings(trace=True), log_dir):
        return [step(a, matmuls) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--size", type=int, default=256, help="matrix size of the phases' workload")
    parser.add_argument("--matmuls", type=int, default=4, help="matmuls per phase")
    args = parser.parse_args()
    torch.manual_seed(0)
    a = torch.randn(args.size, args.size)
    steps(a, 5, args.matmuls, None)  # warm-up
    on: list[float] = []
    off: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            on += steps(a, args.steps, args.matmuls, Path(tmp) / f"run{r}")
            off += steps(a, args.steps, args.matmuls, None)
        events = sum(1 for p in Path(tmp).glob("run*/trace.json") for line in p.open() if '"ph"' in line)
    with_, without = statistics.median(on), statistics.median(off)
    print(f"step (median): {without * 1e3:.2f} ms without, {with_ * 1e3:.2f} ms with the watchdog and trace; "
          f"ratio {with_ / without:.4f} ({events} trace events)")


if __name__ == "__main__":
    main()
