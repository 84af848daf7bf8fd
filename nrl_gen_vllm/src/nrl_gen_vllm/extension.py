"""Methods added to vLLM's worker (``worker_extension_cls``), reached through ``collective_rpc``.

They run inside vLLM's worker, next to the model. Names carry an ``nrl_`` prefix because vLLM's
worker already defines ``update_weights`` (and may grow more): an extension must not shadow it.
"""

from __future__ import annotations

from typing import Any

import torch


class NrlWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``model_runner``, ``vllm_config``)."""

    model_runner: Any
    vllm_config: Any
    model_config: Any

    @torch.no_grad()
    def nrl_load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Load already-verified HF-named full tensors through vLLM's layerwise reload.

        The reload restores each layer to its checkpoint layout, buffers incoming weights until a
        layer is complete, runs the layer's post-load processing (fused QKV, quantization...) and
        copies the result into the existing kernel tensors, so CUDA graphs and the KV cache stay
        valid. Returns how many model parameters were loaded.
        """
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.model
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
            loaded = model.load_weights(weights=iter(named))
            finalize_layerwise_reload(model, self.model_config)
        return len(loaded) if loaded is not None else -1

    def nrl_parameter_count(self) -> int:
        return sum(1 for _ in self.model_runner.model.parameters())
