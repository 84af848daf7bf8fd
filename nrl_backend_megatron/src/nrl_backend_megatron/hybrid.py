"""Nemotron-H on Megatron-Core: a ``MambaModel`` whose layers follow the HF config's pattern.

Why a model of its own: Nemotron-H interleaves Mamba-2 layers with attention layers (no RoPE)
and squared-ReLU MLP layers, each with its own pre-norm, which Megatron builds as a
``MambaStack`` (one symbol per layer: ``M`` Mamba, ``*`` attention, ``-`` MLP), not as a
``GPTModel``. With Transformer Engine (GPUs) the stack is Megatron's own spec; without it every
linear layer and norm is the local (torch) one, and the mixer's scan is :mod:`.cpu_mamba`'s when
``mamba_ssm`` is absent.

Tensor parallelism splits Mamba's fused input projection (gate, ``x``, ``B``, ``C``, step sizes)
and its convolution (``x``, ``B``, ``C``) part by part: each rank holds its heads' and groups'
slice of every part, one after the other. :func:`mark_tensor_parallel_parts` records the parts on
the parameters so that slicing and gathering (:mod:`~nrl_backend_megatron.weights`) follow them.
"""

from __future__ import annotations

from typing import Any

import torch

from nrl_core.api import ConfigError

#: HF's layer kinds → Megatron's hybrid-pattern symbols
SYMBOLS = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E"}


def layer_pattern(hf_config: Any) -> str:
    """One symbol per decoder layer, as Megatron's ``hybrid_override_pattern`` spells it."""
    pattern = getattr(hf_config, "hybrid_override_pattern", None)
    if pattern:
        return str(pattern)
    kinds = list(getattr(hf_config, "layers_block_type", None) or [])
    unknown = sorted({k for k in kinds if k not in SYMBOLS})
    if unknown or len(kinds) != hf_config.num_hidden_layers:
        raise ConfigError("policy.model_name", f"Nemotron-H layer kinds {unknown or kinds} are not understood by the "
                                               f"Megatron backend; known: {', '.join(sorted(SYMBOLS))}")
    return "".join(SYMBOLS[k] for k in kinds)


def mamba_dims(hf_config: Any) -> dict[str, int]:
    """Widths of a Mamba layer: heads, head size, groups, state size, the inner width and the
    convolution's channels and kernel."""
    heads, size = int(hf_config.mamba_num_heads), int(hf_config.mamba_head_dim)
    groups, state = int(hf_config.n_groups), int(hf_config.ssm_state_size)
    return dict(heads=heads, head_dim=size, groups=groups, state=state, inner=heads * size,
                conv_channels=heads * size + 2 * groups * state, kernel=int(hf_config.conv_kernel))


def transformer_config_kwargs(hf_config: Any) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of a Nemotron-H config; what Megatron's stack cannot build
    the same way is a one-line refusal."""
    fixed = {"conv_kernel": 4, "use_conv_bias": True, "mamba_hidden_act": "silu"}  # what Megatron's mixer builds
    for key, value in fixed.items():
        if getattr(hf_config, key, value) != value:
            raise ConfigError("policy.model_name", f"Nemotron-H with {key}={getattr(hf_config, key)!r} is not supported "
                                                   f"by the Megatron backend (Megatron's Mamba mixer builds {value!r})")
    if str(getattr(hf_config, "mlp_hidden_act", "relu2")) != "relu2":
        raise ConfigError("policy.model_name", f"Nemotron-H MLP activation {hf_config.mlp_hidden_act!r} is not "
                                               "supported by the Megatron backend; supported: relu2")
    biases = [k for k in ("attention_bias", "mlp_bias", "mamba_proj_bias", "use_bias") if getattr(hf_config, k, False)]
    if biases:
        raise ConfigError("policy.model_name", f"Nemotron-H with biases ({', '.join(biases)}) is not supported by the "
                                               "Megatron backend")
    dims = mamba_dims(hf_config)
    latent = getattr(hf_config, "moe_latent_size", None)
    return dict(
        **({"moe_latent_size": int(latent)} if latent else {}),
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        kv_channels=int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads),
        ffn_hidden_size=hf_config.intermediate_size, layernorm_epsilon=float(hf_config.layer_norm_epsilon),
        gated_linear_unit=False, activation_func=_squared_relu_function(),
        mamba_state_dim=dims["state"], mamba_head_dim=dims["head_dim"], mamba_num_groups=dims["groups"],
        mamba_num_heads=dims["heads"])


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)²`` in eager torch."""
    return torch.square(torch.nn.functional.relu(x))


