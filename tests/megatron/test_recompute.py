"""NeMo RL's memory keys on the Megatron backend: activation recompute (``activation_checkpointing``,
``recompute_granularity``, ``recompute_modules``) and ``empty_unused_memory_level``.

Recompute is checked on a real tiny Megatron model in one single-rank launch: the loss and every
gradient equal the run without recompute bit for bit, and forward hooks count the recomputed
module's forward twice per step (the forward, then again in backward) and the others once.
``empty_unused_memory_level`` is a no-op without CUDA: its decision table is checked here against
NeMo RL's, and tests/megatron/test_gpu_paths.py checks that the configured level reaches the worker.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="nrl-backend-megatron's engine is not installed")
pytest.importorskip("nrl_backend_megatron")

from nrl_backend_megatron.memory import (
    EMPTY_CACHE_POINTS,
    check_recompute,
    empties_cache,
    empty_unused_memory,
    recompute_kwargs,
)
from nrl_backend_megatron.schema import MEGATRON_CFG_SCHEMA
from nrl_core.errors import ConfigError
from nrl_core.testing.tiny_models import cached_tiny_model

KEY = "policy.megatron_cfg"
REPO = Path(__file__).resolve().parents[2]
SELECTIVE = {"activation_checkpointing": True, "recompute_granularity": "selective"}


def validate(section: dict) -> dict:
    return MEGATRON_CFG_SCHEMA.validate(section, KEY)


# ------------------------------------------------------------------ schema and TransformerConfig fields
def test_the_keys_are_live_with_nemo_rls_defaults() -> None:
    out = validate({})
    assert (out["activation_checkpointing"], out["recompute_granularity"], out["recompute_modules"],
            out["empty_unused_memory_level"]) == (False, "full", None, 0)
    for name in ("recompute_granularity", "recompute_modules", "empty_unused_memory_level"):
        assert not MEGATRON_CFG_SCHEMA.fields[name].inert


@pytest.mark.parametrize("section, expected", [
    ({}, (None, None, None, None)),
    ({"recompute_granularity": "selective", "recompute_modules": ["mlp"]}, (None, None, None, None)),  # needs the switch
    ({"activation_checkpointing": True}, ("full", "uniform", 1, None)),
    (SELECTIVE, ("selective", None, None, ["core_attn"])),  # null: Megatron-Core's default
    ({**SELECTIVE, "recompute_modules": ["mlp", "core_attn"]}, ("selective", None, None, ["mlp", "core_attn"])),
])
def test_transformer_config_fields_as_nemo_rl_sets_them(section: dict, expected: tuple) -> None:
    """nemo_rl/models/megatron/setup.py (_apply_performance_config): only with activation_checkpointing;
    full is uniform over 1-layer units, selective passes recompute_modules on."""
    kwargs = recompute_kwargs(validate(section))
    got = (kwargs["recompute_granularity"], kwargs["recompute_method"], kwargs["recompute_num_layers"],
           kwargs.get("recompute_modules"))
    assert got == expected


@pytest.mark.parametrize("section, phrase", [
    ({"recompute_modules": ["attention"]}, "unknown module 'attention'"),
    ({**SELECTIVE, "recompute_modules": ["moe_act"]}, "grouped-GEMM experts"),
    ({**SELECTIVE, "recompute_modules": ["mla_up_proj"]}, "multi-latent attention"),
    ({**SELECTIVE, "recompute_modules": ["core_attn", "layernorm"]}, "'layernorm' needs Transformer Engine"),
])
def test_refused_modules_are_one_line(section: dict, phrase: str) -> None:
    with pytest.raises(ConfigError, match=phrase) as err:
        check_recompute(validate(section), transformer_engine=False)
    assert str(err.value).startswith(f"{KEY}.recompute_modules: ") and "\n" not in str(err.value)


def test_what_only_matters_when_it_takes_effect_passes_otherwise() -> None:
    check_recompute(validate({"recompute_modules": ["moe_act", "layernorm"]}), transformer_engine=False)  # off
    check_recompute(validate({"activation_checkpointing": True, "recompute_modules": ["moe_act"]}),
                    transformer_engine=False)  # full granularity ignores the modules, as Megatron-Core does
    check_recompute(validate({**SELECTIVE, "recompute_modules": ["layernorm"]}), transformer_engine=True)


@pytest.mark.parametrize("override, key, phrase", [
    ("policy.megatron_cfg.recompute_modules=[layernorm]", f"{KEY}.recompute_modules", "needs Transformer Engine"),
    ("policy.megatron_cfg.recompute_modules=[moe_act]", f"{KEY}.recompute_modules", "grouped-GEMM experts"),
    ("policy.megatron_cfg.recompute_granularity=partial", f"{KEY}.recompute_granularity", "must be one of"),
    ("policy.megatron_cfg.empty_unused_memory_level=3", f"{KEY}.empty_unused_memory_level", "must be one of 0, 1, 2"),
])
def test_nrl_config_check_refuses_in_one_line(override: str, key: str, phrase: str, tmp_path, capsys) -> None:
    from nrl_core.cli import main

    args = [str(REPO / "examples" / "configs" / "sft_tiny_cpu.yaml"),
            f"policy.model_name={cached_tiny_model('llama', size='small')}", "policy.dtensor_config.enabled=false",
            "policy.megatron_cfg.enabled=true", "policy.optimizer=null",
            "policy.megatron_cfg.activation_checkpointing=true", "policy.megatron_cfg.recompute_granularity=selective",
            override, f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", f"logger.log_dir={tmp_path / 'logs'}"]
    code = main(["config", "check", *args])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {key}: ") and phrase in lines[0], lines


# ------------------------------------------------------------------ empty_unused_memory_level
def test_the_cache_is_emptied_where_nemo_rl_empties_it_at_each_level() -> None:
    """NeMo RL 7ea279a, nemo_rl/models/policy/workers/megatron_policy_worker.py: level 1 after the
    forward/backward (:937), after each reference-weight swap (:1999, :2031) and in
    prepare_for_training (:3032); level 2 also after the optimizer step (:1001)."""
    by_level = {level: {p for p in EMPTY_CACHE_POINTS if empties_cache(level, p)} for level in (0, 1, 2)}
    assert by_level == {
        0: set(),
        1: {"after_forward_backward", "reference_swapped_in", "reference_swapped_out", "after_prepare_for_training"},
        2: {"after_forward_backward", "reference_swapped_in", "reference_swapped_out", "after_prepare_for_training",
            "after_optimizer_step"},
    }
    assert empty_unused_memory(2, "after_optimizer_step") and not empty_unused_memory(1, "after_optimizer_step")


# ------------------------------------------------------------------ recompute on a real model
SETTINGS: dict[str, dict[str, Any]] = {
    "none": {},
    "selective, switch off": {"recompute_granularity": "selective"},
    "full": {"activation_checkpointing": True},
    "core_attn": SELECTIVE,
    "mlp": {**SELECTIVE, "recompute_modules": ["mlp"]},
}
FROZEN_BUT = "layers.1.mlp.linear_fc1"  # everything before it frozen, as under LoRA
MOE_SETTINGS: dict[str, dict[str, Any]] = {
    "none": {},
    "full": {"activation_checkpointing": True},
    "moe": {**SELECTIVE, "recompute_modules": ["moe"]},
}


def _one_step(hf: Any, section: dict[str, Any], trainable: str | None = None) -> dict[str, Any]:
    """One forward/backward of a fresh model built as the worker builds it; forward calls per
    module kind after the forward and after the backward. ``trainable``: only the parameters whose
    names contain it train (as LoRA freezes the base model)."""
    from megatron.core import tensor_parallel

    from nrl_backend_megatron.model import ParallelLayout, build_model, transformer_config

    tensor_parallel.model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    config = transformer_config(hf, ParallelLayout(), params_dtype=torch.float32, moe={},
                                recompute=validate(section))
    model = build_model(hf, config, pre_process=True, post_process=True)
    model.train()
    if trainable is not None:
        for name, param in model.named_parameters():
            param.requires_grad_(trainable in name)
    calls: Counter[str] = Counter()
    for path, module in model.named_modules():
        kind = path.rsplit(".", 1)[-1]
        if kind.isdigit() and path.startswith("decoder.layers."):
            kind = "layer"
        if kind in ("layer", "core_attention", "mlp", "experts"):
            module.register_forward_hook(lambda *_, kind=kind: calls.update([kind]))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, hf.vocab_size, (2, 12), generator=g)
    logits = model(ids, torch.arange(12).expand(2, 12), None)
    loss = -logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    forward = dict(calls)
    loss.backward()
    return {"loss": loss.detach(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "forward": forward, "step": dict(calls),
            "fields": (config.recompute_granularity, config.recompute_method, config.recompute_num_layers)}


def _layernorm_recompute_without_te(hf: Any) -> str:
    """What Megatron-Core 0.16 does with selective 'layernorm' recompute on the local spec (the
    check refuses it; here it is set past the check)."""
    from nrl_backend_megatron.model import ParallelLayout, build_model, transformer_config

    config = transformer_config(hf, ParallelLayout(), params_dtype=torch.float32)
    config.recompute_granularity, config.recompute_modules = "selective", ["layernorm"]
    model = build_model(hf, config, pre_process=True, post_process=True)
    try:
        model(torch.ones(1, 4, dtype=torch.long), torch.arange(4)[None], None).sum().backward()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "ran"


def recompute_world(rank: int, world: int) -> dict[str, Any]:
    from transformers import AutoConfig

    from nrl_backend_megatron import cpu_shim
    from nrl_backend_megatron.model import ParallelLayout
    from nrl_backend_megatron.parallel import init_model_parallel

    cpu_shim.install()
    init_model_parallel(ParallelLayout(), None)
    dense = AutoConfig.from_pretrained(cached_tiny_model("llama"))
    moe = AutoConfig.from_pretrained(cached_tiny_model("qwen3_moe"))
    return {"dense": {name: _one_step(dense, s) for name, s in SETTINGS.items()},
            "moe": {name: _one_step(moe, s) for name, s in MOE_SETTINGS.items()},
            "frozen": {name: _one_step(dense, s, FROZEN_BUT) for name, s in SETTINGS.items()},
            "layernorm": _layernorm_recompute_without_te(dense)}


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    if torch.cuda.is_available():
        pytest.skip("counts the local (non-Transformer Engine) layers' calls")
    from nrl_core.testing.distributed import run_distributed

    (result,) = run_distributed(recompute_world, 1)
    return result


def _assert_same_step(setting: str, run: dict[str, Any], base: dict[str, Any]) -> None:
    assert torch.equal(run["loss"], base["loss"]), setting
    assert run["grads"].keys() == base["grads"].keys()
    for name, grad in base["grads"].items():
        assert torch.equal(run["grads"][name], grad), (setting, name)  # bit for bit: the same ops, run again


def test_recompute_leaves_the_loss_and_every_gradient_bit_identical(runs: dict[str, Any]) -> None:
    """Also behind frozen weights (LoRA's base model): Megatron-Core's reentrant checkpoint passed no
    gradient out of a part whose input needs none, and full recompute's backward failed."""
    assert list(runs["frozen"]["none"]["grads"]) == [f"decoder.{FROZEN_BUT}.weight"]
    for family in ("dense", "moe", "frozen"):
        for setting, run in runs[family].items():
            _assert_same_step(setting, run, runs[family]["none"])


def test_full_recomputes_every_layer_once_more_in_backward(runs: dict[str, Any]) -> None:
    base, full = runs["dense"]["none"], runs["dense"]["full"]
    assert full["fields"] == ("full", "uniform", 1)
    assert base["forward"] == base["step"] == full["forward"] == {"layer": 2, "core_attention": 2, "mlp": 2}
    assert full["step"] == {"layer": 4, "core_attention": 4, "mlp": 4}
    assert runs["moe"]["full"]["step"] == {k: 2 * v for k, v in runs["moe"]["none"]["step"].items()}


def test_selective_recomputes_only_the_modules_named(runs: dict[str, Any]) -> None:
    dense = runs["dense"]
    assert dense["core_attn"]["fields"] == ("selective", None, None)
    assert dense["core_attn"]["step"] == {"layer": 2, "core_attention": 4, "mlp": 2}
    assert dense["mlp"]["step"] == {"layer": 2, "core_attention": 2, "mlp": 4}
    moe = runs["moe"]["moe"]["step"]
    assert moe["experts"] == 2 * runs["moe"]["none"]["step"]["experts"]
    assert moe["core_attention"] == runs["moe"]["none"]["step"]["core_attention"]


def test_without_activation_checkpointing_the_keys_recompute_nothing(runs: dict[str, Any]) -> None:
    off = runs["dense"]["selective, switch off"]
    assert off["fields"] == (None, None, None) and off["step"] == runs["dense"]["none"]["step"]


def test_layernorm_recompute_really_needs_transformer_engine(runs: dict[str, Any]) -> None:
    """Why the check refuses it without Transformer Engine: Megatron-Core 0.16's norm recompute
    reads Transformer Engine's FP8 state whatever the precision."""
    assert runs["layernorm"].startswith("NameError") and "FP8GlobalStateManager" in runs["layernorm"]
