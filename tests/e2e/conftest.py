"""Fixtures the end-to-end modules share."""

from __future__ import annotations

from pathlib import Path

import pytest

from nrl_core.testing.tiny_models import cached_tiny_model


@pytest.fixture(scope="module")
def model() -> Path:
    """The small tiny Llama (head_dim 32, which vLLM's CPU attention needs)."""
    return cached_tiny_model("llama", size="small")