def _squared_relu_function() -> Any:
    """Megatron's squared ReLU with CUDA; without it the eager one. Megatron's is compiled with
    ``torch.compile``, and on the CPU its kernel's first call returned NaN and later calls varied
    from call to call on the same input (seen under ``ATEN_CPU_CAPABILITY=avx2``)."""
    if torch.cuda.is_available():
        from megatron.core.activations import squared_relu as compiled

        return compiled
    return squared_relu


def check_hybrid(hf_config: Any, tp: int) -> None:
    """What ``nrl config check`` and the workers refuse of a Nemotron-H model: what the stack
    cannot build, and Mamba heads or groups that do not split over ``tp`` ranks."""
    transformer_config_kwargs(hf_config)
    dims = mamba_dims(hf_config)
    for what, count in (("mamba_num_heads", dims["heads"]), ("n_groups", dims["groups"])):
        if count % tp:
            raise ConfigError("policy.megatron_cfg.tensor_model_parallel_size",
                              f"{tp} does not divide the model's {what} ({count}); Megatron splits Mamba's heads "
                              f"and groups over tensor-parallel ranks")


def _moe_spec(experts: int, *, use_te: bool, latent: bool) -> Any:
    """nrl's experts: Megatron's ``SequentialMLP`` (names one per expert, as the converter maps them;
    Megatron builds routed experts at the latent width where the model has one)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    spec = get_moe_module_spec(use_te=use_te, num_experts=experts, moe_grouped_gemm=False)
    if latent:
        if not use_te:
            # Megatron builds the latent projections as Transformer Engine's duplicated linear, and
            # asserts TE for that alone (its other TE use in the layer is fp8's, which a CPU lacks)
            import megatron.core.transformer.moe.moe_layer as moe_layer

            from nrl_backend_megatron.latent import DuplicatedLinear

            moe_layer.TELinear, moe_layer.HAVE_TE = DuplicatedLinear, True
    return spec


def stack_spec(on_gpu: bool, experts: int, latent: bool = False) -> Any:
    """Megatron's Transformer Engine stack spec on GPUs (with nrl's experts); elsewhere the same
    layers built from the local GPT layer spec (packed-sequence attention, norms that allow
    sequence parallelism)."""
    if on_gpu:
        from copy import deepcopy

        from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec

        spec = deepcopy(mamba_stack_spec)
        spec.submodules.moe_layer.submodules.mlp = _moe_spec(experts, use_te=True, latent=latent)
        return spec
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    from nrl_backend_megatron.model import _use_packed_attention
    from nrl_backend_megatron.norms import SequenceParallelTorchNorm, with_sequence_parallel_norms

    gpt = _use_packed_attention(get_gpt_layer_local_spec(qk_layernorm=False, normalization="RMSNorm")).submodules
    mixer = ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear,
                                                                          out_proj=RowParallelLinear))
    stack = ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(
        # checkpoints name the norms as Transformer Engine's spec does, as Megatron's local GPT spec does
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=SequenceParallelTorchNorm, mixer=mixer, mamba_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"})),
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=gpt.input_layernorm, self_attention=gpt.self_attention,
            self_attn_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"})),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=gpt.mlp, mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"})),
        moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=_moe_spec(experts, use_te=False, latent=latent),
            mlp_bda=get_bias_dropout_add))))
    return with_sequence_parallel_norms(stack)


def build_hybrid_model(hf_config: Any, config: Any, *, pre_process: bool, post_process: bool,
                       on_gpu: bool) -> Any:
    """The (possibly pipeline-stage) ``MambaModel`` of a Nemotron-H config, its parameters'
    tensor-parallel parts recorded."""
    import megatron.core.ssm.mamba_block as mamba_block
    from megatron.core.models.mamba.mamba_model import MambaModel

    from nrl_backend_megatron import cpu_mamba
    from nrl_backend_megatron.convert.families import num_experts
    from nrl_backend_megatron.convert.mapping import tied_embeddings
    from nrl_backend_megatron.norms import SequenceParallelTorchNorm

    cpu_mamba.install()
    if not on_gpu:  # the stack's final norm is Transformer Engine's by name
        mamba_block.TENorm = SequenceParallelTorchNorm
    spec = stack_spec(on_gpu, num_experts(hf_config) or 1, latent=bool(getattr(hf_config, "moe_latent_size", None)))
    model = MambaModel(config=config, mamba_stack_spec=spec, vocab_size=hf_config.vocab_size,
                       max_sequence_length=hf_config.max_position_embeddings, pre_process=pre_process,
                       post_process=post_process, hybrid_override_pattern=layer_pattern(hf_config),
                       share_embeddings_and_output_weights=tied_embeddings(hf_config),
                       position_embedding_type="none", parallel_output=True)
    eps = float(hf_config.layer_norm_epsilon)
    for module in model.modules():
        # Megatron fixes the gated norm's epsilon and builds the Mamba layer's local pre-norm with
        # the norm's default; HF's config sets both
        if type(module).__name__ in ("MambaMixer", "MambaLayer") and hasattr(module.norm, "eps"):
            module.norm.eps = eps
    mark_tensor_parallel_parts(model, hf_config)
    if config.recompute_granularity == "full":
        recompute_each_layer(model.decoder)
    return model


def recompute_each_layer(stack: Any) -> None:
    """Full activation recompute (``recompute_granularity: full``) for a ``MambaStack``, which
    Megatron's stack lacks: each layer keeps only its input, and runs again in backward under
    Megatron's checkpoint (RNG states restored), as a ``GPTModel``'s block does with
    ``recompute_method: uniform`` and one layer per group. Selective recompute is the attention
    and MLP layers' own."""
    import functools

    from megatron.core.transformer.transformer_layer import TransformerLayer

    for layer in stack.layers:
        layer.forward = functools.partial(_checkpointed, layer.forward, isinstance(layer, TransformerLayer))


