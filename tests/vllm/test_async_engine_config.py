"""vLLM's async engine at tensor parallel above 1 at ``nrl config check``: accepted with its own
ranks and colocated in training ranks (either way its first rank starts vLLM's workers on the
engine's devices)."""

from __future__ import annotations

from nrl_core.config import load_and_validate
from nrl_core.testing.tiny_models import cached_tiny_model

ASYNC = "examples/configs/grpo_tiny_cpu_async.yaml"
TP2 = ["cluster.gpus_per_node=3", "policy.generation.colocated.resources.gpus_per_node=2",
       "policy.generation.vllm_cfg.tensor_parallel_size=2"]


def checked(*overrides: str) -> dict:
    return load_and_validate(ASYNC, [f"policy.model_name={cached_tiny_model('llama', 'small')}", *overrides],
                             algorithm="grpo")


def test_an_async_engine_of_two_ranks_not_colocated_is_accepted() -> None:
    assert checked(*TP2)["policy"]["generation"]["vllm_cfg"]["tensor_parallel_size"] == 2


def test_a_colocated_async_engine_of_two_ranks_is_accepted() -> None:
    config = checked("cluster.gpus_per_node=2", "policy.generation.colocated.enabled=true",
                     "grpo.async_grpo.enabled=false", "policy.generation.vllm_cfg.tensor_parallel_size=2")
    assert config["policy"]["generation"]["vllm_cfg"]["async_engine"] is True
