"""Helpers shared by the vLLM tests: the worker's config, and HF references to compare with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MAX_NEW_TOKENS = 16


def generation_config(model_dir: Path | str, **vllm_cfg: Any) -> dict[str, Any]:
    """The parts of a validated nrl config the vLLM worker reads."""
    return {
        "grpo": {"seed": 42},
        "policy": {
            "model_name": str(model_dir), "seed": 42, "precision": "float32", "max_total_sequence_length": 256,
            "generation": {"backend": "vllm", "max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0, "top_p": 1.0,
                           "top_k": None, "stop_token_ids": None, "stop_strings": None,
                           "vllm_cfg": {"enforce_eager": True, "kv_cache_space_gb": 1.0, **vllm_cfg}},
        },
    }


def hf_model(model_dir: Path | str, perturb_seed: int | None = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from nrl_core.testing.refit_host import perturb_weights

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if perturb_seed is not None:
        perturb_weights(model, perturb_seed)
    return model


def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
    """HF ``generate`` one prompt at a time (no padding), stopping at EOS like vLLM: the
    conformance kit's reference, with the vLLM tests' default length."""
    from nrl_core.testing.conformance.scenarios import hf_greedy as reference_greedy

    return reference_greedy(model, prompts, max_new_tokens)


def hf_token_logprobs(model: Any, prompt: list[int], response: list[int]) -> list[float]:
    """log p(response_t | prompt, response_<t) under the HF model."""
    import torch

    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()
