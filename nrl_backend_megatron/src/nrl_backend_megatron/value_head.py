"""A scalar value head in place of Megatron's output layer (capability ``value_head``, contract 11).

Why a module of our own: Megatron's output layer (``ColumnParallelLinear``) splits the vocabulary
over the tensor-parallel ranks, and a head of one output cannot be split. :class:`ValueHead` is
Hugging Face's ``score`` layer (``nn.Linear(hidden, 1)``; a bias only for ``regression``, as HF's
token classifier has), held whole by every tensor-parallel rank of the last pipeline stage: its
parameters carry no ``tensor_model_parallel`` attribute, so export, checkpoints and the gradient
norm treat them as they treat a norm weight (replicated). Each rank computes the same values from
the same (full-sequence) hidden states, so its gradients need no reduction over the group. Under
sequence parallelism each rank holds a slice of the sequence; the head gathers the whole first,
and its backward keeps each rank's own slice of the (identical) gradient rather than summing it.

``GPTModel`` calls it where it calls the output layer and transposes its ``[s, b, 1]`` output to
``[b, s, 1]``; the worker squeezes that to ``[b, s]`` float32.
"""

from __future__ import annotations

from typing import Any

import torch

from nrl_backend_megatron.convert.families import head_kind
from nrl_core.api import ConfigError, head_has_bias, value_model_config


class ValueHead(torch.nn.Module):
    """HF's ``score`` layer, called as Megatron's output layer is (see the module docstring)."""

    def __init__(self, hidden: int, bias: bool, dtype: torch.dtype, device: torch.device | None = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel  # GPTModel reads it too (inference only)
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device)) if bias else None

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        """``[s, b, h]`` -> ``([s, b, 1], None)``; ``weight`` (tied embeddings) never applies."""
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def attach(model: Any, kind: str, hidden: int, dtype: torch.dtype) -> None:
    """Replace the last stage's output layer by a :class:`ValueHead` of ``kind`` (zeros: loaded
    from a classifier checkpoint or :func:`initialise`d)."""
    device = next(model.parameters()).device  # where GPTModel built this stage
    model.output_layer = ValueHead(hidden, head_has_bias(kind), dtype, device,
                                   sequence_parallel=bool(model.config.sequence_parallel))


@torch.no_grad()
def initialise(model: Any, std: float, seed: int) -> None:
    """A fresh head as HF initialises a classifier's ``score`` (normal, ``initializer_range``; a
    zero bias), drawn from a generator of its own seeded by ``policy.seed``: every rank holding the
    replicated head gets the same values, whatever the layout, and no other random stream moves."""
    head = model.output_layer
    generator = torch.Generator().manual_seed(seed)
    head.weight.copy_(torch.normal(0.0, std, tuple(head.weight.shape), generator=generator))
    if head.bias is not None:
        head.bias.zero_()


def model_config(source: Any, kind: str | None, tokenizer_source: str) -> Any:
    """The HF config of the model the worker trains and exports: the checkpoint's own for a
    language model, else the classifier's (``LlamaForSequenceClassification``, one label), the
    same the DTensor backend exports (pad id: the checkpoint's, else the tokenizer's)."""
    if kind is None:
        return source
    return value_model_config(source, kind, tokenizer_source)


def check_source(source: Any, kind: str | None, model_name: str) -> None:
    """The checkpoint's head fits the model asked for: a classifier only with a value head of its
    kind and of one label (a causal LM fits either: a value head starts fresh)."""
    have = head_kind(source)
    if have is None:
        return
    arch = next(iter(getattr(source, "architectures", None) or []), have)
    if kind is None:
        raise ConfigError("policy.model_name", f"'{model_name}' is a {arch}, a model with a value head; enable "
                                               "policy.reward_model_cfg or start from a causal language model")
    if have != kind:
        raise ConfigError("policy.reward_model_cfg.reward_model_type",
                          f"is {kind}, but '{model_name}' is a {arch} (a {have} head); set it to {have} or start "
                          "from a causal language model")
    if int(getattr(source, "num_labels", 1)) != 1:
        raise ConfigError("policy.model_name", f"'{model_name}' is a {arch} of {source.num_labels} labels; a value "
                                               "head has one")
