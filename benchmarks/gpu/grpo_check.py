"""GRPO end to end on one GPU, through ``nrl train`` as a user runs it: Ray, the DTensor backend,
rollouts from the hf generation backend (nrl-gen-hf, colocated: refit by reference, offload and
wake around every generation), the math environment, checkpoints and the HF export.

The task is the CPU demo's (``scripts/demo.sh``): a small Llama built locally, an SFT warm start
on two-operand arithmetic, then GRPO on the same problems with the configs in
``examples/configs`` and these overrides only: fewer steps, outputs in a private folder, and
``policy.precision`` left to the device (bf16 on a GPU that has it). It passes when the reward
rises: validation accuracy after GRPO above the accuracy after SFT (the first validation), and
the mean training reward of the last five steps above that of the first five.

    python benchmarks/gpu/grpo_check.py [--steps N] [--dry-run] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
WINDOW = 5  # steps averaged at each end of the run for the training-reward comparison


def _nrl(*args: str, log: Path) -> float:
    """One ``nrl`` command; its output goes to ``log``. Returns its seconds; raises on failure
    with the log's tail."""
    start = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.call([sys.executable, "-c", "import sys; from nrl_core.cli import main; sys.exit(main())",
                                *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        raise RuntimeError(f"nrl {' '.join(args[:2])} exited {code}:\n" + log.read_text()[-4000:])
    return time.perf_counter() - start


def _metrics(log_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run(work: Path, steps: int, dry_run: bool) -> dict[str, Any]:
    precision = "float32" if dry_run else "null"
    sft_steps = 40 if dry_run else 400
    seconds = {"tiny_model": _nrl("tiny-model", str(work / "base"), "--family", "llama", "--size", "small",
                                  "--seed", "0", log=work / "tiny_model.log")}
    seconds["sft"] = _nrl("train", "sft", "--config", str(CONFIGS / "sft_tiny_cpu.yaml"),
                          f"policy.model_name={work / 'base'}", f"checkpointing.checkpoint_dir={work / 'sft'}",
                          f"logger.log_dir={work / 'sft' / 'logs'}", f"sft.max_num_steps={sft_steps}",
                          f"sft.val_period={sft_steps}", f"policy.precision={precision}", log=work / "sft.log")
    val_period = max(1, steps // 3)
    seconds["grpo"] = _nrl("train", "grpo", "--config", str(CONFIGS / "grpo_tiny_cpu_hf.yaml"),
                           f"policy.model_name={work / 'sft' / 'hf_export'}",
                           f"checkpointing.checkpoint_dir={work / 'grpo'}", f"logger.log_dir={work / 'grpo' / 'logs'}",
                           f"grpo.max_num_steps={steps}", f"grpo.val_period={val_period}",
                           f"checkpointing.save_period={steps}", f"policy.precision={precision}",
                           log=work / "grpo.log")
    rows = _metrics(work / "grpo" / "logs")
    val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    train = [r for r in rows if "train/reward" in r]
    window = min(WINDOW, max(1, len(train) // 2))
    first = sum(r["train/reward"] for r in train[:window]) / window
    last = sum(r["train/reward"] for r in train[-window:]) / window
    timing = sorted({k for r in train for k in r if k.startswith("timing/")})
    result: dict[str, Any] = {
        "steps": len(train), "window": window, "seconds": seconds, "val_accuracy": val, "train_reward_first": first,
        "train_reward_last": last, "train_reward": [r["train/reward"] for r in train],
        "mean_step_seconds": {k: sum(r.get(k, 0.0) for r in train[1:]) / max(1, len(train) - 1) for k in timing},
        "tokens_per_second": sum(r["throughput/tokens_per_second"] for r in train[1:]) / max(1, len(train) - 1),
    }
    result["checks"] = {"validation_accuracy_rises": len(val) >= 2 and val[-1][1] > val[0][1],
                        "training_reward_rises": last > first}
    result["ok"] = all(result["checks"].values())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default 60; 6 on a dry run)")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, float32, a few steps")
    parser.add_argument("--out", default=None, help="write the result as JSON here too")
    parser.add_argument("--workdir", default=None, help="keep the run's outputs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    steps = args.steps or (6 if args.dry_run else 60)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="nrl-grpo-check-") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        try:
            result = run(work, steps, args.dry_run)
        except Exception as exc:  # noqa: BLE001 - the failure is the result
            result = {"ok": False, "error": str(exc)[-6000:]}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if "error" in result:
        print(f"grpo: FAIL {result['error']}")
        return 1
    val = ", ".join(f"step {s}: {a:.3f}" for s, a in result["val_accuracy"])
    timing = ", ".join(f"{k.removeprefix('timing/')} {v:.2f}s" for k, v in result["mean_step_seconds"].items())
    print(f"grpo: {'ok' if result['ok'] else 'FAIL'} {result['steps']} steps; validation accuracy {val}; training "
          f"reward first {result['window']} steps {result['train_reward_first']:.3f}, last {result['window']} {result['train_reward_last']:.3f}; "
          f"{result['tokens_per_second']:.0f} tokens/s; per step {timing}; "
          f"seconds {', '.join(f'{k} {v:.0f}' for k, v in result['seconds'].items())}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
