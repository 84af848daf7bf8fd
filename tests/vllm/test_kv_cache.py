"""The CPU KV cache sized from the run when ``vllm_cfg.kv_cache_space_gb`` is unset (nrl_gen_vllm/kv_cache.py)."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

from nrl_core.config.model_config import read_model_config
from nrl_core.testing.distributed import run_distributed
from nrl_gen_vllm.kv_cache import (
    BLOCK_TOKENS,
    MARGIN,
    derived_kv_cache,
    kv_bytes_per_token,
    kv_cache_space,
    largest_batch,
)
from tests.vllm.helpers import generation_config, hf_greedy, hf_model

GIB = 2**30


def _run_config(model_dir: Any, **grpo: Any) -> dict[str, Any]:
    config = generation_config(model_dir)
    config["policy"]["max_total_sequence_length"] = 128
    del config["policy"]["generation"]["vllm_cfg"]["kv_cache_space_gb"]
    config["grpo"].update({"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "val_at_start": False,
                           "val_at_end": False, "val_period": 0, "val_batch_size": 256, "max_val_samples": 256, **grpo})
    return config


def test_bytes_per_token_is_k_and_v_of_every_layer(model_dir) -> None:
    hf = read_model_config(str(model_dir))  # "small": 4 layers, 2 key/value heads of 32
    assert kv_bytes_per_token(hf, 1, torch.float32) == 2 * 4 * 2 * 32 * 4
    assert kv_bytes_per_token(hf, 2, torch.bfloat16) == 2 * 4 * 1 * 32 * 2  # heads split over tensor parallel
    assert kv_bytes_per_token(hf, 4, torch.bfloat16) == 2 * 4 * 1 * 32 * 2  # ... and replicated past their count


def test_layers_of_different_shapes_get_the_default_space() -> None:
    """Gemma 4's layers differ in head width, and transformers refuses to give one global value."""
    from nrl_core.testing.tiny_models import cached_tiny_model

    assert kv_bytes_per_token(read_model_config(str(cached_tiny_model("gemma4", "small"))), 1, torch.float32) is None


def test_derived_size_covers_the_largest_batch(model_dir) -> None:
    hf = read_model_config(str(model_dir))
    per_token = 2 * 4 * 2 * 32 * 4
    train = derived_kv_cache(_run_config(model_dir), hf, max_model_len=128, tensor_parallel_size=1, engines=1,
                             dtype=torch.float32)
    assert train.sequences == 8 and train.blocks == math.ceil(MARGIN * 8) + 1 == 10
    assert train.nbytes == 10 * BLOCK_TOKENS * per_token
    # validation's batch when it is larger and validation runs; engines split the prompts
    config = _run_config(model_dir, val_period=5, val_batch_size=40, max_val_samples=30)
    assert largest_batch(config) == 30
    val = derived_kv_cache(config, hf, max_model_len=300, tensor_parallel_size=1, engines=2, dtype=torch.float32)
    assert val.sequences == 15 and val.blocks == math.ceil(MARGIN * 15 * 3) + 1
    # never more than the old default: a batch that needs more gets the blocks 1 GiB holds
    big = derived_kv_cache(_run_config(model_dir, num_prompts_per_step=512), hf, max_model_len=4096,
                           tensor_parallel_size=1, engines=1, dtype=torch.float32)
    assert big.blocks == GIB // (BLOCK_TOKENS * per_token) == 4096 and big.nbytes == GIB
    # no grpo section (an engine built outside GRPO): the old default
    assert derived_kv_cache(generation_config(model_dir), hf, max_model_len=128, tensor_parallel_size=1, engines=1,
                            dtype=torch.float32).nbytes == 1 * GIB


def test_the_users_space_is_kept_and_null_derives(model_dir) -> None:
    config = _run_config(model_dir)
    derived = kv_cache_space(config, max_model_len=128, tensor_parallel_size=1, engines=1, dtype="auto")
    assert derived.source == "derived" and derived.blocks == 10 and derived.bytes_per_token == 2 * 4 * 2 * 32 * 4
    config["policy"]["generation"]["vllm_cfg"]["kv_cache_space_gb"] = 0.25
    kept = kv_cache_space(config, max_model_len=128, tensor_parallel_size=1, engines=1, dtype="auto")
    assert kept.source == "config" and kept.nbytes == GIB // 4


def _engine_with_derived_cache(rank: int, world_size: int, model_dir: str, prompts: list[list[int]]) -> tuple[Any, ...]:
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the variable wins over the config
    from nrl_gen_vllm.worker import VllmGenerationWorker

    torch.set_num_threads(2)
    before = (torch.set_num_threads, torch.get_num_threads(), os.sched_getaffinity(0))
    worker = VllmGenerationWorker(_run_config(model_dir, num_prompts_per_step=len(prompts), num_generations_per_prompt=1))
    try:
        after = (torch.set_num_threads, torch.get_num_threads(), os.sched_getaffinity(0))
        torch.set_num_threads(1)  # training can still choose its threads
        threads = (before == after, torch.get_num_threads())
        blocks = worker.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        out = worker.generate(prompts, greedy=True)
        return blocks, out.token_ids, worker.kv_cache, threads
    finally:
        worker.shutdown()


@pytest.mark.slow
def test_engine_with_the_derived_cache_generates(model_dir, prompts) -> None:
    """A real engine gets exactly the derived blocks (so the bytes-per-token formula is vLLM's) and
    generates what HF generates; the process keeps its threads, CPUs and ``torch.set_num_threads``
    (vLLM replaces it with a no-op: nrl_gen_vllm/threads.py)."""
    (blocks, token_ids, size, threads), = run_distributed(_engine_with_derived_cache, 1, str(model_dir), prompts)
    assert threads == (True, 1)
    assert size.source == "derived" and blocks == size.blocks == math.ceil(MARGIN * len(prompts)) + 1 == 7
    assert size.nbytes == 7 * BLOCK_TOKENS * 2048 < 2 * 2**20  # 7 blocks of 128 tokens x 2 KiB: 1.75 MiB, not 1 GiB
    assert token_ids == hf_greedy(hf_model(model_dir), prompts)
