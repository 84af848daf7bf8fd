"""Which of NeMo RL's keys nrl leaves inert a config's warning names (nrl_core/config/nemo_rl_inert.py):
none that changes what a run computes, each with a line in docs/configuration.md saying why it
means nothing in nrl; settings of a feature the config leaves off are not named; a key whose value
would change the run is refused in one line."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from nrl_core.algorithms.base import AlgorithmRun
from nrl_core.cli import main
from nrl_core.config.nemo_rl_inert import NEUTRAL, REASONS

ROOT = Path(__file__).parents[2]
CONFIGS = Path(__file__).parent / "nemo_rl_configs" / "configs"
GRPO_1B = str(CONFIGS / "grpo_math_1B.yaml")
#: Keys issue 60 names as changing what a run computes or costs: each acts, or is refused, in nrl.
ACTING = ("policy.generation.vllm_kwargs", "policy.generation.vllm_cfg.kv_cache_dtype",
          "policy.generation.val_top_p", "checkpointing.save_optimizer", "checkpointing.model_save_format",
          "policy.megatron_cfg.recompute_granularity", "policy.megatron_cfg.empty_unused_memory_level",
          "data.train.split_validation_size", "data.train.seed", "logger.monitor_gpus",
          "policy.generation.vllm_cfg.enable_vllm_metrics_logger", "grpo.val_start_at",
          "grpo.val_num_generations_per_prompt", "policy.generation.vllm_cfg.logprobs_mode")


@pytest.fixture(autouse=True)
def in_the_checkouts_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CONFIGS.parent)


def named(caplog: pytest.LogCaptureFixture, *args: str) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert main(["config", "check", *args]) == 0
    warnings = [r.getMessage() for r in caplog.records if "no effect in nrl" in r.getMessage()]
    assert len(warnings) <= 1
    return warnings[0].split("no effect in nrl: ", 1)[1].split(", ") if warnings else []


def test_grpo_math_1b_names_only_keys_the_docs_explain(caplog):
    keys = set(named(caplog, GRPO_1B))
    assert keys and all(key in REASONS for key in keys), [k for k in keys if k not in REASONS]
    assert not keys & set(ACTING)


def test_every_reason_is_in_the_docs_and_every_neutral_key_too():
    docs = (ROOT / "docs" / "configuration.md").read_text()
    for key, why in REASONS.items():
        assert f"| `{key}` | {why} |" in docs, key
    for key, neutral in NEUTRAL.items():
        assert f"| `{key}` |" in docs and neutral.nrl_does in docs, key


def test_settings_of_a_feature_left_off_are_not_named_and_are_once_it_is_on(caplog):
    keys = named(caplog, GRPO_1B)
    # megatron_cfg.enabled, draft.enabled, fp8_cfg.enabled and data_plane.enabled are false; the
    # engine is vLLM, not Megatron's; no NIXL refit; no logger NeMo RL's GPU monitor writes to
    assert not [k for k in keys if k.startswith(("policy.megatron_cfg.", "policy.draft.", "data_plane.",
                                                  "policy.generation.mcore_generation_config.",
                                                  "policy.generation.refit_cfg.nixl."))]
    assert "logger.monitor_gpus" not in keys
    on = named(caplog, GRPO_1B, "logger.tensorboard_enabled=true", "policy.generation.vllm_cfg.async_engine=true")
    assert {"logger.monitor_gpus", "policy.generation.vllm_cfg.enable_vllm_metrics_logger"} <= set(on)


def test_a_value_nrl_does_not_compute_is_refused_in_one_line(capsys):
    assert main(["config", "check", GRPO_1B, "grpo.val_num_generations_per_prompt=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: grpo.val_num_generations_per_prompt: 4 is a NeMo RL feature nrl lacks: in nrl validation "
                   "samples one response per prompt (NeMo RL's 1); set it to 1 or remove it")
    assert main(["config", "check", GRPO_1B, "policy.sequence_packing.microbatch_order=largest_first"]) == 2
    assert re.fullmatch(r"error: policy\.sequence_packing\.microbatch_order: 'largest_first' is a NeMo RL feature "
                        r"nrl lacks: .*", capsys.readouterr().err.strip())
    # NeMo RL's Eagle-3 recipes train a draft model: refused, where it used to be named as inert
    assert main(["config", "check", GRPO_1B, "policy.draft.enabled=true"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: policy.draft.enabled: True is a NeMo RL feature nrl "
                                                      "lacks: in nrl no draft model trains beside the policy")


@pytest.mark.parametrize("start, due", [(-1, [2, 4, 6]), (0, [2, 4, 6]), (3, [4, 6]), (6, [6]), (7, [])])
def test_val_start_at_delays_periodic_validation_as_nemo_rl_does(start, due):
    algorithm = SimpleNamespace(cfg={"val_period": 2, "val_at_end": False, "val_start_at": start}, max_steps=6,
                                val_data=[{"prompt": "x"}])
    assert [s for s in range(1, 7) if AlgorithmRun.validation_due(algorithm, s)] == due
    algorithm.cfg["val_at_end"] = True  # the last step validates whatever val_start_at says, as in NeMo RL
    assert AlgorithmRun.validation_due(algorithm, 6)


def test_safetensors_checkpoints_act_on_dtensor_and_megatron_says_it_keeps_its_own_format(caplog):
    """checkpointing.model_save_format acts where the backend declares safetensors_checkpoints
    (DTensor: not named, no warning); on Megatron, whose format NeMo RL keeps too, one warning."""
    for value, megatron in (("safetensors", False), ("safetensors", True), ("torch_save", True)):
        caplog.clear()
        config = str(CONFIGS / ("grpo_math_1B_megatron.yaml" if megatron else "grpo_math_1B.yaml"))
        with caplog.at_level(logging.WARNING):
            assert main(["config", "check", config, f"checkpointing.model_save_format={value}"]) == 0
        messages = [r.getMessage() for r in caplog.records]
        assert not any("model_save_format" in m and "no effect in nrl" in m for m in messages)
        own = [m for m in messages if m.startswith("checkpointing.model_save_format: the megatron training backend")]
        assert len(own) == (megatron and value == "safetensors"), messages
