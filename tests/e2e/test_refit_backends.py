"""Refit from each real training backend into vLLM, through the same Policy and Generation facades
GRPO uses: after training changes the weights, vLLM's greedy output equals HF ``generate`` with the
policy's exported weights, token for token; a refit that changes nothing changes no output; and
vLLM's logprobs of tokens it sampled at temperature 0.7 agree with the policy's. Megatron runs
tensor-parallel 2 (two Ray workers) into a vLLM engine of tensor-parallel 1, which needs
resharding into full HF tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nrl_core.algorithms.generation import Generation
from nrl_core.algorithms.loss import NLLLoss
from nrl_core.algorithms.policy import Policy
from nrl_core.algorithms.rollouts import rollout_batch
from nrl_core.cluster import init_ray, shutdown_ray
from nrl_core.config import choose_backends, load_and_validate
from nrl_core.contracts import TokenBatch
from nrl_core.testing.tiny_models import cached_tiny_model
from tests.vllm.helpers import hf_greedy, hf_model

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_tiny_cpu.yaml"
LOGPROB_TOLERANCE = 1e-3  # float32 on CPU; measured gaps are ~1e-6 (printed below)

SAMPLING = ["policy.generation.temperature=0.7"]  # the policy's logprobs must follow it, as vLLM's do
CASES = {
    "dtensor-colocated": ["policy.generation.colocated.enabled=true", *SAMPLING],
    "megatron-tp2-noncolocated": [*SAMPLING,
        "policy.dtensor_config.enabled=false", "policy.megatron_cfg.enabled=true", "policy.optimizer=null",
        "+policy.megatron_cfg.tensor_model_parallel_size=2", "cluster.gpus_per_node=2",
        "+policy.megatron_cfg.optimizer.lr=5e-3", "+policy.megatron_cfg.optimizer.min_lr=5e-3",
        "policy.generation.colocated.enabled=false"],
}


@pytest.fixture(scope="module")
def model() -> Path:
    return cached_tiny_model("llama", size="small")


@pytest.fixture(scope="module")
def ray_session():
    shutdown_ray()
    yield
    shutdown_ray()


def _training_batch(seed: int) -> TokenBatch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 500, (8, 24), generator=gen)
    mask = torch.ones(8, 24)
    mask[:, 0] = 0
    return TokenBatch(input_ids=ids, input_lengths=torch.full((8,), 24), fields={"token_mask": mask})


@pytest.mark.parametrize("case", list(CASES))
def test_refit_from_backend_matches_hf_generate(case, model, tmp_path, ray_session, capsys):
    config = load_and_validate(str(CONFIG), [f"policy.model_name={model}", "policy.train_global_batch_size=8",
                                             "policy.train_micro_batch_size=4", "policy.logprob_batch_size=8",
                                             "policy.optimizer.kwargs.lr=5e-3", *CASES[case]])
    choice = choose_backends(config)
    init_ray(config["cluster"])
    policy = Policy(config, choice.training, colocated_generation=config["policy"]["generation"]["colocated"]["enabled"])
    generation = Generation(config, choice.generation, policy)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model))
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
                   for a, b in [(3, 4), (12, 7), (5, 9), (18, 2)]]
        before = generation.generate(prompts, greedy=True)
        assert before.token_ids == hf_greedy(hf_model(model), prompts, max_new_tokens=8)

        for step in range(3):
            policy.train(_training_batch(step), NLLLoss())
        report = generation.update_weights()
        after = generation.generate(prompts, greedy=True)
        policy.export_hf(str(tmp_path / "trained"))
        expected = hf_greedy(hf_model(tmp_path / "trained"), prompts, max_new_tokens=8)
        assert after.token_ids == expected
        assert after.token_ids != before.token_ids, "training should have changed the greedy answers"
        assert report.version == after.weight_version == 1

        generation.update_weights()  # nothing trained since: same weights, same answers
        assert generation.generate(prompts, greedy=True).token_ids == after.token_ids

        sampled = generation.generate(prompts * 4)  # at temperature 0.7
        batch = rollout_batch(prompts * 4, sampled, pad_token_id=3)
        policy_lp = policy.get_logprobs(batch)
        gaps = (policy_lp - batch.fields["generation_logprobs"]).abs()[batch.fields["token_mask"] > 0]
        with capsys.disabled():
            print(f"\n{case}: refit {report.bytes / 1e6:.1f} MB over {report.transport}; vLLM vs policy logprob gap "
                  f"at temperature 0.7: mean {float(gaps.mean()):.2e} max {float(gaps.max()):.2e} over "
                  f"{gaps.numel()} sampled tokens")
        assert float(gaps.max()) < LOGPROB_TOLERANCE
    finally:
        generation.shutdown()
        policy.shutdown()
