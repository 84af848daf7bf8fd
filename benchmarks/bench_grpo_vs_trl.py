"""A GRPO step in nrl vs TRL's GRPOTrainer: same model, prompts and settings, alternating runs.

What runs (every setting is the same on both sides unless said):

* model: ``nrl tiny-model --size bench --seed 0`` (random-init Llama, 25.7M parameters, vocabulary
  512, the local arithmetic tokenizer and its chat template), float32;
* prompts: the demo's arithmetic task (``examples/configs/grpo_tiny_cpu.yaml``'s ``data.generate``:
  600 training problems ``What is a op b?``, operands 0..19, ``+``/``-``, seed 0) rendered with the
  tokenizer's chat template; nrl generates them itself from that config, TRL reads the same
  records from a JSONL file this script writes;
* per step 8 prompts x 4 generations, at most 64 new tokens, temperature 1, top_p 1, no top_k;
* reward 1.0 when the response's answer equals the expected one, else 0.0: nrl's ``math``
  environment (one Ray verifier worker), TRL a reward function calling the same check
  (``nrl_env_math.verify.verify_response``); rewards of an untrained model are mostly 0, which
  does not change the work done;
* loss: clipped policy gradient, clip 0.2, token-level mean (nrl ``token_level_loss``; TRL
  ``loss_type="dapo"``, its default), KL to the reference 0.01 (nrl
  ``loss_fn.reference_policy_kl_penalty``; TRL ``beta``), so both compute reference logprobs;
* one optimizer step per GRPO step: nrl ``train_global_batch_size`` 32; TRL
  ``per_device_train_batch_size`` 32, ``gradient_accumulation_steps`` 1, ``steps_per_generation``
  1, ``num_iterations`` 1;
* batching as each framework does it best on this machine: nrl packs the 32 sequences
  (``policy.sequence_packing``, rows of at most 1024 tokens for training, NeMo RL's
  ``max_total_sequence_length`` x micro-batch 8, and 4096 for logprobs, ``sequence_length_round``
  1: nothing is computed on padding, each sequence attends only to itself); TRL pads the batch to
  its longest sequence (its padding-free mode needs flash attention, which does not run on CPU) and
  recomputes activations in the backward (``gradient_checkpointing``, its default), so its memory
  holds one layer's activations where nrl's holds a row's: 1024-token rows keep nrl's training
  activations near 0.35 GB (2048-token rows: 0.7 GB) at the same step time;
* AdamW lr 3e-4, betas (0.9, 0.99), eps 1e-8, no weight decay, constant lr, grad-norm clip 1.0;
  seed 42;
* nrl: ``nrl train grpo`` on a config generated from the demo's (DTensor backend, one training
  worker, vLLM colocated with ``enforce_eager``, ``max_model_len`` and
  ``max_total_sequence_length`` 128, the vLLM KV cache at nrl's default size), no validation or
  checkpoints, ``OMP_NUM_THREADS=2`` (``--nrl-omp-threads``): the training actor computes on both
  cores, as TRL does (without it Ray gives each actor one thread; docs/platform.md);
* TRL 1.16.0 (its own venv, ``benchmarks/trl/make_venv.sh``; same torch and transformers as nrl):
  ``benchmarks/trl/run_trl.py``, HF ``generate`` (TRL's default, no vLLM), 2 torch threads
  (``--trl-threads``), ``use_cpu``.

Measured, per run (each a fresh process tree, ``--rounds`` rounds of nrl then TRL, ``--steps``
steps each):

* step time: the interval between consecutive step ends (nrl: the ``nrl_step_end`` hook, from
  ``benchmarks/bench_step_clock.py``; TRL: a ``TrainerCallback.on_step_end``); steady state is the
  median over steps 3..S of every round; per generated token: each step's time divided by the
  tokens generated in it (nrl: the step's ``train_data_step<N>.jsonl``, TRL: its logged
  ``completions/mean_length`` x 32);
* time to the first step: from just before the subprocess is started to the first step's end;
* peak memory of the process tree: the sum of PSS over the run's process and all its
  descendants (Ray's processes and workers, vLLM), sampled every second with psutil
  (``benchmarks/process_tree_sampler.py``; the sum of USS is given too; RSS would count shared
  pages once per process); the sampler's own CPU time is reported (``sampler_cpu_s``);
* nrl's phases: ``timing/*`` of ``metrics.jsonl`` (medians over the steady steps); for the
  training-side phases (logprobs, training) the FLOP/s as a fraction of ``torch.mm``'s FLOP/s
  measured in this run, after every run (the best of them), at the MLP's shape (tokens of a step x
  hidden @ hidden x intermediate) with as many threads as the phase kept busy in the training actor (threads with at
  least half the CPU time of its busiest thread over the phase, from the same sampler; 1 or 2). FLOPs count the weight
  matmuls only (N = the non-embedding weights incl. the LM head, 25.4M of 25.7M): forward 2*N per
  real token (prompt + response), forward+backward 6*N; logprobs runs the reference's forward and,
  unless nrl takes the previous-policy logprobs from the training forward (it logs which; with one
  optimizer step per GRPO step it does), the previous policy's (2*N or 2 x 2*N;
  ``--logprobs-forwards`` overrides), training one forward+backward (6*N). Attention's L^2 terms are left out (under
  3% at about 80 tokens per sequence).

    python benchmarks/bench_grpo_vs_trl.py [--rounds 2] [--steps 8] [--trl-python benchmarks/.venv-trl/bin/python]
        [--nrl-override KEY=VALUE ...] [--keep]

Prints a table and one JSON line. Run it under ``nice`` only if everything else is too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
DEMO = REPO / "examples" / "configs" / "grpo_tiny_cpu.yaml"
sys.path.insert(0, str(REPO))
from benchmarks.process_tree_sampler import TreeSampler, busy_threads  # noqa: E402

PROMPTS_PER_STEP, GENERATIONS, MAX_NEW_TOKENS, MAX_LEN = 8, 4, 64, 128
KL, LR, SEED = 0.01, 3e-4, 42
PACKED_TRAIN_TOKENS, PACKED_LOGPROB_TOKENS = 1024, 4096
TRAINING_SIDE = ("logprobs", "training")


def nrl_config(model: Path, steps: int, log_dir: Path) -> dict[str, Any]:
    """The demo's config with the benchmark's settings (see the module docstring)."""
    cfg = yaml.safe_load(DEMO.read_text())
    cfg["grpo"].update(num_prompts_per_step=PROMPTS_PER_STEP, num_generations_per_prompt=GENERATIONS,
                       max_num_steps=steps, val_period=0, val_at_start=False, val_at_end=False, seed=SEED)
    cfg["loss_fn"]["reference_policy_kl_penalty"] = KL
    batch = PROMPTS_PER_STEP * GENERATIONS
    cfg["policy"].update(model_name=str(model), train_global_batch_size=batch, train_micro_batch_size=batch,
                         logprob_batch_size=batch, max_total_sequence_length=MAX_LEN)
    cfg["policy"]["sequence_packing"] = {"enabled": True, "train_mb_tokens": PACKED_TRAIN_TOKENS,
                                         "logprob_mb_tokens": PACKED_LOGPROB_TOKENS, "sequence_length_round": 1}
    cfg["policy"]["optimizer"]["kwargs"]["lr"] = LR
    gen = cfg["policy"]["generation"]
    gen.update(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=None)
    gen["vllm_cfg"] = {"max_model_len": MAX_LEN, "enforce_eager": True}  # KV cache: nrl's default size
    cfg["checkpointing"]["enabled"] = False
    cfg["logger"] = {"log_dir": str(log_dir), "tensorboard_enabled": False, "plot": False}
    return cfg


def write_prompts(path: Path) -> None:
    """The demo's training problems as JSONL for TRL (nrl generates the same records from its config)."""
    from nrl_core.data.arithmetic import ArithmeticConfig, generate_arithmetic

    gen = yaml.safe_load(DEMO.read_text())["data"]["generate"]
    train, _ = generate_arithmetic(ArithmeticConfig(**{**gen, "ops": tuple(gen["ops"])}))
    path.write_text("".join(json.dumps(r) + "\n" for r in train))


