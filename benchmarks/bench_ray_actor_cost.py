"""What hosting the GRPO step in a Ray actor costs: the same step in a plain process vs in an actor.

Run:  OMP_NUM_THREADS=2 python benchmarks/bench_ray_actor_cost.py [--pairs 2] [--steps 5]

Why: on 2 cores nrl's GRPO step (bench_grpo_vs_trl.py) is slower, phase by phase, than the same
work timed in one process. This runs that work both ways and reports the ratio per phase, so the
cost of Ray's hosting is measured rather than guessed. The work is the GRPO benchmark's: the
25.7M-parameter ``bench`` Llama, a DTensor worker (one rank, float32) beside a colocated vLLM
engine; each step generates 4 samples of 8 prompts (at most 64 new tokens, temperature 1), packs
the 32 sequences (1024-token training rows, 4096-token logprob rows), runs the reference pass and
one optimizer step of the clipped loss with a KL penalty. ``process`` runs it in a fresh Python
process with no Ray; ``actor`` in an actor of nrl's private Ray (``init_ray``, the environment the
policy's workers get), the driver waiting as ``nrl train``'s does. Modes alternate, a fresh
process tree each, so the machine's drift hits both alike; figures are medians over steps
2..N of every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS, GENERATIONS, NEW_TOKENS, KL = 8, 4, 64, 0.01
PHASES = ("generation", "logprobs", "training")


def grpo_work(steps: int) -> dict[str, list[float]]:
    """``steps`` GRPO steps' engine work in this process; seconds per phase and step."""
    import torch
    from bench_dtensor_one_rank_fsdp import worker_config

    from nrl_backend_dtensor.worker import DTensorPolicyWorker
    from nrl_core.algorithms.loss import ClippedPGLoss
    from nrl_core.algorithms.rollouts import rollout_batch
    from nrl_core.testing.tiny_models import cached_tiny_model
    from nrl_gen_vllm.worker import VllmGenerationWorker

    config = worker_config(str(cached_tiny_model("llama", size="bench")), PROMPTS * GENERATIONS)
    config["policy"].update(max_total_sequence_length=128, generation={
        "max_new_tokens": NEW_TOKENS, "temperature": 1.0, "top_p": 1.0, "top_k": None, "colocated": {"enabled": True},
        "vllm_cfg": {"load_format": "auto", "max_model_len": 128, "enforce_eager": True}})
    config["grpo"] = {"num_prompts_per_step": PROMPTS, "num_generations_per_prompt": GENERATIONS}
    trainer = DTensorPolicyWorker(config, 0, 1)
    engine = VllmGenerationWorker(config)
    loss = ClippedPGLoss(reference_policy_kl_penalty=KL, force_on_policy_ratio=True)
    prompts = [[5 + p % 7, 6, 7 + p % 5, 8, 9, 10, 11, 12, 13, 14 + p] for p in range(PROMPTS) for _ in range(GENERATIONS)]
    advantages = torch.randn(len(prompts), 1, generator=torch.Generator().manual_seed(0))
    seconds: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for _ in range(steps):
        start = time.perf_counter()
        out = engine.generate(prompts)
        seconds["generation"].append(time.perf_counter() - start)
        batch = rollout_batch(prompts, out, pad_token_id=0)
        batch.fields.update(advantages=advantages * batch.fields["token_mask"], sample_mask=torch.ones(len(prompts)))
        start = time.perf_counter()
        batch.fields["reference_logprobs"] = trainer.get_reference_logprobs(batch).values
        seconds["logprobs"].append(time.perf_counter() - start)
        start = time.perf_counter()
        trainer.train(batch, loss)
        seconds["training"].append(time.perf_counter() - start)
    return seconds


def run_in_actor(steps: int) -> dict[str, list[float]]:
    import ray

    from nrl_core.cluster.ray_cluster import actor_runtime_env, init_ray, shutdown_ray, worker_env_vars

    init_ray({})
    try:
        @ray.remote
        class Host:
            def work(self, steps: int) -> dict[str, list[float]]:
                sys.path.insert(0, str(Path(__file__).parent))
                from bench_ray_actor_cost import grpo_work
                return grpo_work(steps)

        host = Host.options(num_cpus=0, runtime_env=actor_runtime_env(worker_env_vars())).remote()
        return ray.get(host.work.remote(steps))
    finally:
        shutdown_ray()


def one_run(mode: str, steps: int) -> dict[str, list[float]]:
    """A fresh process tree running the work in ``mode``; its per-step seconds."""
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(steps)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--child", choices=("process", "actor"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        seconds = grpo_work(args.steps) if args.child == "process" else run_in_actor(args.steps)
        print(json.dumps(seconds))
        return

    runs: dict[str, list[dict[str, list[float]]]] = {"process": [], "actor": []}
    for pair in range(args.pairs):
        for mode in ("process", "actor") if pair % 2 == 0 else ("actor", "process"):
            runs[mode].append(one_run(mode, args.steps))
            print(f"pair {pair} {mode}: " + ", ".join(
                f"{p} {statistics.median(runs[mode][-1][p][1:]):.3f}" for p in PHASES), flush=True)
    medians = {mode: {p: statistics.median(s for run in rs for s in run[p][1:]) for p in PHASES}
               for mode, rs in runs.items()}
    print(f"\n{'median s, steps 2..':24s}{'process':>10s}{'actor':>10s}{'actor/process':>15s}")
    for p in (*PHASES, "sum"):
        a = sum(medians["process"].values()) if p == "sum" else medians["process"][p]
        b = sum(medians["actor"].values()) if p == "sum" else medians["actor"][p]
        print(f"{p:24s}{a:10.3f}{b:10.3f}{b / a:15.3f}")
    print(json.dumps({"bench": "ray_actor_cost", "pairs": args.pairs, "steps": args.steps, "medians": medians}))


if __name__ == "__main__":
    main()
