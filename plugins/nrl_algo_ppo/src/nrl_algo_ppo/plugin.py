"""Registers ``nrl train ppo`` through the ``nrl`` entry-point group: its section (``ppo``), its
critic (``value``, a model section shaped like ``policy`` with a value head) and NeMo RL's
``value_loss_fn``. Free of torch: listing plugins and checking a config stay fast."""

from __future__ import annotations

from nrl_algo_ppo.config import PPO_SCHEMA, SHARED_KEYS
from nrl_core.api import AlgorithmSpec, hookimpl

NRL_CONTRACT = 14  # the plugin contract this distribution is written for (docs/plugins.md)


@hookimpl
def nrl_algorithms() -> list[AlgorithmSpec]:
    return [AlgorithmSpec(
        name="ppo", entry="nrl_algo_ppo.algorithm:main", distribution="nrl-algo-ppo",
        description="PPO: a critic (value model) beside the policy, GAE advantages, clipped policy and value losses",
        config_schema=PPO_SCHEMA, config_check="nrl_algo_ppo.config:check_ppo", generates=True,
        model_sections=("value",), value_sections=("value",), shared_keys=SHARED_KEYS,
        twin={"num_prompts_per_step": 2, "num_generations_per_prompt": 4},
        reference_policy="nrl_algo_ppo.config:uses_reference_policy")]