def _checkpointed(forward: Any, returns_context: bool, hidden_states: torch.Tensor, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(hidden_states=hidden_states, **kwargs)
    from megatron.core import tensor_parallel

    def run(hidden: torch.Tensor) -> torch.Tensor:
        out = forward(hidden_states=hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    hidden = tensor_parallel.checkpoint(run, False, hidden_states)
    return (hidden, None) if returns_context else hidden


def mark_tensor_parallel_parts(model: Any, hf_config: Any) -> None:
    """Record on each split parameter the full widths of the parts its tensor-parallel slices are
    cut from (``nrl_tp_parts``; None for a squared-ReLU MLP's input, one part), and a
    ``partition_dim`` where Megatron sets none."""
    from megatron.core.transformer.mlp import MLP

    dims = mamba_dims(hf_config)
    grouped = dims["groups"] * dims["state"]
    for module in model.modules():
        kind = type(module).__name__
        if kind == "MambaMixer":
            module.in_proj.weight.nrl_tp_parts = (dims["inner"], dims["inner"], grouped, grouped, dims["heads"])
            for param in (module.conv1d.weight, module.conv1d.bias):
                if param is not None:
                    param.nrl_tp_parts = (dims["inner"], grouped, grouped)
            for param in (*module.parameters(recurse=False), module.conv1d.weight, module.conv1d.bias,
                          module.norm.weight):
                if param is not None and not hasattr(param, "partition_dim"):
                    param.partition_dim = 0
        elif isinstance(module, MLP) and not module.config.gated_linear_unit:
            module.linear_fc1.weight.nrl_tp_parts = None  # one part: not the gated [gate; up]


def slice_parts(full: torch.Tensor, parts: tuple[int, ...], dim: int, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s slice: its ``1/size`` of each part, concatenated in order."""
    pieces = torch.split(full, list(parts), dim=dim)
    return torch.cat([torch.chunk(p, size, dim=dim)[rank] for p in pieces], dim=dim)


def join_parts(slices: list[torch.Tensor], parts: tuple[int, ...], dim: int) -> torch.Tensor:
    """Inverse of :func:`slice_parts` over every rank's slice."""
    size = len(slices)
    local = [p // size for p in parts]
    per_rank = [torch.split(s, local, dim=dim) for s in slices]
    return torch.cat([torch.cat([r[i] for r in per_rank], dim=dim) for i in range(len(parts))], dim=dim)
