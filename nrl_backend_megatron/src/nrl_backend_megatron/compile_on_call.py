"""Where torch is built without CUDA, Megatron-Core's fused functions compile on their first call, not at import.

Why: ``megatron.core.jit`` makes ``torch.compile`` its ``jit_fuser``, and the modules that import
Megatron-Core's package decorate their fused element-wise functions with it. Each decoration
imports TorchDynamo's frame conversion and Inductor's compiler, a large part of the CPU time every
process that imports Megatron-Core spends before it does anything, while the CPU paths nrl runs
never call those functions. ``torch.compile`` compiles on the first call anyway, so a decorator
that calls it then computes the same; only the import is cheaper.

:func:`install` adds a finder that wraps the loading of ``megatron.core.jit`` alone; it does
nothing where torch is built for CUDA or ROCm (decided from the build, not by asking the driver,
which would start CUDA in a process that may still fork), or once that module has been imported.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

JIT_MODULE = "megatron.core.jit"


def compiled_on_first_call(compile_now: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for ``torch.compile`` whose result calls ``compile_now`` with the same arguments
    on its first call; what is not a plain function is compiled at once."""

    def compile_later(model: Any = None, **options: Any) -> Any:
        if model is None:  # used as ``@torch.compile(...)``
            return lambda fn: compile_later(fn, **options)
        if not inspect.isfunction(model):
            return compile_now(model, **options)
        compiled: Callable[..., Any] | None = None

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)

        return first_call_compiles

    return compile_later


class _JitLoader(importlib.abc.Loader):
    """Runs ``megatron.core.jit`` with ``torch.compile`` replaced, so its ``jit_fuser`` compiles late."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        import torch

        if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
            self.loader.exec_module(module)
            return
        real = torch.compile
        torch.compile = compiled_on_first_call(real)  # type: ignore[assignment]
        try:
            self.loader.exec_module(module)
        finally:
            torch.compile = real  # type: ignore[assignment]


class _JitFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as the other finders would, and wraps its loader."""

    nrl_jit_finder = True  # how another copy of this class (a reloaded module) is recognised

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != JIT_MODULE:
            return None
        for finder in sys.meta_path:
            if getattr(finder, "nrl_jit_finder", False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _JitLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Put the finder first on ``sys.meta_path`` unless Megatron-Core's jit module is already imported."""
    if JIT_MODULE in sys.modules or any(getattr(finder, "nrl_jit_finder", False) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _JitFinder())
