"""Breaks one public method on purpose, in every process of a test run, for
``scripts/check_quick_tier.py``: the quick tier must fail when any distribution is broken.

``NRL_TEST_BREAK=package.module:Qualified.name`` (with this directory on ``PYTHONPATH``, which
nrl forwards to its workers) replaces that attribute, when its module is first imported, with a
function that raises. Python imports ``sitecustomize`` at every interpreter's start; this one does
nothing else.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys

TARGET = os.environ.get("NRL_TEST_BREAK", "")


class _Breaker(importlib.abc.MetaPathFinder):
    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001, ANN201 - the finder protocol
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)
        try:
            from importlib.util import find_spec

            spec = find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_break(module):  # noqa: ANN001, ANN202
            exec_module(module)
            owner = module
            *path_, attr = self.name.split(".")
            for part in path_:
                owner = getattr(owner, part)
            original = getattr(owner, attr)

            @functools.wraps(original)
            def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                raise RuntimeError(f"{TARGET} is broken on purpose (NRL_TEST_BREAK)")

            setattr(owner, attr, broken)

        spec.loader.exec_module = exec_and_break  # type: ignore[method-assign]
        return spec


if ":" in TARGET:
    sys.meta_path.insert(0, _Breaker(*TARGET.split(":", 1)))
