"""Registers ``nrl train rm`` and the ``reward_model`` environment through the ``nrl`` entry-point
group. Free of torch: listing plugins and checking a config stay fast."""

from __future__ import annotations

from nrl_core.api import AlgorithmSpec, EnvironmentSpec, hookimpl
from nrl_reward_model.config import RM_SCHEMA
from nrl_reward_model.env_config import REWARD_MODEL_ENV_SCHEMA

NRL_CONTRACT = 14  # the plugin contract this distribution is written for (docs/plugins.md)


@hookimpl
def nrl_algorithms() -> list[AlgorithmSpec]:
    return [AlgorithmSpec(
        name="rm", entry="nrl_reward_model.algorithm:main", distribution="nrl-reward-model",
        description="Bradley-Terry reward model: score the chosen response of each preference pair higher",
        config_schema=RM_SCHEMA, config_check="nrl_reward_model.config:check_rm", value_sections=("policy",),
        data_kind="preference", reference_policy=False)]


@hookimpl
def nrl_environments() -> list[EnvironmentSpec]:
    return [EnvironmentSpec(
        name="reward_model", environment="nrl_reward_model.environment:RewardModelEnvironment",
        config_schema=REWARD_MODEL_ENV_SCHEMA, distribution="nrl-reward-model", resources_key="resources",
        description="scores each response with a trained reward model (a worker group of its own, batched)")]
