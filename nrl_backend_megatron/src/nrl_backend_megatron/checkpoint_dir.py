"""Where the one-time HF→Megatron conversion lives, and the conversion's life cycle.

Resolution order of the root: ``NRL_MEGATRON_CHECKPOINT_DIR`` (set and not blank), else
``$HF_HOME/nemo_rl``, else ``~/.cache/huggingface/nemo_rl`` (NeMo RL's location and order). One
model directory per model: a hub id as nested folders (``Qwen/Qwen3-0.6B``, NeMo RL's name too), a
local path as ``model_`` plus the absolute path with separators replaced, and ``-<hash>`` of
``hf_config_overrides`` when there are any. nrl's conversion is the ``nrl_megatron`` folder inside
it; NeMo RL's own conversion of the same model may be the ``iter_0000000`` folder beside it.
Neither tool reads, replaces or deletes the other's.

The conversion is a sharded Megatron checkpoint (``megatron.core.dist_checkpointing``, see
:mod:`nrl_backend_megatron.convert.sharded`): rank 0 writes it once, every rank of any parallel
layout reads only its own part. The directory must therefore be one that *every node* sees; a
rank that cannot see the finished conversion fails in one line naming the directory and
``NRL_MEGATRON_CHECKPOINT_DIR`` instead of converting again behind the user's back.

Why the ceremony: conversions are slow for real models and shared by concurrent runs and ranks.
A file lock serialises converters; a conversion is written into a temporary directory beside the
target and renamed into place, with a completion marker (listing every file and its size) written
last, so a crash never leaves a directory that looks complete; an existing good conversion is only
replaced after the new one is complete. Anything else found at the target (no marker, truncated or
missing files, another model) is a one-line :class:`CheckpointDirError`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nrl_core.api import NrlError

logger = logging.getLogger(__name__)

ENV_VAR = "NRL_MEGATRON_CHECKPOINT_DIR"
MARKER = "nrl_conversion_complete.json"
CONVERSION_DIRNAME = "nrl_megatron"
NEMO_RL_DIRNAME = "iter_0000000"  # what NeMo RL's converter writes into the same model directory
DIST_METADATA = "metadata.json"  # megatron.core.dist_checkpointing's own "this is a checkpoint" file
FORMAT_VERSION = 2  # 1: one full model.safetensors (every rank read all of it); 2: sharded, in one or in parts
PARTS = "parts.json"  # a conversion saved part by part: each part's directory and the keys it holds


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
    """nrl's conversion of ``model_name``: ``<root>/<model dir>/nrl_megatron``."""
    return checkpoint_root(environ) / model_subdir(model_name, overrides) / CONVERSION_DIRNAME


def nemo_rl_conversion(target: Path) -> Path | None:
    """NeMo RL's conversion of the same model beside nrl's (``iter_0000000``), if there is one."""
    theirs = target.parent / NEMO_RL_DIRNAME
    return theirs if theirs.is_dir() else None


@dataclass(frozen=True)
class Conversion:
    """Where the converted checkpoint is, and whether this call wrote it."""

    path: Path
    converted: bool


def identity(model_name: str, hf_config: Mapping[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a conversion records about its source, to recognise a checkpoint of another model."""
    return {"format_version": FORMAT_VERSION, "model_name": model_name, "overrides_hash": overrides_hash(overrides),
            "config_sha": hashlib.sha256(json.dumps(hf_config, sort_keys=True, default=str).encode()).hexdigest()[:16]}


def _files(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()
            and p.name != MARKER}


def verify(path: Path, expected: Mapping[str, Any]) -> None:
    """Check a converted directory: marker present, same model, every file there at its size."""
    hint = "delete it or set policy.megatron_cfg.force_reconvert_from_hf: true"
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointDirError(f"converted checkpoint {path} is incomplete (no {MARKER}); {hint}")
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        raise CheckpointDirError(f"converted checkpoint {path} has an unreadable {MARKER}; {hint}") from None
    for key in expected:
        if meta.get(key) != expected.get(key):
            raise CheckpointDirError(
                f"converted checkpoint {path} is from another model or format ({key}: {meta.get(key)!r}, expected "
                f"{expected.get(key)!r}); {hint}")
    recorded = meta.get("files") or {}
    found = _files(path)
    bad = sorted(name for name, size in recorded.items() if found.get(name) != size)
    required = [DIST_METADATA]
    if PARTS in recorded and not bad:
        try:
            required = [f"{part['dir']}/{DIST_METADATA}" for part in json.loads((path / PARTS).read_text())["parts"]]
        except (OSError, ValueError, KeyError, TypeError):
            bad = [PARTS]
    missing = bad or [name for name in required if name not in recorded]
    if missing:
        raise CheckpointDirError(f"converted checkpoint {path} is corrupt ({missing[0]} missing or truncated); {hint}")


def require_converted(target: Path, expected: Mapping[str, Any], rank: int) -> Conversion:
    """On a rank that did not convert: the conversion rank 0 finished must be visible from here."""
    if not (target / MARKER).is_file():
        raise CheckpointDirError(
            f"rank {rank} on {socket.gethostname()} cannot see the converted checkpoint {target} that rank 0 "
            f"finished; every node must see the same directory: set {ENV_VAR} (or HF_HOME) to a path shared by "
            "all nodes (NFS, Docker -v, SLURM container mounts)")
    verify(target, expected)
    return Conversion(target, converted=False)


def ensure_converted(target: Path, expected: Mapping[str, Any], write: Callable[[Path], None], *,
                     force: bool = False) -> Conversion:
    """Return a verified conversion at ``target``, writing it with ``write(tmpdir)`` if needed.

    ``write`` fills a fresh directory with the checkpoint; the marker is added here, last. Safe
    for concurrent runs: the first converts, the others wait on the lock and then reuse. Only
    ``target`` is ever replaced: a NeMo RL conversion beside it is left alone.
    """
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if target.exists() and not force:
            verify(target, expected)
            return Conversion(target, converted=False)
        theirs = nemo_rl_conversion(target)
        if theirs is not None:
            logger.info("a NeMo RL conversion is at %s; nrl writes its own beside it and leaves that one alone", theirs)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would hide it from other users of a shared directory
        try:
            write(tmp)
            meta = {**expected, "files": _files(tmp)}
            (tmp / MARKER).write_text(json.dumps(meta, indent=1))
            verify(tmp, expected)
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
        logger.info("converted HF checkpoint into a sharded Megatron checkpoint at %s", target)
        return Conversion(target, converted=True)
