"""What the refit tests that drive GRPO's facades share (tests/e2e, tests/moe): a training worker
group and its generation engines built from the tiny CPU recipe, chat prompts, a training batch."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from nrl_core.contracts import TokenBatch

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_tiny_cpu.yaml"


@contextmanager
def policy_and_generation(model: Path, overrides: list[str]) -> Iterator[tuple[dict[str, Any], Any, Any]]:
    """``(config, Policy, Generation)`` for ``model`` (batches of 8), shut down on exit. The engines
    read the checkpoint themselves (``load_format: auto``) so a test can generate before any refit;
    GRPO's default, placeholder weights loaded by the first ``prepare()``, is an override away."""
    from nrl_core.algorithms.generation import Generation
    from nrl_core.algorithms.installed import choose_backends, load_and_validate
    from nrl_core.algorithms.policy import Policy
    from nrl_core.cluster import init_ray

    config = load_and_validate(str(CONFIG), [f"policy.model_name={model}", "policy.train_global_batch_size=8",
                                             "policy.train_micro_batch_size=4", "policy.logprob_batch_size=8",
                                             "policy.generation.vllm_cfg.load_format=auto", *overrides])
    choice = choose_backends(config)
    init_ray(config["cluster"])
    policy = Policy(config, choice.training, colocated_generation=config["policy"]["generation"]["colocated"]["enabled"])
    generation = Generation(config, choice.generation, policy)
    try:
        yield config, policy, generation
    finally:
        generation.shutdown()
        policy.shutdown()


def chat_prompts(model: Path) -> list[list[int]]:
    """Four arithmetic questions through the model's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            for a, b in [(3, 4), (12, 7), (5, 9), (18, 2)]]


def training_batch(seed: int) -> TokenBatch:
    """Eight random full-length sequences, every token but the first in the loss."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 500, (8, 24), generator=gen)
    mask = torch.ones(8, 24)
    mask[:, 0] = 0
    return TokenBatch(input_ids=ids, input_lengths=torch.full((8,), 24), fields={"token_mask": mask})


def megatron_noncolocated(parallel_key: str, lr: float) -> list[str]:
    """Overrides for the Megatron backend on two ranks, ``parallel_key`` (e.g.
    ``tensor_model_parallel_size``) set to 2, and the generation engine on a third worker of its own."""
    return ["policy.dtensor_config.enabled=false", "policy.megatron_cfg.enabled=true", "policy.optimizer=null",
            f"+policy.megatron_cfg.{parallel_key}=2", "cluster.gpus_per_node=3",
            f"+policy.megatron_cfg.optimizer.lr={lr}", f"+policy.megatron_cfg.optimizer.min_lr={lr}",
            "policy.generation.colocated.enabled=false", "policy.generation.colocated.resources.gpus_per_node=1"]
