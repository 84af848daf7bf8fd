"""Tiny random-init Hugging Face causal LMs with a locally trained tokenizer.

No model hub is reachable where nrl is tested, so tests, examples and benchmarks build their models
here: a byte-level BPE tokenizer trained on an arithmetic corpus and a Llama-, Mistral-, Qwen2-,
Qwen3- or Gemma 3-shaped model, saved with ``save_pretrained`` so every engine (transformers, vLLM, the
Megatron converter) loads it from disk exactly as it would a real checkpoint. The same family,
size and seed always give the same files, and a build is cached under a directory keyed by them.

Gemma 3 (text) has the hub models' sliding-window and full-attention layers (here alternating,
so that a two-layer model has both; the hub's have five local layers to a global one), scaled
embeddings, query and key norms, and an output layer tied to the embeddings; its window is short
enough that the tests' sequences cross it.

Newer families, at ``tiny`` and ``small`` only (the sizes of twins and tests), each with the
features its hub models are chosen for, so a twin trains what the recipe would:

* ``gemma4``: Gemma 4 (text, dense): Gemma 3's alternating sliding and full attention, the full
  layers' heads wider, with small per-layer input embeddings, the feature of the E2B/E4B models;
* ``gpt_oss``: gpt-oss: every layer a mixture of experts with biased, clamped SwiGLU experts,
  attention sinks and alternating sliding and full attention;
* ``nemotron_h``: Nemotron-H (Nemotron Nano 2): a hybrid of Mamba-2 layers, attention and
  squared-ReLU MLP layers, each its own block;
* ``nemotron_h_moe``: Nemotron 3 (Nano, Super): the same hybrid with mixture-of-experts blocks of
  squared-ReLU experts and a shared expert in place of the MLPs.

Two mixture-of-experts families: ``qwen3_moe`` (every layer routes each token to 2 of 8 experts,
top-k probabilities renormalised) and ``qwen2_moe`` (the same plus a sigmoid-gated shared expert,
top-k probabilities not renormalised, q/k/v biases). Their attention heads are 32 wide because
vLLM's CPU attention refuses 16.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

DENSE_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
#: Hugging Face ``model_type`` values that are a family here under another name.
MODEL_TYPES = {"gemma3_text": "gemma3", "gemma4_text": "gemma4"}
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")
#: The families with multi-head latent attention, DeepSeek-V3's routing and its prediction layers.
LATENT_FAMILIES = ("deepseek_v3", "glm4_moe_lite")
#: DeepSeek-V3's routing correction bias (a buffer), given random values like the weights.
ROUTING_BIAS = "e_score_correction_bias"
NEWER_FAMILIES = ("gemma4", "gpt_oss", "nemotron_h", "nemotron_h_moe", "deepseek_v3", "glm4_moe_lite")
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES + NEWER_FAMILIES
#: The sizes the newer families come in; their layouts need four layers to show each block kind.
NEWER_SIZES = ("tiny", "small")

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}Q: {{ m['content'] }}\n"
    "{% else %}A: {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)

SIZES: dict[str, dict[str, int]] = {
    # 0.14M parameters: unit tests. Its 16-wide heads are below what vLLM's CPU attention accepts
    # (32 and up), so GRPO on CPU needs "small" or "bench".
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    # 0.92M parameters (Llama): end-to-end tests and the CPU demo.
    "small": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2),
    # 25.7M parameters (Llama): benchmarks.
    "bench": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4),
    # 0.69B parameters (Llama, vocabulary 32768): the GPU acceptance run, at the shapes of a
    # 0.5-1.5B model (128-wide heads, grouped-query attention), so memory and speed mean something.
    "gpu": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=12,
                num_key_value_heads=2),
}

# Mixture-of-experts shapes per size: attention with 32-wide heads, 8 experts of width
# ``moe_intermediate_size`` (top 2), and for qwen2_moe a shared expert twice as wide.
MOE_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 num_experts=8, moe_intermediate_size=32),
    "small": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  num_experts=8, moe_intermediate_size=64),
    "bench": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  num_experts=16, moe_intermediate_size=192),
}


def arithmetic_corpus(limit: int = 100) -> list[str]:
    """Texts the tokenizer is trained on: the shapes of the arithmetic prompts and answers."""
    lines = []
    for a in range(limit):
        for b in range(0, limit, 7):
            lines.append(f"Q: What is {a} + {b}?\nA: {a + b}")
            lines.append(f"Q: What is {a} - {b}?\nA: {a - b}")
    lines.append("Answer with a number. \\boxed{} The answer is")
    return lines


def build_tokenizer(out_dir: str | os.PathLike[str], vocab_size: int = 512) -> Any:
    """Train a byte-level BPE tokenizer locally and save it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(arithmetic_corpus(), trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                     pad_token="<pad>", unk_token="<unk>")
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(str(out_dir))
    return hf_tok


