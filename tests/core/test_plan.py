"""``nrl plan`` and the memory check of ``nrl config check``: the model's sizes from its config
alone, each backend's sharding, and the one-line refusal of a run that cannot fit where it runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nrl_core.cli import main
from nrl_core.config import load_and_validate
from nrl_core.plan import plan_memory, refusal
from nrl_core.plan.memory import GiB
from nrl_core.plan.model_shape import ModelShape
from nrl_core.plugins import get_plugin_manager

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"
SFT = EXAMPLES / "sft_tiny_cpu.yaml"
GRPO = EXAMPLES / "grpo_tiny_cpu.yaml"

#: The ``gpu`` size of ``nrl tiny-model`` (0.59B parameters here), as a config alone: no weights.
GPU_SIZE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1536,
            "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 12, "num_key_value_heads": 2,
            "vocab_size": 512, "tie_word_embeddings": False, "max_position_embeddings": 4096}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3", "qwen3_moe", "qwen2_moe"])
def test_the_parameter_count_from_the_config_alone_is_the_models(family: str) -> None:
    """Counted from config.json, without weights: exactly what transformers builds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from nrl_core.testing.tiny_models import cached_tiny_model

    path = cached_tiny_model(family)
    shape = ModelShape.from_model_path(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    if family.endswith("moe"):
        assert shape.experts > 0 and shape.layers * shape.expert_params < shape.total_params


def _config(path: Path, *overrides: str, algorithm: str = "sft", source: Path = SFT) -> dict:
    return load_and_validate(str(source), [f"policy.model_name={path}", *overrides], get_plugin_manager(),
                             algorithm=algorithm)


@pytest.fixture
def gpu_size(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(GPU_SIZE))
    return tmp_path


def _lines(plan, role: str = "policy") -> dict[str, int]:
    return {line.what: line.bytes for line in next(r for r in plan.roles if r.role == role).lines}


MEGATRON = ["policy.dtensor_config.enabled=false", "policy.megatron_cfg.enabled=true", "policy.train_micro_batch_size=8"]


def test_state_per_rank_falls_with_data_parallel_ranks_as_each_backend_shards_it(gpu_size: Path) -> None:
    pm = get_plugin_manager()
    params = ModelShape.from_model_path(gpu_size).total_params
    dtensor = {n: _lines(plan_memory(_config(gpu_size, f"cluster.gpus_per_node={n}"), pm)) for n in (1, 2)}
    assert dtensor[1]["weights"] == params * 4 and dtensor[1]["optimizer state"] == params * 8
    for what in ("weights", "gradients", "optimizer state", "reference weights (host copy of own shards)"):
        assert dtensor[2][what] == dtensor[1][what] // 2  # FSDP shards each over the two ranks
    megatron = {opt: _lines(plan_memory(_config(gpu_size, "cluster.gpus_per_node=2", *MEGATRON,
                                                f"policy.megatron_cfg.optimizer.use_distributed_optimizer={opt}"), pm))
                for opt in ("false", "true")}
    assert megatron["false"]["weights"] == megatron["true"]["weights"] == params * 4  # replicas hold all weights
    assert megatron["true"]["optimizer state"] == megatron["false"]["optimizer state"] // 2


def test_lora_trains_adapters_only_and_keeps_no_reference_copy(gpu_size: Path) -> None:
    pm = get_plugin_manager()
    full = _lines(plan_memory(_config(gpu_size), pm))
    lora = _lines(plan_memory(_config(gpu_size, "policy.dtensor_config.lora_cfg.enabled=true",
                                      "policy.dtensor_config.lora_cfg.dim=8"), pm))
    adapters = ModelShape.from_model_path(gpu_size).adapter_params(8)
    assert lora["weights"] == full["weights"] and lora["gradients"] == adapters * 4
    assert lora["optimizer state"] == adapters * 8 and lora["gradients"] < full["gradients"] / 50
    assert "reference weights (host copy of own shards)" not in lora


def test_the_reference_copy_is_counted_only_for_runs_that_ask_for_reference_logprobs(gpu_size: Path) -> None:
    """As each algorithm's ``reference_policy`` says: SFT never, GRPO with a KL penalty only; a
    plan for no named algorithm counts it."""
    pm = get_plugin_manager()
    reference = "reference weights (host copy of own shards)"
    assert reference not in _lines(plan_memory(_config(gpu_size), pm, algorithms=["sft"]))
    assert reference in _lines(plan_memory(_config(gpu_size), pm))

    def grpo(kl: float, *overrides: str) -> dict[str, int]:
        config = _config(gpu_size, f"loss_fn.reference_policy_kl_penalty={kl}", *overrides, algorithm="grpo",
                         source=GRPO)
        return _lines(plan_memory(config, pm, algorithms=["grpo"]))

    assert reference in grpo(0.01) and reference not in grpo(0.0)
    # REINFORCE++ reads the reference only for the KL it moves into the reward
    plus = ("grpo.adv_estimator.name=reinforce_plus_plus", "loss_fn.use_kl_in_reward=true")
    assert reference in grpo(0.01, *plus) and reference not in grpo(0.0, *plus)


def test_an_algorithms_reference_answer_must_be_a_bool_in_one_line() -> None:
    from nrl_core.contracts import AlgorithmSpec
    from nrl_core.errors import PluginError

    with pytest.raises(PluginError, match="must be True, False or the import path"):
        AlgorithmSpec(name="x", entry="m:f", distribution="d", reference_policy=1)  # type: ignore[arg-type]
    spec = AlgorithmSpec(name="x", entry="m:f", distribution="d", reference_policy="builtins:len")
    with pytest.raises(PluginError, match="returned int, not a bool") as info:
        spec.uses_reference_policy({"policy": {}})
    assert "\n" not in str(info.value)


def test_a_cpu_run_that_cannot_fit_is_refused_at_check_and_at_train_in_one_line(gpu_size: Path, capsys, monkeypatch) -> None:
    """A local model on a machine without GPUs runs on its CPU: the ranks share its memory."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the devices are the GPUs")
    big = ["policy.train_micro_batch_size=64", "policy.max_total_sequence_length=4096",
           "policy.train_global_batch_size=64", "cluster.gpus_per_node=2"]
    code = main(["config", "check", str(SFT), f"policy.model_name={gpu_size}", *big])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: memory: policy: predicted ") and "for its 2 ranks on this machine" in err[0]
    assert "policy.train_micro_batch_size" in err[0]
    # nrl train refuses it the same way, before it launches any worker
    from nrl_core.algorithms.runtime import Runtime

    def launched(*args, **kwargs):
        raise AssertionError("nrl train launched workers for a run that cannot fit")

    monkeypatch.setattr(Runtime, "policy_launched_early", launched)
    code = main(["train", "sft", "--config", str(SFT), f"policy.model_name={gpu_size}", *big])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(err) == 1 and err[0].startswith("error: memory: policy: predicted "), err
    small = gpu_size.parent / "two-layers"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({**GPU_SIZE, "num_hidden_layers": 2}))
    assert main(["config", "check", str(SFT), f"policy.model_name={small}", "policy.train_micro_batch_size=8"]) == 0
    out = capsys.readouterr().out  # about a GiB: fits any machine that runs the suite
    assert "memory plan for" in out and "peak per device" in out and "shared by its 1 training ranks" in out


def test_given_device_memory_refuses_the_role_that_does_not_fit_naming_its_knob(gpu_size: Path, capsys) -> None:
    code = main(["plan", str(SFT), f"policy.model_name={gpu_size}", "--device-memory", "4"])
    captured = capsys.readouterr()
    assert code == 2 and "optimizer state" in captured.out
    (line,) = [x for x in captured.err.splitlines() if x.startswith("error:")]
    assert "policy: predicted " in line and "per device, which has 4.0 GiB" in line


def test_a_recipe_for_other_devices_prints_the_plan_with_its_assumption(gpu_size: Path) -> None:
    """A hub model this machine has not cached: planned from --model-config, nothing refused."""
    config = _config(Path("meta-llama/Llama-3.1-8B-Instruct"), "cluster.gpus_per_node=8", *MEGATRON, algorithm="sft")
    plan = plan_memory(config, get_plugin_manager(), model_config=str(gpu_size))
    assert plan.devices.memory is None and "assumed" in plan.devices.source and refusal(plan) is None


def test_without_the_models_config_the_check_says_so_and_passes(capsys) -> None:
    assert main(["config", "check", str(SFT), "policy.model_name=someone/not-cached-here"]) == 0
    assert "no memory plan: policy.model_name: no config.json for 'someone/not-cached-here'" in capsys.readouterr().out


def test_colocated_generation_plans_the_engine_and_the_hand_off(gpu_size: Path) -> None:
    plan = plan_memory(_config(gpu_size, algorithm="grpo", source=GRPO), get_plugin_manager(), device_gib=80)
    roles = {r.role: r for r in plan.roles}
    assert {"policy", "generation engine", "colocated hand-off"} <= set(roles)
    engine = {line.what: line.bytes for line in roles["generation engine"].lines}
    assert engine["engine weights"] == ModelShape.from_model_path(gpu_size).total_params * 4  # float32 CPU config
    assert roles["generation engine"].device_bytes <= 80 * GiB
