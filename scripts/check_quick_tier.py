"""Shows that the quick tier catches a broken distribution: for each distribution in turn, one of
its public methods raises in every process of the run (tests/faults/sitecustomize.py), and
``scripts/test.sh --quick`` must fail because of it.

Usage: ``.venv/bin/python scripts/check_quick_tier.py [DISTRIBUTION ...]`` (default: all). Each
run stops at its first failure (``-x``); the script exits non-zero if any distribution's break
went unnoticed, naming it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ROOT / "tests" / "faults"

#: Per distribution, the public method broken on purpose: ``module:Qualified.name``.
BREAKS: dict[str, str] = {
    "nrl-core": "nrl_core.algorithms.advantages:group_advantages",
    "nrl-backend-dtensor": "nrl_backend_dtensor.worker:DTensorPolicyWorker.train",
    "nrl-backend-megatron": "nrl_backend_megatron.worker:MegatronPolicyWorker.train",
    "nrl-gen-vllm": "nrl_gen_vllm.worker:VllmGenerationWorker.generate",
    "nrl-gen-hf": "nrl_gen_hf.worker:HFGenerationWorker.generate",
    "nrl-env-math": "nrl_env_math.environment:MathEnvironment.score",
    "nrl-env-sliding-puzzle": "nrl_env_sliding_puzzle.environment:SlidingPuzzleEnvironment.step",
    "nrl-env-tool-lookup": "nrl_env_tool_lookup.environment:KVLookupEnvironment.step",
    "nrl-env-code": "nrl_env_code.environment:CodeEnvironment.step",
    "nrl-algo-distillation": "nrl_algo_distillation.algorithm:Distillation.step",
    "nrl-reward-model": "nrl_reward_model.algorithm:RewardModelTraining.step",
    "nrl-algo-ppo": "nrl_algo_ppo.algorithm:PPO.step",
    "nrl-data-nemo-rl": "nrl_data_nemo_rl.processors:math_hf_data_processor",
}

MARK = "is broken on purpose (NRL_TEST_BREAK)"

#: Tests the breaker itself fails, whatever it breaks: its ``sitecustomize`` on ``PYTHONPATH`` sends
#: every worker start to a fresh interpreter, which this test tells apart from a zygote fork.
FAILS_UNDER_THE_BREAKER = (
    "tests/core/test_worker_zygote.py::test_workers_start_from_the_zygote_as_a_fresh_interpreter_would",
)


def quick_tier_with(target: str) -> tuple[int, str, float]:
    """The quick tier's exit status and output with ``target`` broken, and its seconds."""
    env = dict(os.environ, NRL_TEST_BREAK=target,
               PYTHONPATH=os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH", "")) if p))
    start = time.monotonic()
    deselect = [arg for test in FAILS_UNDER_THE_BREAKER for arg in ("--deselect", test)]
    proc = subprocess.run([str(ROOT / "scripts" / "test.sh"), "--quick", "-x", "-q", "-p", "no:cacheprovider",
                           *deselect], cwd=ROOT, env=env, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def main(names: list[str]) -> int:
    unknown = [n for n in names if n not in BREAKS]
    if unknown:
        print(f"check_quick_tier: unknown distribution {', '.join(unknown)}; choose from {', '.join(BREAKS)}")
        return 2
    missed = []
    for name in names or list(BREAKS):
        status, output, seconds = quick_tier_with(BREAKS[name])
        failed = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
        caught = status not in (0, 5) and MARK in output
        print(f"{name}: {BREAKS[name]} broken -> quick tier exit {status} in {seconds:.0f} s; "
              f"{failed[0] if failed else 'no failing test'}" + ("" if caught else "  <-- NOT CAUGHT"), flush=True)
        if not caught:
            missed.append(name)
    if missed:
        print(f"check_quick_tier: the quick tier passes with {', '.join(missed)} broken; add a test of it to the tier")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
