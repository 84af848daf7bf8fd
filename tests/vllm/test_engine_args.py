"""NeMo RL's engine keys on the vLLM backend: ``policy.generation.vllm_kwargs`` passed to vLLM as
given (refused in one line where nrl sets the argument itself, or vLLM lacks it),
``vllm_cfg.kv_cache_dtype``, ``logprobs_mode`` and ``use_tqdm``."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from nrl_core.algorithms.installed import load_and_validate
from nrl_core.errors import ConfigError
from nrl_core.testing.distributed import run_distributed
from nrl_core.testing.tiny_models import cached_tiny_model
from nrl_gen_vllm.checks import engine_start_error
from nrl_gen_vllm.kv_cache import kv_cache_space
from tests.vllm.helpers import generation_config

RECIPE = "examples/configs/grpo_tiny_cpu.yaml"


def checked(*overrides: str) -> dict[str, Any]:
    return load_and_validate(RECIPE, [f"policy.model_name={cached_tiny_model('llama', 'small')}", *overrides],
                             algorithm="grpo")


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        checked(*overrides)
    text = str(caught.value)
    assert "\n" not in text
    return text


def test_the_users_engine_arguments_and_the_cache_dtype_reach_the_engine(engine) -> None:
    """tests/vllm/conftest.py builds the shared engine with ``vllm_kwargs: {max_num_seqs: 200}``."""
    vllm_config = engine.llm.llm_engine.vllm_config
    assert vllm_config.scheduler_config.max_num_seqs == 200  # vLLM's default on CPU is another value
    assert vllm_config.cache_config.cache_dtype == "auto"
    assert vllm_config.model_config.logprobs_mode == "processed_logprobs"
    assert engine._engine.use_tqdm is False


def test_the_config_keeps_the_keys_and_reads_nemo_rls_values() -> None:
    config = checked("+policy.generation.vllm_kwargs.max_num_seqs=8", "policy.generation.vllm_cfg.kv_cache_dtype=fp8",
                     "policy.generation.vllm_cfg.use_tqdm=true")
    generation = config["policy"]["generation"]
    assert generation["vllm_kwargs"] == {"max_num_seqs": 8}
    assert generation["vllm_cfg"]["kv_cache_dtype"] == "fp8" and generation["vllm_cfg"]["use_tqdm"] is True
    assert checked()["policy"]["generation"]["vllm_cfg"]["logprobs_mode"] == "processed_logprobs"


def test_an_argument_nrl_sets_is_refused_naming_where_to_set_it() -> None:
    assert refusal("+policy.generation.vllm_kwargs.seed=3") == (
        "policy.generation.vllm_kwargs.seed: nrl sets this vLLM argument itself; set it with "
        "policy.generation.vllm_cfg.seed")
    assert refusal("+policy.generation.vllm_kwargs.worker_extension_cls=x.Y").endswith(
        "nrl sets this vLLM argument itself; remove it")
    # a repeat of nrl's own value is no conflict (NeMo RL's recipes write tokenizer: ${policy.tokenizer.name})
    model = cached_tiny_model("llama", "small")
    assert checked(f"+policy.generation.vllm_kwargs.tokenizer={model}")["policy"]["generation"]["vllm_kwargs"] == {
        "tokenizer": str(model)}


def test_an_argument_nrl_sets_on_this_engine_only_is_refused_there() -> None:
    """On CPU the worker prefills whole prompts (seeded sampling needs it); elsewhere the user's
    value goes through."""
    from nrl_gen_vllm.engine_args import user_engine_kwargs

    config = generation_config("m")
    config["policy"]["generation"]["vllm_kwargs"] = {"enable_chunked_prefill": True, "max_num_seqs": 8}
    with pytest.raises(ConfigError) as caught:
        user_engine_kwargs(config, {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192})
    assert str(caught.value) == ("policy.generation.vllm_kwargs.enable_chunked_prefill: nrl sets this vLLM argument "
                                 "itself on this engine (to False); remove it")
    assert user_engine_kwargs(config, {}) == {"enable_chunked_prefill": True, "max_num_seqs": 8}
    # null (a twin's setting, or a user's): the engine's own choice, which nrl's is on this engine
    config["policy"]["generation"]["vllm_kwargs"] = {"enable_chunked_prefill": None, "max_num_batched_tokens": None}
    assert user_engine_kwargs(config, {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192}) == {}


def test_an_argument_vllm_lacks_is_refused_at_check_and_at_engine_start() -> None:
    assert refusal("+policy.generation.vllm_kwargs.max_num_seqz=8").startswith(
        "policy.generation.vllm_kwargs.max_num_seqz: vLLM's engine has no such argument")
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(TypeError) as raised:
        EngineArgs(model="m", max_num_seqz=8)  # what LLM(**kwargs) raises inside the worker
    error = engine_start_error(raised.value, generation_config("m"), cpu=True)
    assert isinstance(error, ConfigError) and str(error).startswith("policy.generation.vllm_kwargs.max_num_seqz: ")


def test_raw_logprobs_and_an_unknown_cache_dtype_are_refused() -> None:
    assert "policy.generation.vllm_cfg.logprobs_mode: must be one of 'processed_logprobs'" in refusal(
        "policy.generation.vllm_cfg.logprobs_mode=raw_logprobs")
    assert refusal("policy.generation.vllm_cfg.kv_cache_dtype=int4").startswith(
        "policy.generation.vllm_cfg.kv_cache_dtype: must be one of 'auto'")


def test_an_fp8_cache_holds_twice_the_tokens_of_a_bfloat16_one(model_dir) -> None:
    config = generation_config(model_dir)
    del config["policy"]["generation"]["vllm_cfg"]["kv_cache_space_gb"]
    config["grpo"].update(num_prompts_per_step=2, num_generations_per_prompt=4, val_period=0, val_at_start=False,
                          val_at_end=False)
    sizes = {dtype: kv_cache_space(config, max_model_len=128, tensor_parallel_size=1, engines=1, dtype="bfloat16",
                                   cache_dtype=dtype) for dtype in ("auto", "fp8")}
    assert sizes["auto"].bytes_per_token == 2 * sizes["fp8"].bytes_per_token
    assert sizes["auto"].blocks == sizes["fp8"].blocks  # the same tokens, in half the bytes


def _start_with_fp8_cache(rank: int, world_size: int, model_dir: str) -> str:
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    from nrl_gen_vllm.worker import VllmGenerationWorker

    try:
        worker = VllmGenerationWorker(generation_config(model_dir, kv_cache_dtype="fp8", precision="bfloat16"))
    except ConfigError as error:
        return f"refused: {error}"
    try:
        return f"started: {worker.llm.llm_engine.vllm_config.cache_config.cache_dtype}"
    finally:
        worker.shutdown()


@pytest.mark.slow
def test_an_fp8_cache_starts_where_the_host_has_kernels_and_is_one_line_where_not(model_dir) -> None:
    """vLLM's CPU attention reads an fp8 cache with AVX-512 or AMX only; either way the key acts."""
    (outcome,) = run_distributed(_start_with_fp8_cache, 1, str(model_dir))
    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        assert outcome == "started: fp8"
    else:
        assert outcome == ("refused: policy.generation.vllm_cfg.kv_cache_dtype: FP8 KV cache on CPU requires x86 "
                           "with AVX-512 or AMX. Use auto on this host"), outcome
