"""What a stale KV cache costs after an in-flight weight update, and what the update itself costs.

The setup of ``tests/e2e/test_async_grpo.py``'s in-flight test: one DTensor training worker, one
vLLM async engine of its own, four chat prompts x 2 samples of up to 160 tokens at temperature 0.7.
The policy trains one step (version 1) while the engine holds version 0; once a first group is back
the refit lands in the requests in flight. For each token sampled under version 1, the engine's
logprob is compared with the policy's at version 1 on the whole sequence: with
``recompute_kv_cache_after_weight_updates`` the requests recompute their KV cache with the new
weights, so the two agree; without it (NeMo RL's default) the tokens before the update keep the
KV cache version 0 computed, and the difference is the staleness the importance weights then
carry. Also timed: the refit in flight against the same refit into an idle engine.

    python benchmarks/bench_in_flight_kv.py [--repeats 3]

Prints one line per mode and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
REPO = Path(__file__).resolve().parents[1]
OVERRIDES = ["policy.generation.colocated.enabled=false", "policy.generation.colocated.resources.gpus_per_node=1",
             "cluster.gpus_per_node=2", "policy.generation.vllm_cfg.async_engine=true",
             "policy.optimizer.kwargs.lr=5e-3", "policy.generation.temperature=0.7",
             "policy.max_total_sequence_length=256", "policy.generation.vllm_cfg.max_model_len=256",
             "policy.generation.max_new_tokens=160", "grpo.async_grpo.enabled=true",
             "grpo.async_grpo.in_flight_weight_updates=true", "loss_fn.use_importance_sampling_correction=true"]


def one_mode(model: Path, recompute: bool, repeats: int) -> dict[str, float]:
    import torch

    from nrl_core.algorithms.grpo import RolloutGroup, merge_groups
    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.algorithms.rollouts import rollout_batch
    from tests.e2e.facades import chat_prompts, policy_and_generation, training_batch

    gaps, in_flight_s, idle_s, mixed = [], [], [], []
    with policy_and_generation(model, OVERRIDES) as (_, policy, generation):
        generation.configure_in_flight(recompute_kv_cache=recompute)
        prompts = chat_prompts(model) + [[5 + i % 400 for i in range(254)]]  # the last has room for 2 tokens
        for repeat in range(repeats):
            policy.train(training_batch(repeat), NLLLoss())
            generation.mark_stale()
            stream = generation.generate_groups(prompts, 2)
            groups = [next(stream)]
            report = generation.prepare(in_flight=True)
            in_flight_s.append(report.seconds)
            groups += list(stream)
            groups = sorted(groups)[:4]
            rollouts = merge_groups([RolloutGroup(prompt=None, output=o, rewards=[0.0, 0.0]) for _, o in groups])
            versions = [rollouts.versions_of(i) for i in range(8)]
            mixed.append(sum(len(set(v)) > 1 for v in versions) / 8)
            repeated = [p for p in prompts[:4] for _ in range(2)]
            batch = rollout_batch(repeated, rollouts, pad_token_id=3)
            new = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
            for i, (prompt, v) in enumerate(zip(repeated, versions)):
                new[i, len(prompt):len(prompt) + len(v)] = torch.tensor(v) == report.version
            now = policy.get_logprobs(batch)
            gaps.append(float((batch.fields["generation_logprobs"] - now).abs()[new].mean()))
            generation.mark_stale()
            idle_s.append(generation.prepare().seconds)  # the same weights again, nothing in flight
    return {"mean_abs_logprob_gap": statistics.mean(gaps), "max_of_means": max(gaps),
            "mixed_fraction": statistics.mean(mixed), "refit_in_flight_s": statistics.median(in_flight_s),
            "refit_idle_s": statistics.median(idle_s)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from nrl_core.cluster import shutdown_ray
    from nrl_core.testing.tiny_models import cached_tiny_model

    model = cached_tiny_model("llama", size="small")
    result = {}
    for recompute in (False, True):
        name = "recompute" if recompute else "stale"
        result[name] = one_mode(model, recompute, args.repeats)
        shutdown_ray()
        r = result[name]
        print(f"{name:>9} KV: |log p_engine - log p_policy| on tokens of the new version {r['mean_abs_logprob_gap']:.5f} "
              f"(mean; worst repeat {r['max_of_means']:.5f}); responses with two versions {r['mixed_fraction']:.2f}; "
              f"refit in flight {1000 * r['refit_in_flight_s']:.0f} ms, idle {1000 * r['refit_idle_s']:.0f} ms")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