def matmul_weights(model: Path) -> int:
    """Weights that enter a matmul per token: every linear layer and the LM head (tied or not)."""
    c = json.loads((model / "config.json").read_text())
    h, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = c.get("num_key_value_heads", c["num_attention_heads"]) * c.get("head_dim", h // c["num_attention_heads"])
    return layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + h * vocab


def mm_flops(m: int, k: int, n: int, threads: int, repeats: int = 5) -> float:
    """Best-of-``repeats`` float32 ``torch.mm`` FLOP/s at (m x k) @ (k x n) on ``threads`` threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        return 2.0 * m * k * n / best
    finally:
        torch.set_num_threads(before)


def run_tree(cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> tuple[float, TreeSampler]:
    """Run ``cmd`` to completion while sampling its process tree; the unix time just before it started."""
    with log.open("w") as out:
        t0 = time.time()
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        with TreeSampler(proc.pid) as sampler:
            rc = proc.wait()
    if rc != 0:
        raise SystemExit(f"{cmd[0]} ... exited {rc}; its output: {log}")
    return t0, sampler


def tree_figures(t0: float, first_step_end: float, sampler: TreeSampler) -> dict[str, Any]:
    """What every run reports of its process tree: time to the first step's end, peak memory, the
    sampler's own CPU time."""
    return {"first_step_s": first_step_end - t0, "peak_pss": sampler.peak("pss"), "peak_uss": sampler.peak("uss"),
            "peak_processes": sampler.peak("processes"), "sampler_cpu_s": sampler.cpu_s}


def run_nrl(model: Path, steps: int, work: Path, omp: int, overrides: list[str]) -> dict[str, Any]:
    log_dir = work / "logs"
    config = work / "grpo_vs_trl.yaml"
    config.write_text(yaml.safe_dump(nrl_config(model, steps, log_dir), sort_keys=False))
    env = {**os.environ, "OMP_NUM_THREADS": str(omp), "TOKENIZERS_PARALLELISM": "false",
           "VLLM_LOGGING_LEVEL": "WARNING", "NRL_PLUGINS": "bench_step_clock",
           "PYTHONPATH": os.pathsep.join(p for p in (str(BENCH), os.environ.get("PYTHONPATH", "")) if p)}
    t0, sampler = run_tree([sys.executable, "-m", "nrl_core.cli", "train", "grpo", "--config", str(config),
                            *overrides],
                           env, work, work / "nrl.log")
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "bench/step_end_unix" in r]
    ends = [r["bench/step_end_unix"] for r in rows]
    steps_out = []
    for i, r in enumerate(rows):
        timing = {k[len("timing/"):]: v for k, v in r.items() if k.startswith("timing/")}
        start = ends[i - 1] if i else r["bench/run_start_unix"]
        rollouts = [json.loads(line) for line in (log_dir / f"train_data_step{r['step']}.jsonl").read_text().splitlines()]
        generated = sum(len(x["response_token_ids"]) for x in rollouts)
        tokens = generated + sum(len(x["prompt_token_ids"]) for x in rollouts)
        threads = {}
        side = [p for p in TRAINING_SIDE if p in timing]
        for phase in side:  # phases run back to back, training last, just before the step's end
            after = sum(timing[p] for p in side[side.index(phase) + 1:])
            hi = ends[i] - after
            threads[phase] = busy_threads(sampler.samples, hi - timing[phase] + 0.1, hi - 0.1)
        steps_out.append({"step_s": ends[i] - start, "generated_tokens": generated,
                          "tokens": tokens, "timing": timing, "threads": threads, "reward": r["train/reward"]})
    # nrl logs whether the training forward gives the previous-policy logprobs (then the logprobs
    # phase runs the reference forward only); an nrl that does not say runs both there.
    prev_from_training = "previous-policy logprobs: from the training forward" in (work / "nrl.log").read_text()
    return {**tree_figures(t0, ends[0], sampler), "logprobs_forwards": 1 if prev_from_training else 2,
            "steps": steps_out}


