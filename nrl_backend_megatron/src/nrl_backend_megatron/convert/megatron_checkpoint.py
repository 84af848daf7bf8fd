"""Megatron-Core checkpoints a run starts from, in the layouts users have, checked before loading.

Three layouts hold a ``megatron.core.dist_checkpointing`` directory (``metadata.json``, the
``.metadata`` index and ``*.distcp`` shards) for one iteration:

* **Megatron-LM**: ``latest_checkpointed_iteration.txt`` (a number or ``release``) beside
  ``iter_NNNNNNN/`` (or ``release/``) directories; the training arguments are ``args`` in the
  iteration's ``common.pt``.
* **Megatron-Bridge**: the same ``iter_NNNNNNN/`` directories, each with a ``run_config.yaml``
  whose ``model`` section is the architecture.
* a **bare** dist_checkpointing directory (nrl's own HF conversion among them), which records no
  architecture: the HF config of ``policy.model_name`` is taken as it.

The architecture a layout records is compared with the HF config field by field, and the first
field that differs is one line; so is a shard the index names that is missing or short, and a
stored tensor whose shape is not the model's. Nothing here writes.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nrl_core.api import NrlError

__all__ = ["MegatronCheckpoint", "MegatronCheckpointError", "architecture_of_hf", "check_architecture",
           "check_files", "check_tensors", "locate", "locate_checked", "read_args"]

TRACKER = "latest_checkpointed_iteration.txt"
RUN_CONFIG = "run_config.yaml"
COMMON = "common.pt"
DIST_METADATA = "metadata.json"
INDEX = ".metadata"
ITERATION_DIR = re.compile(r"^iter_(\d+)$")


class MegatronCheckpointError(NrlError):
    """A Megatron checkpoint that cannot be started from as it is."""


@dataclass(frozen=True)
class MegatronCheckpoint:
    """One iteration of a Megatron checkpoint: where dist_checkpointing reads it and what it says
    about the model (``architecture`` is empty for a bare directory)."""

    path: Path
    layout: str
    iteration: int | None
    architecture: dict[str, Any] = field(default_factory=dict)
    source: str = ""


def locate(given: str | Path) -> MegatronCheckpoint:
    """The iteration ``given`` names: a Megatron-LM or Megatron-Bridge checkpoint directory (its
    latest iteration), one of its iteration directories, or a bare dist_checkpointing directory."""
    root = Path(given).expanduser()
    if not root.is_dir():
        raise MegatronCheckpointError(f"Megatron checkpoint {root} does not exist or is not a directory")
    iteration_dir = _iteration_dir(root)
    if not (iteration_dir / DIST_METADATA).is_file():
        raise MegatronCheckpointError(
            f"{iteration_dir} is not a dist_checkpointing directory (no {DIST_METADATA}); the checkpoint is "
            "incomplete, or it was saved in another format (only Megatron-Core's torch_dist is read)")
    backend = _json(iteration_dir / DIST_METADATA).get("sharded_backend")
    if backend != "torch_dist":
        raise MegatronCheckpointError(f"{iteration_dir} was saved with the '{backend}' backend; only torch_dist "
                                      "is read: convert it with Megatron-Core's dist_checkpointing first")
    iteration = _iteration_number(iteration_dir)
    if (iteration_dir / RUN_CONFIG).is_file():
        return MegatronCheckpoint(iteration_dir, "megatron-bridge", iteration,
                                  bridge_architecture(_yaml(iteration_dir / RUN_CONFIG)), f"{RUN_CONFIG} model")
    if (iteration_dir / COMMON).is_file():
        args = read_args(iteration_dir / COMMON)
        if args is not None:
            return MegatronCheckpoint(iteration_dir, "megatron-lm", iteration, megatron_lm_architecture(args),
                                      f"{COMMON} args")
    return MegatronCheckpoint(iteration_dir, "dist_checkpointing", iteration)


def locate_checked(given: str | Path, hf_config: Any, model_name: str) -> MegatronCheckpoint:
    """:func:`locate`, then the recorded architecture against ``hf_config`` (when known) and the
    shard files: everything that can be checked before a model exists."""
    checkpoint = locate(given)
    if hf_config is not None:
        check_architecture(checkpoint, hf_config, model_name)
    check_files(checkpoint)
    return checkpoint


def _iteration_dir(root: Path) -> Path:
    if (root / DIST_METADATA).is_file():
        return root
    tracker = root / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            return root / "release"
        if not text.isdigit():
            raise MegatronCheckpointError(f"{tracker} holds {text[:40]!r}, not an iteration number or 'release'")
        path = root / f"iter_{int(text):07d}"
        if not path.is_dir():
            raise MegatronCheckpointError(f"{tracker} names iteration {int(text)}, but {path.name} is missing from "
                                          f"{root}; the checkpoint is incomplete")
        return path
    iterations = sorted((int(m.group(1)), p) for p in root.iterdir()
                        if p.is_dir() and (m := ITERATION_DIR.match(p.name)) and (p / DIST_METADATA).is_file())
    if iterations:  # Megatron-Bridge's tracker is latest_train_state.pt, a pickle: the newest iteration is enough
        return iterations[-1][1]
    raise MegatronCheckpointError(
        f"{root} is not a Megatron checkpoint (no {DIST_METADATA}, {TRACKER} or iter_NNNNNNN directories); "
        "give the directory Megatron-LM or Megatron-Bridge saved into, or one of its iterations")


def _iteration_number(path: Path) -> int | None:
    match = ITERATION_DIR.match(path.name)
    return int(match.group(1)) if match else None


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MegatronCheckpointError(f"{path} is unreadable ({exc}); the checkpoint is corrupt") from None
    return value if isinstance(value, dict) else {}


def _yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        value = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise MegatronCheckpointError(f"{path} is unreadable ({' '.join(str(exc).split())[:160]})") from None
    return value if isinstance(value, dict) else {}


class _Opaque:
    """Stands in for a class of Megatron's own (an enum, a dataclass) pickled inside ``args``:
    nothing from a checkpoint's pickle runs here, and no field nrl reads is of such a class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


