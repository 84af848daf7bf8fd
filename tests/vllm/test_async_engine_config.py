"""vLLM's async engine at tensor parallel above 1 at ``nrl config check``: accepted with its own
ranks and colocated in training ranks (either way its first rank starts vLLM's workers on the
engine's devices)."""

from __future__ import annotations

from nrl_core.algorithms.installed import load_and_validate
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


def test_in_flight_weight_updates_are_live_on_the_vllm_backend() -> None:
    async_grpo = checked(*TP2, "grpo.async_grpo.in_flight_weight_updates=true",
                         "grpo.async_grpo.recompute_kv_cache_after_weight_updates=true")["grpo"]["async_grpo"]
    assert async_grpo["in_flight_weight_updates"] and async_grpo["recompute_kv_cache_after_weight_updates"]


def test_in_flight_updates_need_the_capability_and_merged_weights() -> None:
    import dataclasses

    import pytest

    from nrl_core.config.checks import check_in_flight
    from nrl_core.errors import ConfigError
    from nrl_core.plugins import get_plugin_manager

    vllm = get_plugin_manager().generation_backends().get("vllm", "policy.generation.backend")
    section, merged = {"in_flight_weight_updates": True}, {"refit": {"adapters": False}}
    check_in_flight(section, "grpo.async_grpo", vllm, merged)
    check_in_flight({"in_flight_weight_updates": False}, "grpo.async_grpo", vllm, {"refit": {"adapters": True}})
    cases = [(dataclasses.replace(vllm, capabilities=frozenset({"streaming"})), merged,
              "does not declare in_flight_updates"),
             (vllm, {"refit": {"adapters": True}}, "with policy.refit.adapters: true set it to false")]
    for spec, policy, phrase in cases:
        with pytest.raises(ConfigError) as caught:
            check_in_flight(section, "grpo.async_grpo", spec, policy)
        message = str(caught.value)
        assert "\n" not in message and message.startswith("grpo.async_grpo.in_flight_weight_updates: ") \
            and phrase in message, message


def test_in_flight_updates_on_the_synchronous_engine_are_one_line() -> None:
    """Any algorithm's async section asking for in-flight updates (PPO's here) needs vLLM's async
    engine: the synchronous one returns batches whole."""
    import copy

    import pytest

    from nrl_core.errors import ConfigError
    from nrl_core.generation_kit import in_flight_section
    from nrl_gen_vllm.checks import check_config

    config = copy.deepcopy(checked(*TP2))
    config["grpo"]["async_grpo"]["enabled"] = False
    config["ppo"] = {"async_ppo": {"enabled": True, "in_flight_weight_updates": True}}
    config["policy"]["generation"]["vllm_cfg"]["async_engine"] = False
    assert in_flight_section(config) == "ppo.async_ppo"
    with pytest.raises(ConfigError) as caught:
        check_config(config)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(
        "policy.generation.vllm_cfg.async_engine: must be true with ppo.async_ppo.in_flight_weight_updates"), message
    config["ppo"]["async_ppo"]["enabled"] = False
    assert in_flight_section(config) is None
    check_config(config)
