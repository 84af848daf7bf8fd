"""Where the one-time HF→Megatron conversion lives, and the conversion's life cycle.

Resolution order of the root: ``NRL_MEGATRON_CHECKPOINT_DIR`` (set and not blank), else
``$HF_HOME/nemo_rl``, else ``~/.cache/huggingface/nemo_rl`` (NeMo RL's location, so both tools
share conversions). One subdirectory per model: a hub id as nested folders (``Qwen/Qwen3-0.6B``),
a local path as ``model_`` plus the path with separators replaced, and ``-<hash>`` of
``hf_config_overrides`` when there are any.

Why the ceremony: conversions are slow for real models and shared by concurrent runs and ranks.
A file lock serialises converters; a conversion is written into a temporary directory beside the
target and renamed into place, with a completion marker written last, so a crash never leaves a
directory that looks complete; an existing good conversion is only replaced after the new one is
complete. Anything else found at the target (no marker, truncated files, another model) is a
one-line :class:`CheckpointDirError`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from nrl_core.errors import NrlError

logger = logging.getLogger(__name__)

ENV_VAR = "NRL_MEGATRON_CHECKPOINT_DIR"
MARKER = "nrl_conversion_complete.json"
WEIGHTS = "model.safetensors"
FORMAT_VERSION = 1


class CheckpointDirError(NrlError):
    """A converted checkpoint that cannot be used as it is."""


def checkpoint_root(environ: Mapping[str, str] | None = None) -> Path:
    """The root directory of converted checkpoints (see the module docstring for the order)."""
    env = os.environ if environ is None else environ
    explicit = env.get(ENV_VAR, "")
    if explicit.strip():
        return Path(explicit).expanduser()
    hf_home = env.get("HF_HOME", "")
    if hf_home.strip():
        return Path(hf_home).expanduser() / "nemo_rl"
    return Path(env.get("HOME") or Path.home()).expanduser() / ".cache" / "huggingface" / "nemo_rl"


def overrides_hash(overrides: Mapping[str, Any] | None) -> str | None:
    """Short stable hash of ``hf_config_overrides`` (None when there are none)."""
    if not overrides:
        return None
    return hashlib.sha256(json.dumps(overrides, sort_keys=True, default=str).encode()).hexdigest()[:8]


def model_subdir(model_name: str, overrides: Mapping[str, Any] | None = None) -> Path:
    """The per-model subdirectory (relative to the root)."""
    is_local = os.path.isabs(model_name) or model_name.startswith(".") or os.path.exists(model_name)
    if is_local:
        flat = os.path.abspath(model_name).strip(os.sep).replace(os.sep, "_")
        if os.altsep:
            flat = flat.replace(os.altsep, "_")
        rel = Path("model_" + flat)
    else:
        rel = Path(*[p for p in model_name.split("/") if p])
    digest = overrides_hash(overrides)
    return rel.with_name(f"{rel.name}-{digest}") if digest else rel


def converted_dir(model_name: str, overrides: Mapping[str, Any] | None = None,
                  environ: Mapping[str, str] | None = None) -> Path:
    return checkpoint_root(environ) / model_subdir(model_name, overrides)


@dataclass(frozen=True)
class Conversion:
    """Where the converted checkpoint is, and whether this call wrote it."""

    path: Path
    converted: bool


def identity(model_name: str, hf_config: Mapping[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a conversion records about its source, to recognise a checkpoint of another model."""
    return {"format_version": FORMAT_VERSION, "model_name": model_name, "overrides_hash": overrides_hash(overrides),
            "config_sha": hashlib.sha256(json.dumps(hf_config, sort_keys=True, default=str).encode()).hexdigest()[:16]}


def verify(path: Path, expected: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Check a converted directory: marker present, same model, weights complete. One-line errors."""
    hint = "delete it or set policy.megatron_cfg.force_reconvert_from_hf: true"
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointDirError(f"converted checkpoint {path} is incomplete (no {MARKER}); {hint}")
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        raise CheckpointDirError(f"converted checkpoint {path} has an unreadable {MARKER}; {hint}") from None
    for key in ("format_version", "model_name", "overrides_hash", "config_sha"):
        if meta.get(key) != expected.get(key):
            raise CheckpointDirError(
                f"converted checkpoint {path} is from another model ({key}: {meta.get(key)!r}, expected "
                f"{expected.get(key)!r}); {hint}")
    weights = path / WEIGHTS
    if not weights.is_file() or weights.stat().st_size != meta.get("weights_bytes"):
        raise CheckpointDirError(f"converted checkpoint {path} is corrupt ({WEIGHTS} missing or truncated); {hint}")
    try:
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as f:
            stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception:  # noqa: BLE001 - any parse failure means the same thing to the user
        raise CheckpointDirError(f"converted checkpoint {path} is corrupt ({WEIGHTS} unreadable); {hint}") from None
    if stored != dict(shapes):
        raise CheckpointDirError(f"converted checkpoint {path} does not match the model's tensors; {hint}")


def ensure_converted(target: Path, expected: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]],
                     write: Callable[[Path], None], *, force: bool = False) -> Conversion:
    """Return a verified conversion at ``target``, writing it with ``write(tmpdir)`` if needed.

    ``write`` fills a fresh directory with ``model.safetensors``; the marker is added here, last.
    Safe to call from every rank and from concurrent runs: the first converts, the others wait on
    the lock and then reuse.
    """
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if target.exists() and not force:
            verify(target, expected, shapes)
            return Conversion(target, converted=False)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
        try:
            write(tmp)
            meta = {**expected, "weights_bytes": (tmp / WEIGHTS).stat().st_size}
            (tmp / MARKER).write_text(json.dumps(meta, indent=1))
            verify(tmp, expected, shapes)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        backup = None
        if target.exists():
            backup = target.with_name(f".{target.name}.old-{os.getpid()}")
            target.rename(backup)
        tmp.rename(target)
        if backup is not None:
            shutil.rmtree(backup, ignore_errors=True)
        logger.info("converted HF checkpoint into Megatron format at %s", target)
        return Conversion(target, converted=True)
