"""A LoRA adapter given as the model to evaluate: merged into its base model once, with PEFT.

The generation engines load plain Hugging Face directories, so an adapter directory (PEFT's
``adapter_config.json`` and ``adapter_model.safetensors``, what a LoRA run's ``hf_export`` holds)
becomes its base model with the adapter merged in, written under the system's temporary directory
in a folder named by the adapter's and the base's contents, and reused from there.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from nrl_core.errors import ConfigError

__all__ = ["ADAPTER_CONFIG", "is_adapter", "merged_model_dir"]

ADAPTER_CONFIG = "adapter_config.json"
KEY = "policy.model_name"


def is_adapter(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file()


def _base_of(adapter: Path) -> str:
    try:
        base = json.loads((adapter / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError):
        raise ConfigError(KEY, f"{adapter / ADAPTER_CONFIG} is unreadable; the adapter is incomplete") from None
    if not base or not (Path(base) / "config.json").is_file():
        raise ConfigError(KEY, f"the LoRA adapter {adapter} names its base model as {base!r}, which is not a Hugging "
                               f"Face directory here; set base_model_name_or_path in its {ADAPTER_CONFIG}")
    return str(base)


def _fingerprint(adapter: Path, base: str) -> str:
    digest = hashlib.sha256()
    for path in sorted([*adapter.iterdir(), *(p for p in Path(base).iterdir() if p.suffix in (".json", ".safetensors"))]):
        if path.is_file():
            digest.update(f"{path.name}:{path.stat().st_size}:{path.stat().st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def merged_model_dir(adapter: Path) -> Path:
    """The base model of ``adapter`` with the adapter merged in (written once, then reused)."""
    try:
        from peft import PeftModel
    except ImportError:
        raise ConfigError(KEY, f"{adapter} is a LoRA adapter; evaluating it merges it into its base model with PEFT, "
                               "which is not installed: pip install peft") from None
    from transformers import AutoModelForCausalLM

    from nrl_core.sdk.hf_export import TOKENIZER_FILES, copy_tokenizer

    base = _base_of(adapter)
    target = Path(tempfile.gettempdir()) / f"nrl-merged-{adapter.name}-{_fingerprint(adapter, base)}"
    if (target / "config.json").is_file():
        return target
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
        merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
        merged.save_pretrained(str(tmp))
        has_tokenizer = any((adapter / name).is_file() for name in TOKENIZER_FILES)
        copy_tokenizer(str(adapter if has_tokenizer else base), tmp)
        del model, merged
        tmp.rename(target)
    except FileExistsError:  # another process merged it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