def read_args(common: Path) -> argparse.Namespace | None:
    """``args`` from a Megatron-LM ``common.pt``, loaded with torch's weights-only unpickler: the
    ``argparse.Namespace`` is allowed, any other class in it becomes an inert placeholder."""
    import torch
    from torch.serialization import get_unsafe_globals_in_checkpoint, safe_globals

    try:
        names = [n for n in get_unsafe_globals_in_checkpoint(str(common)) if n != "argparse.Namespace"]
        allowed: list[Any] = [argparse.Namespace, *[(type(n.rpartition(".")[2], (_Opaque,), {}), n) for n in names]]
        with safe_globals(allowed):
            state = torch.load(str(common), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same one-line answer
        raise MegatronCheckpointError(f"{common} is unreadable ({type(exc).__name__}: "
                                      f"{' '.join(str(exc).split())[:160]}); the checkpoint is corrupt") from None
    args = state.get("args") if isinstance(state, dict) else None
    return args if isinstance(args, argparse.Namespace) else None


# Fields compared, in this order, under TransformerConfig's names.
FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
          "vocab_size", "untie_embeddings_and_output_weights", "normalization", "gated_linear_unit", "add_bias_linear",
          "add_qkv_bias", "qk_layernorm", "position_embedding_type", "rotary_base", "norm_epsilon", "num_experts",
          "moe_ffn_hidden_size", "moe_router_topk")


def architecture_of_hf(hf_config: Any) -> dict[str, Any]:
    """What a Megatron checkpoint of the model ``hf_config`` describes must say."""
    from nrl_backend_megatron.convert.families import expert_width, family_of, head_dim, num_experts
    from nrl_backend_megatron.model import _rope_type, rope_theta

    family = family_of(hf_config)
    if family.hybrid:
        raise MegatronCheckpointError(f"Megatron checkpoints of {family.architecture} (Mamba hybrids) are not read or "
                                      "written by nrl; start from the Hugging Face model (policy.model_name)")
    experts = num_experts(hf_config) or None
    heads = hf_config.num_attention_heads
    return {"num_layers": hf_config.num_hidden_layers, "hidden_size": hf_config.hidden_size,
            "num_attention_heads": heads,
            "num_query_groups": getattr(hf_config, "num_key_value_heads", None) or heads,
            "kv_channels": head_dim(hf_config), "ffn_hidden_size": hf_config.intermediate_size,
            "vocab_size": hf_config.vocab_size,
            "untie_embeddings_and_output_weights": not bool(hf_config.tie_word_embeddings),
            "normalization": "RMSNorm", "gated_linear_unit": True, "add_bias_linear": family.gpt_oss,
            "add_qkv_bias": bool(family.qkv_bias), "qk_layernorm": bool(family.qk_norm),
            "position_embedding_type": "yarn" if family.gpt_oss and _rope_type(hf_config) == "yarn" else "rope",
            "rotary_base": rope_theta(hf_config),
            "norm_epsilon": float(hf_config.rms_norm_eps), "num_experts": experts,
            "moe_ffn_hidden_size": expert_width(hf_config) if experts else None,
            "moe_router_topk": getattr(hf_config, "num_experts_per_tok", None) if experts else None}


