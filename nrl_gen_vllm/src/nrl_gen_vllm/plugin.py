"""Entry point (group ``nrl``, name ``vllm``): registers the ``vllm`` generation backend."""

from __future__ import annotations

from nrl_core.api import GenerationBackendSpec, hookimpl
from nrl_gen_vllm.config import VLLM_CFG

NRL_CONTRACT = 14  # the plugin contract this distribution is written for (docs/plugins.md)


@hookimpl
def nrl_generation_backends() -> list[GenerationBackendSpec]:
    return [GenerationBackendSpec(
        name="vllm",
        config_key="vllm_cfg",
        worker="nrl_gen_vllm.worker:VllmGenerationWorker",
        config_schema=VLLM_CFG,
        distribution="nrl-gen-vllm",
        parallel_size_keys=("tensor_parallel_size",),
        config_check="nrl_gen_vllm.checks:check_config",
        capabilities=frozenset({"streaming", "adapter_refit", "in_flight_updates", "pipelined_import",
                                 "partial_import", "sliced_import"}),
        description="vllm.LLM rollouts; refit through vLLM's layerwise reload",
        # NeMo RL's MoE recipes pick vLLM's Triton MoE kernels, which have no CPU build
        # a twin leaves kernel choices to the engine, and drafts nothing: vLLM's CPU build returns NaN
        # processed logprobs under speculative decoding (checks.check_cpu_engine_kwargs); the CPU
        # engine prefills whole prompts, which seeded sampling needs, and sizes its batch for that
        twin={"vllm_kwargs.moe_backend": "auto", "vllm_kwargs.speculative_config": None,
              "vllm_kwargs.enable_chunked_prefill": None, "vllm_kwargs.max_num_batched_tokens": None},
    )]
