"""Loading the Hugging Face causal LM and computing per-token logprobs from it.

:class:`LogprobModel` wraps the HF model so that one ``forward`` returns token logprobs instead of
logits. Why a wrapper: FSDP2 gathers a module's parameters around that module's ``forward``; with
the wrapper as the FSDP root, the embedding, final norm and output projection stay gathered for the
whole forward and backward, and the logprob head can chunk over the sequence (never holding the
full ``[B, T, V]`` logits) while gradients still reach the sharded weights through FSDP's hooks.
Parameter names gain the prefix ``hf.``; :data:`HF_PREFIX` is stripped wherever names leave.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from nrl_core.api import (
    LM_HEAD_SUFFIXES,
    NrlError,
    next_token_logprobs_at,
    next_token_topk,
    read_model_config,
    value_model_config,
)

HF_PREFIX = "hf."


def hf_name(name: str) -> str:
    """The Hugging Face name of a wrapper parameter (``hf.model.x`` -> ``model.x``)."""
    return name[len(HF_PREFIX):] if name.startswith(HF_PREFIX) else name


def load_hf_config(model_name: str, *, trust_remote_code: bool = False,
                   overrides: Mapping[str, Any] | None = None, value_head: str | None = None,
                   tokenizer_source: str | None = None) -> Any:
    """The model's config (``overrides`` applied), checked to be a causal LM (or, for a value head
    of type ``value_head``, a causal LM or an HF classifier, returned as the value model's config,
    its pad id ``tokenizer_source``'s); one-line :class:`NrlError` otherwise."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not os.path.isdir(model_name):
        raise NrlError(f"policy.model_name: '{model_name}' is not a directory; point it at a local "
                       f"Hugging Face checkpoint (config.json and weights)")
    config = read_model_config(model_name, trust_remote_code=trust_remote_code, overrides=overrides)
    # a checkpoint names its head in `architectures` (BertForMaskedLM is a bert model_type that
    # the causal-LM auto mapping also lists); fall back to the mapping when it is absent
    architectures = list(getattr(config, "architectures", None) or [])
    suffixes = LM_HEAD_SUFFIXES if value_head else ("ForCausalLM", "LMHeadModel")
    is_causal = (any(a.endswith(suffixes) for a in architectures) if architectures
                 else config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) or (
        trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}))
    if not is_causal:
        raise NrlError(f"policy.model_name: '{model_name}' is a '{config.model_type}' model, not a causal "
                       f"language model; use a decoder-only checkpoint (Llama, Qwen2, Qwen3, ...)")
    if value_head:
        return value_model_config(config, value_head, tokenizer_source or model_name)
    return config


def load_hf_model(model_name: str, config: Any, *, trust_remote_code: bool = False,
                  value_head: str | None = None) -> nn.Module:
    """The HF causal LM in float32 on the CPU (FSDP2 casts and moves it later); with a value head,
    HF's classifier of one label (a causal LM's checkpoint gets a freshly initialised ``score``)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

    from nrl_backend_dtensor.packed_attention import register

    auto = {None: AutoModelForCausalLM, "bradley_terry": AutoModelForSequenceClassification,
            "regression": AutoModelForTokenClassification}[value_head]
    try:
        return auto.from_pretrained(model_name, config=config, dtype=torch.float32,
                                                    trust_remote_code=trust_remote_code,
                                                    attn_implementation=register(config))
    except Exception as exc:  # noqa: BLE001
        raise NrlError(f"policy.model_name: cannot load the weights in '{model_name}': "
                       f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def build_hf_model_on_meta(config: Any, *, trust_remote_code: bool = False) -> nn.Module:
    """The causal LM with its parameters on the meta device (no memory; float32 once materialised)
    and its buffers built (:mod:`nrl_backend_dtensor.sharded_load` fills the parameters)."""
    from transformers import AutoModelForCausalLM

    from nrl_backend_dtensor.packed_attention import register
    from nrl_backend_dtensor.sharded_load import parameters_on_meta

    with parameters_on_meta():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code,
                                                attn_implementation=register(config))


def _chunk_logprobs(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.gather(logits.log_softmax(-1), -1, targets.unsqueeze(-1)).squeeze(-1)


def token_logprobs(hidden: torch.Tensor, head: nn.Module, input_ids: torch.Tensor,
                   chunk_size: int | None = None, temperature: float = 1.0) -> torch.Tensor:
    """Aligned float32 logprobs ``[B, T]``: ``out[:, t] = log p(input_ids[:, t] | < t)``, ``out[:, 0] = 0``,
    under ``softmax(logits / temperature)``.

    With ``chunk_size`` the output projection and softmax run ``chunk_size`` positions at a time,
    and under autograd each chunk is recomputed in backward, so peak memory holds one chunk's
    logits rather than the whole sequence's.
    """
    h = hidden[:, :-1]
    targets = input_ids[:, 1:]
    width = h.shape[1]
    if chunk_size is None or chunk_size >= width:
        body = _chunk_logprobs(h, head, targets, temperature)
    else:
        parts = []
        for s in range(0, width, chunk_size):
            args = (h[:, s:s + chunk_size], head, targets[:, s:s + chunk_size], temperature)
            parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False) if torch.is_grad_enabled()
                         else _chunk_logprobs(*args))
        body = torch.cat(parts, dim=1)
    return torch.cat([body.new_zeros((body.shape[0], 1)), body], dim=1)


class LogprobModel(nn.Module):
    """An HF causal LM whose forward returns per-token logprobs of its own input (see module doc);
    an HF classifier (a value head) whose forward returns its score at every position."""

    def __init__(self, hf_model: nn.Module, chunk_size: int | None = None, temperature: float = 1.0,
                 value_head: bool = False) -> None:
        super().__init__()
        self.hf = hf_model
        self.chunk_size = chunk_size
        self.temperature = temperature
        self.value_head = value_head

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, gather_ids: torch.Tensor | None = None,
                topk: int = 0) -> Any:
        """Token logprobs ``[b, S]``; with ``gather_ids`` (``[b, S, k]``) the logprobs of those ids
        instead, with ``topk`` the top-k logprobs and ids (:mod:`nrl_core.sdk.vocab`). Those two
        read the whole sequence's logits at once: no chunking."""
        # attention_mask stays None: right padding never precedes a real token under a causal
        # mask, and packed rows get their block-diagonal mask from the position resets.
        out = self.hf.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        if self.value_head:  # HF's token classifier puts dropout before its head: left out, values are exact
            return self.hf.score(out.last_hidden_state).squeeze(-1).float()
        head = self.hf.get_output_embeddings()
        if gather_ids is None and not topk:
            return token_logprobs(out.last_hidden_state, head, input_ids, self.chunk_size, self.temperature)
        logits = head(out.last_hidden_state)
        if topk:
            return next_token_topk(logits, topk, temperature=self.temperature)
        return next_token_logprobs_at(logits, gather_ids, temperature=self.temperature)
