"""Registers the ``math`` environment with nrl through the ``nrl`` entry-point group.

Kept free of heavy imports (Ray, sympy, math-verify) so listing plugins and checking a config
stay fast; the environment class is named by import path and loaded only when a run builds it.
"""

from __future__ import annotations

from nrl_core import hookimpl
from nrl_core.config.schema import Field, Section
from nrl_core.contracts import EnvironmentSpec

NUMBER = (int, float)

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
    "verifier": Field(type=str, default="nrl_env_math.verify:verify_response",
                      doc="'module:function' (response, ground_truth) -> bool, run inside the workers"),
})


@hookimpl
def nrl_environments() -> list[EnvironmentSpec]:
    return [EnvironmentSpec(name="math", environment="nrl_env_math.environment:MathEnvironment",
                            config_schema=MATH_ENV_SCHEMA, distribution="nrl-env-math",
                            description="math answers (\\boxed{} or last number) checked with math-verify")]
