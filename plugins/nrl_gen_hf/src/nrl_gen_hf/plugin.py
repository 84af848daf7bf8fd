"""Entry point (group ``nrl``, name ``hf``): registers the ``hf`` generation backend."""

from __future__ import annotations

from nrl_core.api import GenerationBackendSpec, hookimpl
from nrl_gen_hf.config import HF_CFG

NRL_CONTRACT = 14  # the plugin contract this distribution is written for (docs/plugins.md)


@hookimpl
def nrl_generation_backends() -> list[GenerationBackendSpec]:
    return [GenerationBackendSpec(
        name="hf",
        config_key="hf_cfg",
        worker="nrl_gen_hf.worker:HFGenerationWorker",
        config_schema=HF_CFG,
        distribution="nrl-gen-hf",
        config_check="nrl_gen_hf.checks:check_config",
        description="transformers generate rollouts (no vLLM needed); refit by copying into the model",
    )]