def megatron_lm_architecture(args: argparse.Namespace) -> dict[str, Any]:
    """The architecture Megatron-LM's training arguments describe (TransformerConfig's names)."""
    a = vars(args)
    heads = a.get("num_attention_heads")
    groups = a.get("num_query_groups") if a.get("group_query_attention") else heads
    kv = a.get("kv_channels") or (a["hidden_size"] // heads if a.get("hidden_size") and heads else None)
    return {"num_layers": a.get("num_layers"), "hidden_size": a.get("hidden_size"), "num_attention_heads": heads,
            "num_query_groups": groups, "kv_channels": kv, "ffn_hidden_size": a.get("ffn_hidden_size"),
            "vocab_size": a.get("padded_vocab_size") or a.get("vocab_size"),
            "untie_embeddings_and_output_weights": a.get("untie_embeddings_and_output_weights"),
            "normalization": a.get("normalization"), "gated_linear_unit": a.get("swiglu"),
            "add_bias_linear": a.get("add_bias_linear"), "add_qkv_bias": a.get("add_qkv_bias"),
            "qk_layernorm": a.get("qk_layernorm"), "position_embedding_type": a.get("position_embedding_type"),
            "rotary_base": a.get("rotary_base"), "norm_epsilon": a.get("norm_epsilon"),
            "num_experts": a.get("num_experts"), "moe_ffn_hidden_size": a.get("moe_ffn_hidden_size") if
            a.get("num_experts") else None, "moe_router_topk": a.get("moe_router_topk") if a.get("num_experts") else None}


def bridge_architecture(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The architecture in Megatron-Bridge's ``run_config.yaml`` (its ``model`` section)."""
    m = run_config.get("model") if isinstance(run_config.get("model"), Mapping) else {}
    share = m.get("share_embeddings_and_output_weights")
    experts = m.get("num_moe_experts")
    return {"num_layers": m.get("num_layers"), "hidden_size": m.get("hidden_size"),
            "num_attention_heads": m.get("num_attention_heads"),
            "num_query_groups": m.get("num_query_groups") or m.get("num_attention_heads"),
            "kv_channels": m.get("kv_channels"), "ffn_hidden_size": m.get("ffn_hidden_size"),
            "vocab_size": m.get("vocab_size"), "untie_embeddings_and_output_weights": None if share is None else not share,
            "normalization": m.get("normalization"), "gated_linear_unit": m.get("gated_linear_unit"),
            "add_bias_linear": m.get("add_bias_linear"), "add_qkv_bias": m.get("add_qkv_bias"),
            "qk_layernorm": m.get("qk_layernorm"), "position_embedding_type": m.get("position_embedding_type"),
            "rotary_base": m.get("rotary_base"), "norm_epsilon": m.get("layernorm_epsilon"), "num_experts": experts,
            "moe_ffn_hidden_size": m.get("moe_ffn_hidden_size") if experts else None,
            "moe_router_topk": m.get("moe_router_topk") if experts else None}


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, float) or isinstance(theirs, float):
        return isinstance(theirs, (int, float)) and isinstance(ours, (int, float)) and \
            math.isclose(float(ours), float(theirs), rel_tol=1e-6)
    return ours == theirs


def check_architecture(checkpoint: MegatronCheckpoint, hf_config: Any, model_name: str) -> None:
    """One line at the first field where the checkpoint's recorded architecture differs from the
    HF config's (a field the checkpoint does not record is not compared)."""
    ours = architecture_of_hf(hf_config)
    for name in FIELDS:
        theirs = checkpoint.architecture.get(name)
        if theirs is None and name not in ("num_experts", "moe_ffn_hidden_size", "moe_router_topk"):
            continue
        if name in ("num_experts", "moe_ffn_hidden_size", "moe_router_topk") and not theirs and not ours[name]:
            continue
        if not _same(ours[name], theirs):
            raise MegatronCheckpointError(
                f"Megatron checkpoint {checkpoint.path} is of another architecture: its {checkpoint.source} has "
                f"{name}={theirs!r}, the HF config of policy.model_name ({model_name}) gives {ours[name]!r}; set "
                "policy.model_name to the model the checkpoint was trained from")


def check_files(checkpoint: MegatronCheckpoint) -> None:
    """Every shard file the checkpoint's index names is there and long enough."""
    from torch.distributed.checkpoint import FileSystemReader

    path = checkpoint.path
    if not (path / INDEX).is_file():
        raise MegatronCheckpointError(f"{path} has no {INDEX} (the index of its shards); the checkpoint is incomplete")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001
        raise MegatronCheckpointError(f"{path / INDEX} is unreadable ({type(exc).__name__}); the checkpoint is "
                                      "corrupt") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), int(info.offset) + int(info.length))
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise MegatronCheckpointError(f"Megatron checkpoint {path} is missing the shard {name} its index names; "
                                          "copy the checkpoint again")
        if shard.stat().st_size < size:
            raise MegatronCheckpointError(f"Megatron checkpoint {path}: shard {name} is truncated "
                                          f"({shard.stat().st_size} bytes, the index needs {size}); copy it again")


def check_tensors(path: Path, sharded_state_dict: Mapping[str, Any], model_name: str) -> None:
    """Every tensor the model needs is stored, at the model's global shape (what tells a bare
    directory of another model apart)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for value in nested_values(sharded_state_dict):
        if not isinstance(value, ShardedTensor):
            continue
        entry = stored.get(value.key)
        if entry is None:
            raise MegatronCheckpointError(
                f"Megatron checkpoint {path} has no tensor '{value.key}', which the model of policy.model_name "
                f"({model_name}) needs; it is a checkpoint of another architecture")
        shape = tuple(getattr(entry, "size", ()) or ())
        if shape and shape != tuple(value.global_shape):
            raise MegatronCheckpointError(
                f"Megatron checkpoint {path} stores '{value.key}' as {shape}, the model of policy.model_name "
                f"({model_name}) needs {tuple(value.global_shape)}; it is a checkpoint of another architecture")