def model_config(family: str, size: str = "tiny", vocab_size: int = 512, **overrides: Any) -> Any:
    """The transformers config of a tiny model of ``family`` (see :data:`FAMILIES`)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family '{family}'; choose one of {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size '{size}'; choose one of {', '.join(SIZES)}")
    if family in NEWER_FAMILIES and size not in NEWER_SIZES:
        raise ValueError(f"family '{family}' comes in sizes {', '.join(NEWER_SIZES)}, not '{size}'")
    if family in NEWER_FAMILIES and "num_hidden_layers" in overrides:
        raise ValueError(f"family '{family}' has a fixed layout of layer kinds; its depth cannot be changed")
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common: dict[str, Any] = dict(
        vocab_size=vocab_size, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=3,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
    )
    head_dim = SIZES[size]["hidden_size"] // SIZES[size]["num_attention_heads"]
    if family in NEWER_FAMILIES:
        cfg = _newer_config(family, size, common)
    elif family == "llama":
        cfg = LlamaConfig(**common, **SIZES[size])
    elif family == "mistral":
        cfg = MistralConfig(**common, **SIZES[size], head_dim=head_dim, sliding_window=None)
    elif family == "gemma3":
        layers = SIZES[size]["num_hidden_layers"]
        cfg = Gemma3TextConfig(**dict(common, tie_word_embeddings=True), **SIZES[size], head_dim=head_dim,
                               query_pre_attn_scalar=head_dim, sliding_window=16,
                               layer_types=["full_attention" if (i + 1) % 2 == 0 else "sliding_attention"
                                            for i in range(layers)])
    elif family == "qwen2":
        cfg = Qwen2Config(**common, **SIZES[size], use_sliding_window=False)
    elif family == "qwen3":
        cfg = Qwen3Config(**common, **SIZES[size], use_sliding_window=False, head_dim=head_dim)
    else:
        moe = dict(MOE_SIZES[size], num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                   output_router_logits=False, router_aux_loss_coef=0.0,
                   intermediate_size=4 * MOE_SIZES[size]["moe_intermediate_size"], use_sliding_window=False)
        if family == "qwen3_moe":
            cfg = Qwen3MoeConfig(**common, **moe, head_dim=32, norm_topk_prob=True)
        else:
            cfg = Qwen2MoeConfig(**common, **moe, norm_topk_prob=False,
                                 shared_expert_intermediate_size=2 * MOE_SIZES[size]["moe_intermediate_size"])
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def _newer_config(family: str, size: str, common: dict[str, Any]) -> Any:
    """A newer family's config: 32-wide heads (vLLM's CPU attention needs 32 and up; Gemma 4's
    full-attention layers 64, twice its sliding ones, as its hub models' are wider), four layers at
    ``small`` so that every block kind appears, fewer at ``tiny``."""
    from transformers import Gemma4TextConfig, GptOssConfig, NemotronHConfig

    if family in LATENT_FAMILIES:
        return _latent_attention_config(family, size, common)
    hidden, layers = (128, 4) if size == "small" else (64, 2)
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    attention = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 32,
                     num_key_value_heads=max(1, hidden // 64), head_dim=32)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    # gpt-oss keeps its hub models' YaRN scaling (vLLM's gpt-oss reads its factor)
    yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 32, "truncate": False}  # 32 x 32: the tiny context
    if family == "gemma4":
        return Gemma4TextConfig(**dict(common, tie_word_embeddings=True), **attention, intermediate_size=3 * hidden,
                                sliding_window=16, layer_types=alternating, global_head_dim=64,
                                vocab_size_per_layer_input=common["vocab_size"],
                                hidden_size_per_layer_input=16,
                                rope_parameters={"sliding_attention": rope, "full_attention": rope})
    if family == "gpt_oss":
        return GptOssConfig(**{k: v for k, v in common.items() if k != "rope_theta"}, **attention,
                            intermediate_size=hidden // 2, num_local_experts=8, num_experts_per_tok=2,
                            sliding_window=16, layer_types=alternating, rope_parameters=yarn,
                            router_aux_loss_coef=0.0)
    blocks = (["mamba", "attention", "mamba", "mlp"] if size == "small" else ["mamba", "attention"])
    if family == "nemotron_h_moe":
        blocks = [("moe" if block == "mlp" else block) for block in blocks] + (["moe"] if size == "tiny" else [])
    mamba = dict(mamba_num_heads=hidden // 32, mamba_head_dim=32, ssm_state_size=16, n_groups=2, chunk_size=16,
                 conv_kernel=4, expand=1)
    moe = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
               moe_shared_expert_intermediate_size=hidden // 2, n_group=1, topk_group=1)
    return NemotronHConfig(**{k: v for k, v in common.items() if k not in ("rope_theta", "rms_norm_eps")},
                           **dict(attention, num_hidden_layers=len(blocks)), layers_block_type=blocks,
                           intermediate_size=3 * hidden, layer_norm_epsilon=1e-6, **mamba, **moe)


def _latent_attention_config(family: str, size: str, common: dict[str, Any]) -> Any:
    """DeepSeek-V3 (Moonlight's family) or GLM-4.7-Flash: multi-head latent attention and
    mixture-of-experts layers after a dense first one, routed as their hub models route (sigmoid
    scores with a correction bias, ``noaux_tc``). The latent and rotary widths are the hub models'
    (512 and 64), the only ones vLLM's latent-attention kernels are built for. GLM's queries go
    through a low-rank projection as its hub model's do; Moonlight's do not."""
    from transformers import DeepseekV3Config, Glm4MoeLiteConfig

    hidden, layers = (128, 4) if size == "small" else (64, 2)
    shape = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 32,
                 num_key_value_heads=hidden // 32, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
                 v_head_dim=32, intermediate_size=3 * hidden, moe_intermediate_size=hidden // 2, n_routed_experts=8,
                 n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True,
                 routed_scaling_factor=2.5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    base = {k: v for k, v in common.items() if k != "rope_theta"}
    if family == "deepseek_v3":
        config = DeepseekV3Config(**base, **shape, q_lora_rank=None, first_k_dense_replace=1)
    else:
        config = Glm4MoeLiteConfig(**base, **shape, q_lora_rank=64,
                                   mlp_layer_types=["dense"] + ["sparse"] * (layers - 1))
        config.first_k_dense_replace = 1  # what vLLM reads, and the hub model's config.json says
    config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"  # what vLLM reads to build the router's bias
    config.num_nextn_predict_layers = 0  # no multi-token prediction layers, as in Moonlight's checkpoint
    return config


def build_tiny_model(out_dir: str | os.PathLike[str], family: str = "llama", size: str = "tiny", seed: int = 0,
                     init_std: float | None = None, **config_overrides: Any) -> Path:
    """Write a random-init model of ``family`` and the local tokenizer to ``out_dir``; deterministic
    for ``seed``. ``init_std``: the weight matrices' normal std (default below). Returns ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    cfg = model_config(family, size, **config_overrides)
    cfg.torch_dtype = "float32"
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        # Larger-than-default init so a random model's outputs are far from uniform and greedy
        # decoding is stable under tiny numeric differences between engines; the GPU size keeps
        # the usual 0.02, which at 24 layers keeps activations at a trained model's scale.
        std = init_std if init_std is not None else 0.02 if size == "gpu" else 0.08
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, std)
            for name, buffer in model.named_buffers():
                if name.endswith(ROUTING_BIAS):  # a trained model's choices lean on it; zeros would hide its path
                    buffer.normal_(0.0, 0.1)
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(str(out), safe_serialization=True)
    if int(getattr(cfg, "num_nextn_predict_layers", 0) or 0) and family in LATENT_FAMILIES:
        _append_prediction_layers(out, cfg, seed)
    return out


