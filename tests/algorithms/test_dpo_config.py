"""The ``dpo`` section: NeMo RL's keys and defaults, and the configs DPO refuses before a run starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from nrl_core.algorithms.installed import load_and_validate
from nrl_core.cli import main
from nrl_core.errors import ConfigError
from nrl_core.plugins import get_plugin_manager

CONFIG = str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "dpo_tiny_cpu.yaml")

# examples/configs/dpo.yaml of NVIDIA-NeMo/RL (its dpo section; sft_average_log_probs follows
# preference_average_log_probs there, through an interpolation)
NEMO_RL_DEFAULTS = {"max_num_epochs": 1, "max_num_steps": 150, "val_period": 25, "val_batches": 8,
                    "val_global_batch_size": 8, "val_micro_batch_size": 1, "val_at_start": True, "val_at_end": False,
                    "seed": 42, "reference_policy_kl_penalty": 0.05, "preference_average_log_probs": False,
                    "sft_average_log_probs": False, "preference_loss_weight": 1.0, "sft_loss_weight": 0.0}


def test_section_defaults_are_nemo_rls(tmp_path):
    (tmp_path / "dpo.yaml").write_text(f"defaults: {CONFIG}\n")
    config = load_and_validate(str(tmp_path / "dpo.yaml"), ["~dpo"])
    assert config["dpo"] == NEMO_RL_DEFAULTS


def test_nrl_train_dpo_is_registered_and_config_check_needs_no_engine(capsys):
    assert "dpo" in get_plugin_manager().algorithms().names()
    assert main(["config", "check", CONFIG]) == 0
    assert "generation backend: none" in capsys.readouterr().out


@pytest.mark.parametrize("overrides, message", [
    (["policy.dynamic_batching.enabled=true", "policy.dynamic_batching.train_mb_tokens=64"],
     "^policy.dynamic_batching.enabled: DPO keeps each \\(chosen, rejected\\) pair in one micro-batch"),
    (["policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=64"],
     "^policy.sequence_packing.enabled: DPO keeps each"),
    (["dpo.preference_loss_weight=0"], "^dpo.preference_loss_weight: and dpo.sft_loss_weight are both 0"),
    (["dpo.reference_policy_kl_penalty=-1"], "^dpo.reference_policy_kl_penalty: "),
    (["dpo.preference_los_weight=1"], "^dpo.preference_los_weight: unknown key"),
])
def test_bad_dpo_configs_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_and_validate(CONFIG, overrides, algorithm="dpo")
    assert "\n" not in str(info.value)
