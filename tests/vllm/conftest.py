"""One in-process vLLM engine for the whole session (engines take seconds to start on CPU)."""

from __future__ import annotations

import os

os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("vllm")
pytest.importorskip("nrl_gen_vllm")

from tests.vllm.helpers import generation_config  # noqa: E402


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from nrl_core.testing.tiny_models import cached_tiny_model

    # "small" (head_dim 32): vLLM's CPU attention has no kernel for the "tiny" model's head_dim 16.
    return cached_tiny_model("llama", "small")


@pytest.fixture(scope="session")
def prompts(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    texts = [f"Q: What is {a} + {b}?\nA:" for a, b in [(3, 4), (12, 7), (40, 2), (99, 98)]] + ["Answer with a number."]
    return [tok(t).input_ids for t in texts]


@pytest.fixture(scope="package")  # gone before another package builds its own vLLM engine in this process
def engine(model_dir: Path):
    from nrl_gen_vllm.worker import VllmGenerationWorker

    config = generation_config(model_dir)
    # the user's own engine arguments reach vLLM (test_engine_args.py reads them back)
    config["policy"]["generation"]["vllm_kwargs"] = {"max_num_seqs": 200}
    worker = VllmGenerationWorker(config)
    yield worker
    worker.shutdown()
