"""The engine's check of a refit manifest against its checkpoint, with multi-token-prediction layers
in the checkpoint (DeepSeek-V3's and GLM's after the last decoder layer, Nemotron-H's under
``mtp.``): trainers never hold them, so a refit that required them was refused every time."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nrl_core.refit import RefitError
from nrl_core.refit.buckets import manifest_of
from nrl_core.testing.tiny_models import cached_tiny_model
from nrl_gen_vllm.checkpoint import check_against_checkpoint, checkpoint_shapes, prediction_layer


@pytest.fixture()
def with_prediction_layers(tmp_path):
    """The tiny DeepSeek-V3 built with a prediction layer (what a twin of a recipe that drafts with
    ``deepseek_mtp`` gets), plus an ``mtp.`` tensor as Nemotron-H and Qwen3.5 name theirs."""
    source = cached_tiny_model("deepseek_v3", num_nextn_predict_layers=1)
    for path in source.iterdir():
        shutil.copy(path, tmp_path / path.name)
    tensors = load_file(str(source / "model.safetensors"))
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.mlp.gate.weight"} <= tensors.keys()  # after layers 0, 1
    decoder = {n: t for n, t in tensors.items() if not n.startswith("model.layers.2.")}
    save_file({**tensors, "mtp.layers.0.norm.weight": torch.ones(64)}, str(tmp_path / "model.safetensors"))
    return tmp_path, decoder


def test_prediction_layers_are_the_engines_own(with_prediction_layers) -> None:
    model_dir, tensors = with_prediction_layers
    shapes = checkpoint_shapes(model_dir)
    assert set(shapes) == set(tensors)  # the decoder's tensors, and only those
    check_against_checkpoint(manifest_of(list(tensors.items())), shapes, str(model_dir))
    dropped = [(n, t) for n, t in tensors.items() if n != "model.layers.1.mlp.gate.weight"]
    with pytest.raises(RefitError, match=r"manifest lacks 1 of the model's weights: model\.layers\.1\.mlp\.gate\.weight"):
        check_against_checkpoint(manifest_of(dropped), shapes, str(model_dir))


@pytest.mark.parametrize("name, layers, ours", [
    ("model.layers.61.eh_proj.weight", 61, True), ("model.layers.60.mlp.gate.weight", 61, False),
    ("mtp.layers.0.mixer.in_proj.weight", 52, True), ("model.language_model.layers.40.x", 40, True),
    ("model.embed_tokens.weight", 61, False), ("lm_head.weight", 61, False)])
def test_which_tensors_are_prediction_layers(name: str, layers: int, ours: bool) -> None:
    assert prediction_layer(name, layers) is ours
