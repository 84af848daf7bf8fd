"""Refit from each real training backend into vLLM, through the same Policy and Generation facades
GRPO uses: after training changes the weights, vLLM's greedy output equals HF ``generate`` with the
policy's exported weights, token for token; a refit that changes nothing changes no output; and
vLLM's logprobs of tokens it sampled at temperature 0.7 agree with the policy's. Megatron runs
tensor-parallel 2 (two Ray workers) into a vLLM engine of tensor-parallel 1, which needs
resharding into full HF tensors. With LoRA adapters the engine gets the merged weights, and its
greedy output equals that of the merged model the policy exports; with ``policy.refit.adapters``
the engine applies the adapters itself (vLLM's LoRA support), and its greedy output is the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nrl_core.algorithms.loss import NLLLoss
from nrl_core.algorithms.rollouts import rollout_batch
from nrl_core.cluster._host import WorkerHost
from tests.e2e.facades import chat_prompts, megatron_noncolocated, policy_and_generation, training_batch
from tests.launch import driving_the_shared_ray
from tests.vllm.helpers import hf_greedy, hf_model

LOGPROB_TOLERANCE = 1e-3  # float32 on CPU; measured gaps are ~1e-6 (printed below)

SAMPLING = ["policy.generation.temperature=0.7"]  # the policy's logprobs must follow it, as vLLM's do
CASES = {
    "dtensor-colocated": ["policy.generation.colocated.enabled=true", *SAMPLING],
    "megatron-tp2-noncolocated": [*SAMPLING, *megatron_noncolocated("tensor_model_parallel_size", 5e-3)],
    # the engine receives the base weights with the adapters merged in; the HF model is the merged export
    "dtensor-lora-colocated": ["policy.generation.colocated.enabled=true", *SAMPLING,
                               "++policy.dtensor_config.lora_cfg.enabled=true", "++policy.dtensor_config.lora_cfg.export=merged",
                               "policy.optimizer.kwargs.lr=2e-2"],
    # adapter-only refit: the engine reads the base model and gets the adapters alone (vLLM's LoRA)
    "dtensor-lora-adapters-colocated": ["policy.generation.colocated.enabled=true", *SAMPLING,
                                        "++policy.dtensor_config.lora_cfg.enabled=true",
                                        "++policy.dtensor_config.lora_cfg.export=merged",
                                        "policy.optimizer.kwargs.lr=2e-2", "policy.refit.adapters=true"],
    "megatron-lora-tp2-noncolocated": [*SAMPLING, *megatron_noncolocated("tensor_model_parallel_size", 2e-2),
                                       "++policy.megatron_cfg.peft.enabled=true",
                                       "++policy.megatron_cfg.peft.export=merged"],
    "megatron-lora-adapters-tp2-noncolocated": [*SAMPLING, *megatron_noncolocated("tensor_model_parallel_size", 2e-2),
                                                "++policy.megatron_cfg.peft.enabled=true",
                                                "++policy.megatron_cfg.peft.export=merged", "policy.refit.adapters=true"],
}


@pytest.fixture(scope="module")
def ray_session():
    """The module's worker groups on the suite's shared Ray (their actors from the zygote)."""
    with driving_the_shared_ray():
        yield


@pytest.mark.parametrize("case", list(CASES))
def test_refit_from_backend_matches_hf_generate(case, model, tmp_path, ray_session, capsys):
    with policy_and_generation(model, ["policy.optimizer.kwargs.lr=5e-3", *CASES[case]]) as (_, policy, generation):
        prompts = chat_prompts(model)

        def greedy() -> Any:  # as GRPO generates: colocated engines wake, then sleep again
            generation.prepare()
            try:
                return generation.generate(prompts, greedy=True)
            finally:
                generation.finish()

        before = greedy()
        assert before.token_ids == hf_greedy(hf_model(model), prompts, max_new_tokens=8)

        for step in range(3):
            policy.train(training_batch(step), NLLLoss())
        report = generation.load_policy_weights()
        after = greedy()
        policy.export_hf(str(tmp_path / "trained"))
        expected = hf_greedy(hf_model(tmp_path / "trained"), prompts, max_new_tokens=8)
        assert after.token_ids == expected
        assert after.token_ids != before.token_ids, "training should have changed the greedy answers"
        assert report.version == after.weight_version == 1
        if "policy.refit.adapters=true" in CASES[case]:  # the adapters alone crossed: no weight of the base
            assert 0 < report.bytes < 0.1 * _weight_bytes(tmp_path / "trained")

        generation.load_policy_weights()  # nothing trained since: same weights, same answers
        assert greedy().token_ids == after.token_ids

        generation.prepare()
        sampled = generation.generate(prompts * 4)  # at temperature 0.7
        generation.finish()
        batch = rollout_batch(prompts * 4, sampled, pad_token_id=3)
        policy_lp = policy.get_logprobs(batch)
        gaps = (policy_lp - batch.fields["generation_logprobs"]).abs()[batch.fields["token_mask"] > 0]
        with capsys.disabled():
            print(f"\n{case}: refit {report.bytes / 1e6:.1f} MB over {report.transport}; vLLM vs policy logprob gap "
                  f"at temperature 0.7: mean {float(gaps.mean()):.2e} max {float(gaps.max()):.2e} over "
                  f"{gaps.numel()} sampled tokens")
        assert float(gaps.max()) < LOGPROB_TOLERANCE


def _weight_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


HANDOFF = {"offload_before_refit", "offload_after_refit", "prepare_for_training", "refit", "get_logprobs", "train",
           "generation.prepare_for_generation", "generation.generate", "generation.finish_generation"}


def test_colocated_memory_hand_off_runs_in_order(model, ray_session):
    """Colocated at data-parallel 2: each training rank hosts an engine, built while the training
    state is on the host; the driver's calls reach every rank in NeMo RL's order, and a call out of
    order is refused by the worker, not run. The engines start on placeholder weights (GRPO's
    default), so the first step refits too."""
    from nrl_core.errors import NrlError

    overrides = ["cluster.gpus_per_node=2", "policy.generation.vllm_cfg.load_format=dummy"]
    with policy_and_generation(model, overrides) as (_, policy, generation):
        prompts = [[1, 40, 41, 42], [1, 50, 51], [1, 60], [1, 70, 71]]
        for _ in range(2):  # a GRPO step each: generate, hand back, score, train, mark stale
            generation.prepare()
            sampled = generation.generate(prompts * 2)
            generation.finish()
            batch = rollout_batch(prompts * 2, sampled, pad_token_id=3)
            policy.get_logprobs(batch)
            policy.train(batch, NLLLoss())
            generation.mark_stale()
        generate_and_train = ["generation.prepare_for_generation", "generation.generate", "generation.finish_generation",
                              "prepare_for_training", "get_logprobs", "train"]
        refit_step = ["offload_before_refit", "generation.prepare_for_generation", "refit", "offload_after_refit",
                      *generate_and_train]
        # the engines are built while the training state is off the device (vLLM sizes itself from
        # the free memory at start-up), then sleep while it comes back
        start_up = ["offload_before_refit", "offload_after_refit", "generation.finish_generation", "prepare_for_training"]
        for history in policy.group.call(WorkerHost.call_history):
            assert [name for name in history if name in HANDOFF] == start_up + refit_step + refit_step

        with pytest.raises(NrlError, match="prepare_for_generation first"):
            generation._engines("generate", prompts)  # the engines sleep after finish()
        generation.prepare()
        with pytest.raises(NrlError, match="prepare_for_training first"):
            policy.train(batch, NLLLoss())  # the optimizer state and weights are off the device
