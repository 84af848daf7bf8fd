"""Every :class:`~nrl_core.errors.NrlError` class the installed packages define, and an example of each.

Errors raised in Ray workers reach the driver pickled, so every error class, the core's and every
plugin's, must survive ``pickle``; tests walk all of them rather than a hand-kept list that a new
plugin error would silently escape.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
import re
from pathlib import Path
from typing import Any

from nrl_core.errors import NrlError

__all__ = ["ERROR_PACKAGES", "nrl_error_classes", "example_error"]

#: Packages searched: the core and the first-party plugins (those not installed are skipped).
ERROR_PACKAGES = ("nrl_core", "nrl_backend_dtensor", "nrl_backend_megatron", "nrl_gen_vllm", "nrl_env_math")

_DEFINES_ERROR = re.compile(r"^class \w+\([^)]*Error[^)]*\):", re.M)


def _modules_defining_errors(package: str) -> list[str]:
    """Modules of ``package`` whose source defines an ``...Error`` subclass; only those are
    imported, so discovery does not import every engine module."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return []
    names = [package]
    for info in pkgutil.walk_packages(spec.submodule_search_locations, prefix=package + "."):
        names.append(info.name)
    found = []
    for name in names:
        module_spec = importlib.util.find_spec(name)
        origin = getattr(module_spec, "origin", None)
        if origin and origin.endswith(".py") and _DEFINES_ERROR.search(Path(origin).read_text(encoding="utf-8")):
            found.append(name)
    return found


def nrl_error_classes(packages: tuple[str, ...] = ERROR_PACKAGES) -> list[type[NrlError]]:
    """``NrlError`` and all its subclasses defined in ``packages``, sorted by qualified name."""
    for package in packages:
        for name in _modules_defining_errors(package):
            importlib.import_module(name)
    seen: dict[str, type[NrlError]] = {}
    stack: list[type[NrlError]] = [NrlError]
    while stack:
        cls = stack.pop()
        if cls.__module__.split(".")[0] in packages:
            seen[f"{cls.__module__}.{cls.__qualname__}"] = cls
        stack.extend(cls.__subclasses__())
    return [seen[key] for key in sorted(seen)]


def example_error(cls: type[NrlError]) -> NrlError:
    """An instance of ``cls`` built through its own ``__init__``: every required parameter gets a
    distinct string, and ``remote_traceback``-style attributes a value, so a round trip that
    dropped or reordered anything would show."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for i, p in enumerate(params):
        if p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        value = f"{p.name} {i} of {cls.__name__}"
        if p.kind == p.KEYWORD_ONLY:
            kwargs[p.name] = value
        else:
            args.append(value)
    if not args and not kwargs:
        args = [f"message of {cls.__name__}"]
    exc = cls(*args, **kwargs)
    exc.extra_attribute = f"set on {cls.__name__}"  # type: ignore[attr-defined]
    if hasattr(cls, "remote_traceback"):
        exc.remote_traceback = f"Traceback of {cls.__name__}"  # type: ignore[attr-defined]
    return exc
