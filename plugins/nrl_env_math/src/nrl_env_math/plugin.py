"""Registers the ``math`` environment with nrl through the ``nrl`` entry-point group.

Kept free of heavy imports (Ray, sympy, math-verify) so listing plugins and checking a config
stay fast; the environment class is named by import path and loaded only when a run builds it.
"""

from __future__ import annotations

from nrl_core.api import EnvironmentSpec, Field, Section, hookimpl

NRL_CONTRACT = 14  # the plugin contract this distribution is written for (docs/plugins.md)

NUMBER = (int, float)

#: ``math_verify_impl`` -> the verifier it names (NeMo RL's values).
VERIFIERS = {"hf_math_verify": "nrl_env_math.verify:verify_response", "dapo_math_verify": "nrl_env_math.dapo:verify_response"}

MATH_ENV_SCHEMA = Section(doc="The math environment: reward for a response whose answer equals the ground truth.", fields={
    "num_workers": Field(type=int, default=1, doc="Ray actors that verify answers; a batch is split across them"),
    "timeout_seconds": Field(type=NUMBER, default=5.0,
                             doc="per-sample verification limit; a sample over it scores reward_incorrect"),
    "reward_correct": Field(type=NUMBER, default=1.0),
    "reward_incorrect": Field(type=NUMBER, default=0.0),
    "hang_grace_seconds": Field(type=NUMBER, default=30.0,
                                doc="a worker silent for timeout_seconds x its samples + this is declared hung"),
    "startup_timeout_seconds": Field(type=NUMBER, default=120.0, doc="time a new worker may take to start"),
    "cpus_per_worker": Field(type=NUMBER, default=0.1, doc="CPUs Ray reserves per worker (scheduling only)"),
    "verifier": Field(type=str, default=None, nullable=True,
                      doc="'module:function' (response, ground_truth) -> bool, run inside the workers; "
                          "null: the one math_verify_impl names"),
    "math_verify_impl": Field(type=str, default="hf_math_verify", choices=tuple(VERIFIERS),
                              doc="hf_math_verify: math-verify's symbolic check; dapo_math_verify: DAPO's "
                                  "normalised string match of the last 'Answer:' line"),
})

#: ``env.dapo``: the math environment with DAPO's verifier (NeMo RL's DAPO recipes set this section).
DAPO_ENV_SCHEMA = MATH_ENV_SCHEMA.with_fields(
    math_verify_impl=Field(type=str, default="dapo_math_verify", choices=("dapo_math_verify",),
                           doc="DAPO's normalised string match of the last 'Answer:' line"))

MULTI_REWARD_SCHEMA = Section(doc="Three named rewards (correctness, integer, format) for GDPO.", fields={
    "num_workers": Field(type=int, default=1, minimum=1, doc="accepted for NeMo RL's configs; the checks are string "
                                                             "operations that run in the driver"),
    "math_verify_impl": Field(type=str, default="hf_math_verify", choices=("hf_math_verify",),
                              doc="NeMo RL's only implementation for this environment"),
})


@hookimpl
def nrl_environments() -> list[EnvironmentSpec]:
    return [EnvironmentSpec(name="math", environment="nrl_env_math.environment:MathEnvironment",
                            config_schema=MATH_ENV_SCHEMA, distribution="nrl-env-math",
                            description="math answers (\\boxed{} or last number) checked with math-verify"),
            EnvironmentSpec(name="dapo", environment="nrl_env_math.environment:DapoMathEnvironment",
                            config_schema=DAPO_ENV_SCHEMA, distribution="nrl-env-math",
                            description="math answers ('Answer: ...') checked by DAPO's normalised string match"),
            EnvironmentSpec(name="math_multi_reward", environment="nrl_env_math.multi_reward:MathMultiRewardEnvironment",
                            config_schema=MULTI_REWARD_SCHEMA, distribution="nrl-env-math",
                            reward_components=("correctness", "format", "integer"),
                            description="correctness, integer and format rewards (<think>/<answer>) for GDPO")]
