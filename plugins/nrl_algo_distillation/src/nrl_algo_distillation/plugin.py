"""Registers ``nrl train distillation`` through the ``nrl`` entry-point group: its section
(``distillation``), its teacher (a model section shaped like ``policy``) and the keys NeMo RL's
distillation reads in ``loss_fn``. Free of torch: listing plugins and checking a config stay fast."""

from __future__ import annotations

from nrl_algo_distillation.config import DISTILLATION_SCHEMA, SHARED_KEYS
from nrl_core.api import AlgorithmSpec, hookimpl

NRL_CONTRACT = 14  # the plugin contract this distribution is written for (docs/plugins.md)


@hookimpl
def nrl_algorithms() -> list[AlgorithmSpec]:
    return [AlgorithmSpec(
        name="distillation", entry="nrl_algo_distillation.algorithm:main", distribution="nrl-algo-distillation",
        description="on-policy distillation: the student samples, a teacher's top-k logits teach every token",
        config_schema=DISTILLATION_SCHEMA, config_check="nrl_algo_distillation.config:check_distillation",
        generates=True, model_sections=("teacher",), shared_keys=SHARED_KEYS,
        twin={"num_prompts_per_step": 8, "num_generations_per_prompt": 1}, reference_policy=False)]
