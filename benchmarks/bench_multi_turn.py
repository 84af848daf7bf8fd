"""Multi-turn rollout throughput: every live episode's next turn in one generate call (nrl's
``MultiTurnSampler``) against a naive loop that plays the same episodes one at a time, in the same
process, on nrl's vLLM generation worker.

    python benchmarks/bench_multi_turn.py [--episodes 64] [--turns 4] [--new-tokens 16] [--repeats 3]

The environment answers every turn with a short follow-up and ends no episode, so both ways play
exactly ``episodes x turns`` turns; the ratio is turns/s batched over turns/s one at a time. Runs
alternate; each figure is the best of ``--repeats`` after a warm-up. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


class FollowUps:
    """Continues every episode with ``\\nQ: And again?\\nA:``; never ends one."""

    def step(self, episodes: list[Any]) -> list[Any]:
        from nrl_core.contracts import EnvStep

        return [EnvStep(observation="\nQ: And again?\nA:") for _ in episodes]

    def shutdown(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size", default="small")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from nrl_core.algorithms.grpo_config import GRPO
    from nrl_core.algorithms.multi_turn import MultiTurnSampler
    from nrl_core.algorithms.scoring import Scorer
    from nrl_core.data import DatumSpec
    from nrl_core.testing.tiny_models import cached_tiny_model
    from nrl_gen_vllm.worker import VllmGenerationWorker

    model = cached_tiny_model("llama", args.size)
    length = 64 + args.turns * (args.new_tokens + 16)
    config = {
        "grpo": {**GRPO.validate({}, "grpo"), "num_generations_per_prompt": 1, "max_rollout_turns": args.turns},
        "policy": {"model_name": str(model), "seed": 42, "precision": "float32", "max_total_sequence_length": length,
                   "generation": {"backend": "vllm", "max_new_tokens": args.new_tokens, "temperature": 1.0,
                                  "top_p": 1.0, "top_k": None, "stop_token_ids": None, "stop_strings": None,
                                  "vllm_cfg": {"enforce_eager": True, "kv_cache_space_gb": 1.0, "max_model_len": length}}},
    }
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    engine = VllmGenerationWorker(config)
    env = FollowUps()
    sampler = MultiTurnSampler(config, engine, Scorer(config, tokenizer, env), tokenizer, env, max_length=length)
    prompts = [DatumSpec(idx=i, prompt_text=f"Q: What is {i} + {i % 7}?\nA:",
                         prompt_ids=tokenizer(f"Q: What is {i} + {i % 7}?\nA:").input_ids) for i in range(args.episodes)]

    def batched() -> int:
        return sum(e.turns for e in sampler.play(prompts))

    def one_at_a_time() -> int:
        return sum(e.turns for p in prompts for e in sampler.play([p]))

    ways = {"batched": batched, "one_at_a_time": one_at_a_time}
    for fn in ways.values():
        fn()  # warm-up
    best = {name: float("inf") for name in ways}
    turns = {}
    for _ in range(args.repeats):
        for name, fn in ways.items():
            start = time.perf_counter()
            turns[name] = fn()
            best[name] = min(best[name], time.perf_counter() - start)
    engine.shutdown()
    rate = {name: turns[name] / best[name] for name in ways}
    print(f"{'way':<16}{'turns':>8}{'best s':>10}{'turns/s':>10}")
    for name in ways:
        print(f"{name:<16}{turns[name]:>8}{best[name]:>10.2f}{rate[name]:>10.1f}")
    print(f"batched / one at a time: {rate['batched'] / rate['one_at_a_time']:.1f}x")
    print(json.dumps({"bench": "multi_turn", "episodes": args.episodes, "turns": args.turns,
                      "new_tokens": args.new_tokens, "seconds": best, "turns_per_s": rate,
                      "ratio": rate["batched"] / rate["one_at_a_time"]}))


if __name__ == "__main__":
    main()