def run_trl(python: str, model: Path, prompts: Path, steps: int, work: Path, threads: int) -> dict[str, Any]:
    out = work / "trl.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    cmd = [python, str(BENCH / "trl" / "run_trl.py"), "--model", str(model), "--prompts", str(prompts),
           "--out", str(out), "--steps", str(steps), "--prompts-per-step", str(PROMPTS_PER_STEP),
           "--generations", str(GENERATIONS), "--max-new-tokens", str(MAX_NEW_TOKENS), "--beta", str(KL),
           "--lr", str(LR), "--threads", str(threads), "--seed", str(SEED)]
    t0, sampler = run_tree(cmd, env, work, work / "trl.log")
    res = json.loads(out.read_text())
    ends = res["step_end_unix"]
    starts = [res["train_begin_unix"], *ends[:-1]]
    return {**tree_figures(t0, ends[0], sampler),
            "steps": [{"step_s": e - s, "generated_tokens": g, "reward": r}
                      for e, s, g, r in zip(ends, starts, res["completion_tokens"], res["reward"])]}


def steady(runs: list[dict[str, Any]], first: int) -> list[dict[str, Any]]:
    """Steps ``first``.. (1-based) of every run."""
    return [s for run in runs for s in run["steps"][first - 1:]]


def summarize(runs: list[dict[str, Any]], first: int) -> dict[str, float]:
    st = steady(runs, first)
    return {"step_s": statistics.median(s["step_s"] for s in st),
            "s_per_generated_token": statistics.median(s["step_s"] / s["generated_tokens"] for s in st),
            "generated_tokens_per_step": statistics.median(s["generated_tokens"] for s in st),
            "first_step_s": statistics.median(r["first_step_s"] for r in runs),
            "peak_pss_gb": statistics.median(r["peak_pss"] for r in runs) / 1e9,
            "peak_uss_gb": statistics.median(r["peak_uss"] for r in runs) / 1e9}


