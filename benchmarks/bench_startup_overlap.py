"""What overlapping the driver's config check with the policy actor's imports would save at start-up.

Run:  OMP_NUM_THREADS=2 python benchmarks/bench_startup_overlap.py [--rounds 3]

Why: before its first step, ``nrl train grpo`` ran two long single-threaded stretches one after
the other. First the driver imports torch and transformers and validates the config. Then, after
Ray starts, the policy actor imports torch, transformers' model classes, the DTensor worker and
vLLM, while the driver waits. Each uses one core, so on two cores they can run side by side when the
actors are created before the config is fully checked, which ``nrl train`` now does
(``nrl_core/algorithms/policy_launch.py``). This times the two stretches as fresh processes, one
after the other and side by side, alternating, with the GRPO bench model: the difference bounds
what that reordering can save. Ray and the model loads are left out (they do not move).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "configs" / "grpo_tiny_cpu.yaml"

DRIVER = """
from nrl_core.algorithms.installed import load_and_validate
load_and_validate({config!r}, ["policy.model_name={model}"], algorithm="grpo")
import nrl_core.algorithms.grpo
"""
ACTOR = """
import torch, torch.distributed
import nrl_backend_dtensor.worker
from transformers import AutoModelForCausalLM
from vllm import LLM
"""


def start(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def timed(*codes: str) -> float:
    """Seconds until every process started (all at once) has exited."""
    begin = time.perf_counter()
    procs = [start(c) for c in codes]
    if any(p.wait() for p in procs):
        raise SystemExit("an import process failed; run its code by hand to see why")
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from nrl_core.testing.tiny_models import cached_tiny_model

    model = cached_tiny_model("llama", size="bench")  # nrl tiny-model --size bench --seed 0, built once
    driver = DRIVER.format(config=str(DEMO), model=model)
    rows = []
    for r in range(args.rounds):
        d, a = timed(driver), timed(ACTOR)
        both = timed(driver, ACTOR)
        rows.append((d, a, both))
        print(f"round {r}: driver {d:.2f} s, actor {a:.2f} s, one after the other {d + a:.2f} s, side by side {both:.2f} s",
              flush=True)
    d, a, both = (statistics.median(col) for col in zip(*rows))
    print(f"median: driver {d:.2f} s + actor {a:.2f} s = {d + a:.2f} s one after the other; side by side {both:.2f} s "
          f"(saves {d + a - both:.2f} s; threads {os.environ.get('OMP_NUM_THREADS', 'unset')})")


if __name__ == "__main__":
    main()
