"""Async vs sync GRPO on the same non-colocated config: throughput against its bound, and convergence.

1. Throughput: ``examples/configs/grpo_tiny_cpu_async.yaml`` (one training worker, one vLLM async
   engine, the demo's 16 prompts x 16 responses per step), synchronous (``async_grpo.enabled``
   false) and asynchronous (``max_trajectory_age_steps`` 1), ``--steps`` steps each, alternating
   ``--runs`` times. Trajectories/s = rollouts per step / the median step time after the first
   step. The bound on the async speedup comes from the sync run's own phase timings: generation
   (with scoring) and training (logprobs, optimizer step, refit) can at best overlap completely,
   so async can be at most ``(generation + training) / max(generation, training)`` times faster.
   ``--in-flight`` adds a third mode, asynchronous with ``in_flight_weight_updates`` (the refit
   lands in the requests in flight instead of waiting for the step streaming), on responses of up
   to 128 tokens so that generation is the longer role, as in LLM RL; it reports the share of
   responses that carry two weight versions and ``train/token_mult_prob_error`` for each mode.
2. Convergence (``--convergence``): the demo task from the SFT-warm-started model (as
   scripts/demo.sh builds it), ``--conv-steps`` GRPO steps sync and async with the same seed,
   greedy validation accuracy every 25 steps; both curves in one PNG.

    python benchmarks/bench_async_grpo.py [--steps 8] [--runs 2] [--in-flight] [--convergence] [--conv-steps 150]

Prints a table and one JSON line (and the PNG's path).
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

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "configs" / "grpo_tiny_cpu_async.yaml"
GENERATION = ("generation", "reward", "hand_off")  # what the collector does in the async run
TRAINING = ("logprobs", "training", "refit")


def train(model: Path, tmp: Path, *overrides: str) -> list[dict]:
    cmd = [sys.executable, "-m", "nrl_core.cli", "train", "grpo", "--config", str(CONFIG), f"policy.model_name={model}",
           f"logger.log_dir={tmp}/logs", "logger.plot=false", "logger.tensorboard_enabled=false",
           f"checkpointing.checkpoint_dir={tmp}/ckpt", *overrides]
    subprocess.run(cmd, check=True, cwd=tmp, capture_output=True, env={**os.environ, "NRL_STRICT_PLUGINS": "1"})
    return [json.loads(line) for line in Path(tmp, "logs", "metrics.jsonl").read_text().splitlines()]


MODES = {"sync": ["grpo.async_grpo.enabled=false"], "async": ["grpo.async_grpo.enabled=true"],
         "in_flight": ["grpo.async_grpo.enabled=true", "grpo.async_grpo.in_flight_weight_updates=true"]}
LONG_RESPONSES = ["policy.max_total_sequence_length=192", "policy.generation.vllm_cfg.max_model_len=192",
                  "policy.generation.max_new_tokens=128"]


def throughput(model: Path, steps: int, runs: int, in_flight: bool = False) -> dict[str, float]:
    common = [f"grpo.max_num_steps={steps}", "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
              "checkpointing.enabled=false", *(LONG_RESPONSES if in_flight else [])]
    modes = ("sync", "async", "in_flight") if in_flight else ("sync", "async")
    step_s: dict[str, list[float]] = {mode: [] for mode in modes}
    seen: dict[str, dict[str, list[float]]] = {mode: {} for mode in modes}
    phases: dict[str, list[float]] = {"generation": [], "training": []}
    rollouts = 0
    for _ in range(runs):
        for mode in modes:
            with tempfile.TemporaryDirectory(prefix=f"nrl-bench-{mode}-") as tmp:
                rows = train(model, Path(tmp), *common, *MODES[mode])
            for row in rows[1:]:  # the first step pays for start-up
                timing = {k[len("timing/"):]: v for k, v in row.items() if k.startswith("timing/")}
                step_s[mode].append(sum(timing.values()))
                for key in ("train/token_mult_prob_error", "async/in_flight_mixed_fraction"):
                    if key in row:
                        seen[mode].setdefault(key, []).append(row[key])
                if mode == "sync":
                    phases["generation"].append(sum(timing.get(p, 0.0) for p in GENERATION))
                    phases["training"].append(sum(timing.get(p, 0.0) for p in TRAINING))
            rollouts = int(rows[-1]["env/num_samples"])  # a total in both modes (EnvResult.counts)
    gen, trn = statistics.median(phases["generation"]), statistics.median(phases["training"])
    bound = (gen + trn) / max(gen, trn)
    result: dict[str, float] = {"rollouts_per_step": rollouts, "sync_generation_s": gen, "sync_training_s": trn,
                                "bound": bound}
    for mode in modes:
        median = statistics.median(step_s[mode])
        result.update({f"{mode}_step_s": median, f"{mode}_trajectories_per_s": rollouts / median,
                       f"{mode}_speedup": statistics.median(step_s["sync"]) / median})
        result[f"{mode}_fraction_of_bound"] = result[f"{mode}_speedup"] / bound
        for key, values in seen[mode].items():
            result[f"{mode}:{key}"] = statistics.mean(values)
    result["speedup"], result["fraction_of_bound"] = result["async_speedup"], result["async_fraction_of_bound"]
    return result


def convergence(steps: int, out: Path) -> dict[str, list[list[float]]]:
    """SFT as in scripts/demo.sh, then sync and async GRPO from it; validation curves and the PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    work = Path(tempfile.mkdtemp(prefix="nrl-bench-conv-"))
    subprocess.run([sys.executable, "-m", "nrl_core.cli", "tiny-model", str(work / "base"), "--family", "llama",
                    "--size", "small", "--seed", "0"], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "nrl_core.cli", "train", "sft", "--config",
                    str(REPO / "examples" / "configs" / "sft_tiny_cpu.yaml"), f"policy.model_name={work / 'base'}",
                    f"checkpointing.checkpoint_dir={work / 'sft'}", f"logger.log_dir={work / 'sft' / 'logs'}"],
                   check=True, cwd=work, capture_output=True, env={**os.environ, "NRL_STRICT_PLUGINS": "1"})
    curves = {}
    for mode in ("sync", "async"):
        (work / mode).mkdir()
        rows = train(work / "sft" / "hf_export", work / mode, f"grpo.max_num_steps={steps}",
                     f"grpo.async_grpo.enabled={mode == 'async'}", "checkpointing.enabled=false")
        curves[mode] = [[r["step"], r["val/accuracy"]] for r in rows if "val/accuracy" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, points in curves.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                label=f"{mode} ({'max_trajectory_age_steps 1' if mode == 'async' else 'on-policy'})")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("validation accuracy (greedy)")
    ax.set_title("Demo task: sync vs async GRPO, same seed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    return curves


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--in-flight", action="store_true")
    parser.add_argument("--convergence", action="store_true")
    parser.add_argument("--conv-steps", type=int, default=150)
    parser.add_argument("--png", default=str(REPO / "docs" / "async_grpo_convergence.png"))
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from nrl_core.testing.tiny_models import cached_tiny_model

    result: dict = throughput(cached_tiny_model("llama", size="small"), args.steps, args.runs, args.in_flight)
    print(f"bound from the sync run's phases (generation {result['sync_generation_s']:.2f} s, training "
          f"{result['sync_training_s']:.2f} s): {result['bound']:.2f}x")
    for mode in ("sync", "async", "in_flight"):
        if f"{mode}_step_s" in result:
            print(f"{mode:>9}: step {result[f'{mode}_step_s']:.2f} s, {result[f'{mode}_trajectories_per_s']:.1f} "
                  f"trajectories/s, {result[f'{mode}_speedup']:.2f}x sync, {100 * result[f'{mode}_fraction_of_bound']:.0f}% "
                  f"of the bound; token_mult_prob_error {result.get(f'{mode}:train/token_mult_prob_error', 0):.3f}"
                  + (f", responses with two versions {result[f'{mode}:async/in_flight_mixed_fraction']:.2f}"
                     if f"{mode}:async/in_flight_mixed_fraction" in result else ""))
    if args.convergence:
        result["convergence"] = convergence(args.conv_steps, Path(args.png))
        for mode, points in result["convergence"].items():
            print(f"{mode:>5} validation accuracy: " + ", ".join(f"{int(s)}: {a:.3f}" for s, a in points))
        print(f"plot: {args.png}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
