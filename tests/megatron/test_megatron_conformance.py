"""The Megatron backend against nrl's conformance kit (nrl_core/testing/conformance)."""

import pytest

pytest.importorskip("megatron.core", reason="nrl-backend-megatron's engine is not installed")

from nrl_core.testing.conformance import training_backend_suite  # noqa: E402

TestConformance = training_backend_suite(
    "megatron", overrides=["policy.megatron_cfg.optimizer.lr=1e-3", "policy.megatron_cfg.optimizer.min_lr=1e-3"],
    slow=True)  # conversions in the session's NRL_MEGATRON_CHECKPOINT_DIR (tests/conftest.py)