def phase_table(runs: list[dict[str, Any]], first: int, weights: int, mm: dict[int, float],
                forwards: dict[str, int], omp_threads: int) -> dict[str, dict[str, float]]:
    """Median seconds of each nrl phase; for the training side, FLOP/s and its fraction of torch.mm's
    (``mm``: the best FLOP/s per thread count). A phase too short for the sampler to see its threads
    is compared with torch.mm on the threads nrl was given (``omp_threads``), and says so."""
    st = steady(runs, first)
    out: dict[str, dict[str, float]] = {}
    for phase in st[0]["timing"]:
        row: dict[str, float] = {"s": statistics.median(s["timing"][phase] for s in st)}
        if phase in forwards:
            flops = statistics.median(forwards[phase] * weights * s["tokens"] / s["timing"][phase] for s in st)
            busy = [s["threads"][phase]["busy_threads"] for s in st if s["threads"].get(phase)]
            threads = max(1, min(2, round(statistics.median(busy)) if busy else omp_threads))
            cores = [s["threads"][phase]["cores"] for s in st if s["threads"].get(phase)]
            roof = mm[threads]
            row.update(gflops=flops / 1e9, threads=threads, threads_measured_steps=len(busy),
                       cores=statistics.median(cores) if cores else 0.0,
                       mm_gflops=roof / 1e9, fraction_of_mm=flops / roof)
        out[phase] = row
    return out


