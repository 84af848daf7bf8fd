"""Adapter-only refit into vLLM (``policy.refit.adapters``, contract 9): the engine keeps the base
model it read and applies the LoRA adapter it is sent; greedy generation then equals HF
``generate`` of the base with the adapter merged in. An adapter that does not match its manifest,
or whose rank the engine cannot serve, is refused and the engine keeps the adapter it had."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft")

from nrl_core.refit import RefitError
from nrl_core.refit.adapters import plain_config
from nrl_core.refit.buckets import manifest_of
from tests.vllm.helpers import generation_config, hf_greedy


def adapter(model_dir: Path, seed: int) -> tuple[list[tuple[str, Any]], dict[str, Any], Any]:
    """A rank-8 PEFT adapter on every projection with random B: its tensors under PEFT's file
    names, its adapter_config.json, and the merged HF model."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32), config)
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.3, generator=generator)
    tensors = [(name, t.detach().clone()) for name, t in get_peft_model_state_dict(model).items()]
    return tensors, plain_config(config.to_dict()), model.merge_and_unload().eval()


def play(model_dir: str, prompts: list[list[int]]) -> dict[str, Any]:
    """In a process of its own: a second in-process vLLM engine would share, and at its shutdown
    tear down, the process-wide parallel state of the package's engine."""
    from nrl_gen_vllm.worker import VllmGenerationWorker

    config = generation_config(model_dir, max_lora_rank=8)
    config["policy"]["refit"] = {"adapters": True}
    worker = VllmGenerationWorker(config)
    out: dict[str, Any] = {"base": worker.generate(prompts, greedy=True).token_ids, "adapters": []}
    try:
        for seed in (0, 1):  # the second adapter replaces the first in place
            tensors, config, merged = adapter(Path(model_dir), seed)
            version = worker.import_adapter([tensors], manifest_of(tensors), config)
            generated = worker.generate(prompts, greedy=True)
            out["adapters"].append({"version": version, "output_version": generated.weight_version,
                                    "vllm": generated.token_ids, "hf": hf_greedy(merged, prompts)})
        tensors, config, _ = adapter(Path(model_dir), 2)
        out["refused"] = []
        for bad in ([tensors[:-1]], manifest_of(tensors), config), ([tensors], manifest_of(tensors), {**config, "r": 16}):
            try:
                worker.import_adapter(*bad)
                out["refused"].append(None)
            except RefitError as exc:
                out["refused"].append(str(exc))
        out["after_refusals"] = {"version": worker.weight_version, "vllm": worker.generate(prompts, greedy=True).token_ids}
    finally:
        worker.shutdown()
    return out


@pytest.fixture(scope="module")
def played(model_dir: Path, prompts: list[list[int]]) -> dict[str, Any]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(play, str(model_dir), prompts).result(timeout=600)


def test_greedy_after_an_adapter_refit_equals_the_merged_hf_model(played: dict[str, Any]) -> None:
    assert [(a["version"], a["output_version"]) for a in played["adapters"]] == [(1, 1), (2, 2)]
    for loaded in played["adapters"]:
        assert loaded["vllm"] == loaded["hf"]
    assert played["adapters"][0]["vllm"] != played["base"] != played["adapters"][1]["vllm"]


def test_a_bad_adapter_is_refused_and_the_engine_keeps_its_adapter(played: dict[str, Any]) -> None:
    missing, too_high = played["refused"]
    assert missing is not None and "lora_B" in missing and "\n" not in missing
    assert too_high is not None and too_high.endswith(
        "the adapter's rank 16 exceeds policy.generation.vllm_cfg.max_lora_rank=8; raise it")
    assert played["after_refusals"] == {"version": 2, "vllm": played["adapters"][1]["vllm"]}
