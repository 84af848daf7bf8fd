"""Models with a value head (capability ``value_head``, contract 11): what both backends share.

``policy.reward_model_cfg`` (NeMo RL's section) turns the LM head into Hugging Face's ``score``
layer, one output per position: ``bradley_terry`` models are exported as
``*ForSequenceClassification`` (a sequence's score is the head at its last token, as HF pools it),
``regression`` ones as ``*ForTokenClassification`` (a value per token, a critic).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

HF_HEADS = {"bradley_terry": "ForSequenceClassification", "regression": "ForTokenClassification"}
LM_HEAD_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForSequenceClassification", "ForTokenClassification")


def value_head_type(policy: Mapping[str, Any]) -> str | None:
    """``reward_model_cfg.reward_model_type`` when the section enables a value head, else None."""
    section = policy.get("reward_model_cfg") or {}
    return str(section.get("reward_model_type") or "bradley_terry") if section.get("enabled") else None


def head_has_bias(kind: str) -> bool:
    """HF's token-classification head has a bias, the sequence-classification one none."""
    return kind == "regression"


def head_architecture(architectures: list[str] | None, model_type: str, kind: str) -> str:
    """The HF class a value model of ``kind`` exports as: ``LlamaForCausalLM`` ->
    ``LlamaForSequenceClassification`` (``bradley_terry``)."""
    for name in architectures or []:
        for suffix in LM_HEAD_SUFFIXES:
            if name.endswith(suffix):
                return name[: -len(suffix)] + HF_HEADS[kind]
    from transformers import AutoConfig

    return type(AutoConfig.for_model(model_type)).__name__.removesuffix("Config") + HF_HEADS[kind]


def value_model_config(hf_config: Any, kind: str, tokenizer_source: str) -> Any:
    """A copy of ``hf_config`` describing the value model: one label, the head's class, and the pad
    id nrl pads with (HF's sequence classifier scores each row's last token that is not padding,
    so an export without it, or with another, would score padding)."""
    config = copy.deepcopy(hf_config)
    config.num_labels = 1
    config.architectures = [head_architecture(getattr(config, "architectures", None), config.model_type, kind)]
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = padding_id(tokenizer_source)
    config.tie_word_embeddings = False  # the head is no longer the embedding's transpose
    return config


def padding_id(tokenizer_source: str) -> int:
    """The id nrl pads sequences with: the tokenizer's pad token, else its end-of-sequence token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


def last_token_values(values: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
    """``[b]``: each row's value at its last real token (a Bradley-Terry model's score)."""
    index = (input_lengths.to(values.device).long() - 1).clamp_min(0)
    return values.gather(1, index.unsqueeze(1)).squeeze(1)
