"""Registers the ``kv_lookup`` tool-use environment, its generator and its processors with nrl."""

from __future__ import annotations

from nrl_core.api import DataProcessorSpec, DatasetGeneratorSpec, EnvironmentSpec, Field, Section, hookimpl

NRL_CONTRACT = 14  # the plugin contract this distribution is written for (docs/plugins.md)

SCHEMA = Section(doc="A key-value store per episode that only the lookup tool can read.", fields={
    "max_tool_calls": Field(type=int, default=2, minimum=1, doc="calls an episode may make; one more ends it unanswered"),
    "reward_correct": Field(type=(int, float), default=1.0, doc="the reward of a right answer (a wrong one: 0)"),
})


@hookimpl
def nrl_environments() -> list[EnvironmentSpec]:
    return [EnvironmentSpec(name="kv_lookup", environment="nrl_env_tool_lookup.environment:KVLookupEnvironment",
                            config_schema=SCHEMA, distribution="nrl-env-tool-lookup", multi_turn=True,
                            description="answer a value only the lookup tool can give (tool use, multi-turn)")]


@hookimpl
def nrl_dataset_generators() -> list[DatasetGeneratorSpec]:
    return [DatasetGeneratorSpec(name="kv_lookup", generator="nrl_env_tool_lookup.data:kv_splits",
                                 distribution="nrl-env-tool-lookup",
                                 description="seeded stores of random values, one key asked per episode")]


@hookimpl
def nrl_data_processors() -> list[DataProcessorSpec]:
    return [DataProcessorSpec(name="kv_lookup", processor="nrl_env_tool_lookup.data:kv_processor",
                              distribution="nrl-env-tool-lookup",
                              description="the question; the store goes to the episode's metadata"),
            DataProcessorSpec(name="kv_lookup_sft", processor="nrl_env_tool_lookup.data:kv_sft_processor",
                              distribution="nrl-env-tool-lookup",
                              description="tool-use traces: call, result (not in the loss), answer")]