def phase_lines(phases: dict[str, dict[str, float]]) -> list[str]:
    """The phase table's lines: seconds, and for the training side FLOP/s against torch.mm."""
    lines = []
    for phase, row in phases.items():
        extra = ""
        if "gflops" in row:
            busy = (f"({row['cores']:.2f} cores busy)" if row["threads_measured_steps"]
                    else "(not measured: phase shorter than the sampling; the OMP_NUM_THREADS given)")
            extra = (f"  {row['gflops']:.1f} GFLOP/s on {row['threads']} thread(s) {busy}, "
                     f"torch.mm {row['mm_gflops']:.1f}: {100 * row['fraction_of_mm']:.0f}%")
        lines.append(f"  {phase:12s}{row['s']:8.3f}{extra}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternating (nrl, TRL) pairs")
    parser.add_argument("--steps", type=int, default=8, help="steps per run; steady state = steps 3..S")
    parser.add_argument("--first-steady", type=int, default=3)
    parser.add_argument("--trl-python", default=str(BENCH / ".venv-trl" / "bin" / "python"))
    parser.add_argument("--trl-threads", type=int, default=2)
    parser.add_argument("--nrl-omp-threads", type=int, default=2, help="OMP_NUM_THREADS for nrl's run")
    parser.add_argument("--nrl-override", action="append", default=[], metavar="KEY=VALUE",
                        help="an override appended to nrl's command line (repeatable), e.g. to try a setting")
    parser.add_argument("--logprobs-forwards", type=int, default=None,
                        help="forward passes in nrl's logprobs phase: 2 = previous-policy + reference, 1 = reference "
                             "only; default: from the run's log (nrl says where its previous-policy logprobs come "
                             "from), else 2")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, configs)")
    args = parser.parse_args()
    if args.steps < args.first_steady:
        raise SystemExit(f"--steps {args.steps}: needs at least --first-steady ({args.first_steady}) steps")
    if not Path(args.trl_python).exists():
        raise SystemExit(f"--trl-python {args.trl_python} not found; create TRL's venv with benchmarks/trl/make_venv.sh")
    args.trl_python = os.path.abspath(args.trl_python)  # the runs start in a work directory; not resolve(): a venv's python is a link
    work = Path(tempfile.mkdtemp(prefix="nrl-bench-trl-"))
    model, prompts = work / "model", work / "prompts.jsonl"
    subprocess.run([sys.executable, "-m", "nrl_core.cli", "tiny-model", str(model), "--size", "bench", "--seed", "0"],
                   check=True, capture_output=True)
    write_prompts(prompts)
    cfg = json.loads((model / "config.json").read_text())
    hidden, inter, weights = cfg["hidden_size"], cfg["intermediate_size"], matmul_weights(model)
    results: dict[str, list[dict[str, Any]]] = {"nrl": [], "trl": []}
    mm: dict[int, float] = {}
    mm_shape: tuple[int, int, int] | None = None
    for r in range(args.rounds):
        for name in ("nrl", "trl"):
            run_dir = work / f"{name}-{r}"
            run_dir.mkdir()
            if name == "nrl":
                res = run_nrl(model, args.steps, run_dir, args.nrl_omp_threads, args.nrl_override)
            else:
                res = run_trl(args.trl_python, model, prompts, args.steps, run_dir, args.trl_threads)
            results[name].append(res)
            if not mm_shape:  # the MLP's matmul over a steady step's tokens
                mm_shape = (round(statistics.median(s["tokens"] for s in steady([res], args.first_steady))), hidden, inter)
            for threads in (1, 2):  # between runs, so nothing else of ours runs; the best of all
                mm[threads] = max(mm.get(threads, 0.0), mm_flops(*mm_shape, threads))
            print(f"round {r} {name}: steps " + " ".join(f"{s['step_s']:.2f}" for s in res["steps"])
                  + f" s; first step {res['first_step_s']:.1f} s; peak PSS {res['peak_pss'] / 1e9:.2f} GB over "
                  f"{res['peak_processes']} processes (sampler CPU {res['sampler_cpu_s']:.1f} s)", flush=True)
    summary = {name: summarize(runs, args.first_steady) for name, runs in results.items()}
    ratio = {k: summary["nrl"][k] / summary["trl"][k] for k in summary["nrl"]}
    logprobs_forwards = args.logprobs_forwards or max(run["logprobs_forwards"] for run in results["nrl"])
    forwards = {"logprobs": 2 * logprobs_forwards, "training": 6}  # FLOPs per weight per token
    phases = phase_table(results["nrl"], args.first_steady, weights, mm, forwards, args.nrl_omp_threads)
    print(f"\n{'':28s}{'nrl':>10s}{'TRL':>10s}{'nrl/TRL':>9s}")
    for key, label, scale in (("step_s", "steady step, s", 1), ("s_per_generated_token", "per generated token, ms", 1e3),
                              ("generated_tokens_per_step", "generated tokens / step", 1),
                              ("first_step_s", "start -> first step end, s", 1), ("peak_pss_gb", "peak tree PSS, GB", 1),
                              ("peak_uss_gb", "peak tree USS, GB", 1)):
        print(f"{label:28s}{summary['nrl'][key] * scale:10.3f}{summary['trl'][key] * scale:10.3f}{ratio[key]:9.2f}")
    print(f"\nnrl phases (median s; training side: GFLOP/s, busy threads, of torch.mm at those threads; "
          f"logprobs = {logprobs_forwards} forward pass(es))")
    print("\n".join(phase_lines(phases)))
    print(json.dumps({"bench": "grpo_vs_trl", "rounds": args.rounds, "steps": args.steps,
                      "first_steady": args.first_steady, "matmul_weights": weights,
                      "logprobs_forwards": logprobs_forwards, "nrl_overrides": args.nrl_override, "nrl": summary["nrl"],
                      "trl": summary["trl"], "nrl_over_trl": ratio, "nrl_phases": phases,
                      "mm_shape": mm_shape, "mm_gflops": {threads: v / 1e9 for threads, v in mm.items()},
                      "runs": results}))
    if args.keep:
        print(f"work directory: {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
