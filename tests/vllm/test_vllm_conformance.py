"""The vLLM generation backend against nrl's conformance kit (nrl_core/testing/conformance):
refit from a DTensor training worker, then greedy output equal to HF greedy."""

import pytest

pytest.importorskip("nrl_backend_dtensor")

from nrl_core.testing.conformance import generation_backend_suite  # noqa: E402

TestConformance = generation_backend_suite(
    "vllm", training_backend="dtensor", overrides=["policy.generation.vllm_cfg.enforce_eager=true"],
    training_overrides=["policy.optimizer.kwargs.lr=1e-2"],
    env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
