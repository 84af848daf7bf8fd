"""Print, one per line as ``name==version``, what the GPU acceptance run imports beyond PyTorch,
taken from the environment this runs in: megatron-core, transformers, Ray, the math environment's
verifier, nrl's own small dependencies (and setuptools, which installs the checkout), and
everything they require, less PyTorch and whatever PyTorch itself requires (the GPU machine has
those). ``scripts/gpu_check.sh --download-wheels`` downloads exactly these."""

from __future__ import annotations

import re
from importlib import metadata

ROOTS = ("megatron-core", "transformers", "safetensors", "tokenizers", "pluggy", "PyYAML", "filelock", "numpy",
         "packaging", "ray", "math-verify", "rich", "tensorboard", "matplotlib", "setuptools")


def _name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _closure(roots: tuple[str, ...] | list[str]) -> set[str]:
    """Installed distributions ``roots`` need (unconditional requirements only), by normalised name."""
    seen: set[str] = set()
    todo = [r.lower() for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        todo.extend(_name(r) for r in dist.requires or [] if "extra ==" not in r)
    return seen


def requirements() -> list[str]:
    with_torch = _closure(["torch"])
    needed = sorted(_closure(ROOTS) - with_torch)
    return [f"{metadata.distribution(n).metadata['Name']}=={metadata.version(n)}" for n in needed]


if __name__ == "__main__":
    print("\n".join(requirements()))