def _append_prediction_layers(out: Path, cfg: Any, seed: int) -> None:
    """Add DeepSeek-V3's multi-token-prediction layers to a written checkpoint, which transformers
    neither builds nor saves: layer ``num_hidden_layers + k`` is a decoder layer like the last one
    (its copy) with the two norms, the projection of ``[embedding; hidden]`` and the shared head vLLM's
    ``deepseek_mtp`` drafts with. A recipe that drafts with them gets a twin that has them."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(str(path))
    hidden, last = cfg.hidden_size, cfg.num_hidden_layers - 1
    generator = torch.Generator().manual_seed(seed + 1)
    for k in range(int(cfg.num_nextn_predict_layers)):
        layer = f"model.layers.{cfg.num_hidden_layers + k}."
        for name in [n for n in tensors if n.startswith(f"model.layers.{last}.")]:
            tensors[layer + name[len(f"model.layers.{last}."):]] = tensors[name].clone()
        tensors.update({layer + "enorm.weight": torch.ones(hidden), layer + "hnorm.weight": torch.ones(hidden),
                        layer + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=generator) * 0.08,
                        layer + "shared_head.norm.weight": torch.ones(hidden),
                        layer + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
                        layer + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    save_file(tensors, str(path), metadata={"format": "pt"})


def cached_tiny_model(family: str = "llama", size: str = "tiny", seed: int = 0, cache_dir: str | None = None,
                      init_std: float | None = None, **config_overrides: Any) -> Path:
    """Like :func:`build_tiny_model` but built once per (family, size, seed, overrides) under
    ``cache_dir`` (default ``$NRL_TEST_CACHE`` or the system temp dir) and reused."""
    spec = {"family": family, "size": size, "seed": seed, "overrides": config_overrides, "v": 1}
    if family in NEWER_FAMILIES:  # their configs may still change, and a changed one must rebuild; the
        # older families' directory names are in checkpoint fixtures (tests/reliability), so they stay
        spec["config"] = model_config(family, size, **config_overrides).to_json_string()
        if family in LATENT_FAMILIES:
            spec["routing_bias"] = True  # built with a random routing correction bias since nrl-core 1.24
    if init_std is not None:
        spec["init_std"] = init_std
    key = json.dumps(spec, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    root = Path(cache_dir or os.environ.get("NRL_TEST_CACHE") or Path(tempfile.gettempdir()) / "nrl-test-models")
    target = root / f"{family}-{size}-s{seed}-{digest}"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{target.name}."))
    build_tiny_model(staging, family=family, size=size, seed=seed, init_std=init_std, **config_overrides)
    try:
        staging.rename(target)
    except OSError:  # another process finished first; theirs is identical
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return target
