"""The engine's own view of which weights a refit must deliver: its checkpoint's tensors.

The manifest comes from the training side; checking it against the checkpoint the engine was
built from catches a training backend that names or shapes weights wrongly *consistently* (in
both the manifest and the tensors), which the manifest check alone cannot see, before vLLM's
loader would fail halfway through a model.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nrl_core.api import RefitError, WeightSpec

_OPTIONAL = ("lm_head.weight",)  # dropped from checkpoints with tied embeddings, still in state_dicts
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_shapes(model_dir: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every tensor in the directory's safetensors files (headers only) that a
    refit carries: not the multi-token-prediction layers (:func:`prediction_layer`)."""
    from safetensors import safe_open

    root = Path(model_dir)
    files = sorted(root.glob("*.safetensors"))
    config = _config(root)
    layers = config.get("num_hidden_layers", (config.get("text_config") or {}).get("num_hidden_layers"))
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if not prediction_layer(key, layers):
                    shapes[key] = tuple(int(d) for d in f.get_slice(key).get_shape())
    return shapes


_DECODER_LAYER = re.compile(r"^(?:model\.|model\.language_model\.)?layers\.(\d+)\.")


def prediction_layer(name: str, num_hidden_layers: int | None) -> bool:
    """Whether a checkpoint tensor belongs to a multi-token-prediction layer: DeepSeek-V3's and
    GLM's after the decoder's last (``model.layers.<num_hidden_layers + k>``), Nemotron-H's and
    Qwen3.5's under ``mtp.``. Trainers load no such layer (transformers drops them), so refits never
    carry them; vLLM's speculative decoding (``deepseek_mtp`` and its kin) drafts with the ones it
    read from the checkpoint, as in NeMo RL. A refit that required them was refused every time."""
    if name.startswith("mtp.") or ".mtp." in name:
        return True
    match = _DECODER_LAYER.match(name)
    return bool(match and num_hidden_layers is not None and int(match.group(1)) >= int(num_hidden_layers))


def _config(root: Path) -> dict[str, Any]:
    """A model directory's ``config.json``; empty when it has none."""
    try:
        return json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return {}


#: Architectures whose vLLM loader (0.32) reads a quantized checkpoint's experts in their packed
#: format only: a refit of trained, unquantized weights cannot fill them.
PACKED_QUANTIZED_EXPERTS = frozenset({"GptOssForCausalLM"})


def check_reloadable(served: Mapping[str, Any]) -> None:
    """Raise :class:`RefitError` before anything loads when the model vLLM built (its class and
    quantization method, the extension's ``nrl_served_model``) is one a refit cannot fill: gpt-oss
    served from a quantized checkpoint."""
    architecture, quantization = served.get("architecture"), served.get("quantization")
    if architecture in PACKED_QUANTIZED_EXPERTS and quantization:
        raise RefitError(f"refit rejected, weights unchanged; vLLM's {architecture} loader takes this checkpoint's "
                         f"experts in {quantization} only (its quantization_config), and a refit sends trained, "
                         "unquantized weights; start the engine from an unquantized copy of the checkpoint "
                         "(its experts in bfloat16)")


def _tied(model_dir: str | os.PathLike[str]) -> bool:
    return bool(_config(Path(model_dir)).get("tie_word_embeddings", False))


def check_against_checkpoint(manifest: list[WeightSpec], checkpoint: dict[str, tuple[int, ...]],
                             model_dir: str) -> None:
    """Raise :class:`RefitError` if ``manifest`` leaves out, adds or reshapes checkpoint tensors."""
    if not checkpoint:
        return  # not a safetensors checkpoint: nothing to compare with
    names = {spec.name for spec in manifest}
    optional = set(_OPTIONAL) if _tied(model_dir) else set()
    missing = sorted(n for n in checkpoint if n not in names)
    unknown = sorted(n for n in names if n not in checkpoint and n not in optional and not n.endswith(_IGNORED_SUFFIXES))
    reshaped = sorted(f"{s.name} (got {list(s.shape)}, the engine's model has {list(checkpoint[s.name])})"
                      for s in manifest if s.name in checkpoint and tuple(s.shape) != checkpoint[s.name])
    if not (missing or unknown or reshaped):
        return
    parts = []
    if missing:
        parts.append(f"the manifest lacks {len(missing)} of the model's weights: {', '.join(missing[:8])}")
    if unknown:
        parts.append(f"the model has no weights named: {', '.join(unknown[:8])}")
    if reshaped:
        parts.append(f"wrong shape for this model: {', '.join(reshaped[:8])}")
    raise RefitError("refit rejected, weights unchanged; " + "; ".join(parts), missing=missing, extra=unknown,
                     mismatched=[r.split(" ")[0] for r in reshaped])
