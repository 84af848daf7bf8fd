"""Shared fixtures of the data tests: the local tiny tokenizer (with its chat template)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from nrl_core.testing.tiny_models import cached_tiny_model

    return AutoTokenizer.from_pretrained(str(cached_tiny_model("llama")))
