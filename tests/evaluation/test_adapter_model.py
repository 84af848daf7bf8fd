"""``nrl eval`` given a LoRA adapter (PEFT's layout, as a LoRA run's ``hf_export`` holds it): the
engines get its base model with the adapter merged in, which computes what the adapter on its base
computes; the merge is written once and reused; an adapter whose base is not here is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")

from nrl_core.errors import ConfigError
from nrl_core.evaluation.config import resolve_model_dir
from nrl_core.testing.tiny_models import cached_tiny_model


def trained_adapter(out: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(cached_tiny_model("llama", size="small")), dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)  # random A and B: as if trained
    model = peft.get_peft_model(base, config)
    model.save_pretrained(str(out))
    return model.eval()


def test_an_adapter_is_merged_into_its_base_once(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    adapted = trained_adapter(tmp_path / "run" / "step_2" / "hf_export")
    merged = Path(resolve_model_dir(str(tmp_path / "run" / "step_2")))  # a checkpoint whose export is an adapter
    assert (merged / "config.json").is_file() and (merged / "tokenizer.json").is_file()
    ids = torch.randint(4, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    plain = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (plain(ids).logits - adapted(ids).logits).abs().max() < 1e-5
    stamp = (merged / "config.json").stat().st_mtime_ns
    assert resolve_model_dir(str(tmp_path / "run" / "step_2" / "hf_export")) == str(merged)
    assert (merged / "config.json").stat().st_mtime_ns == stamp  # reused, not merged again


def test_an_adapter_of_a_base_that_is_not_here_is_one_line(tmp_path: Path) -> None:
    trained_adapter(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as caught:
        resolve_model_dir(str(tmp_path / "adapter"))
    assert "names its base model as" in str(caught.value) and "\n" not in str(caught.value)
