"""A plugin's fault as the user sees it: one line naming the plugin (its distribution and entry
point) and the method, with the exception's own message, and the traceback in a file beside the
run's logs. A plugin raising is a fault of that plugin, not of the core, so the line points at it
instead of ending in forty lines of someone else's stack."""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from nrl_core.errors import NrlError, PluginError, remote_cause

FAULTS_DIR = "faults"
CORE_DISTRIBUTION = "nrl-core"
T = TypeVar("T")


@dataclass(frozen=True)
class PluginOwner:
    """Who provides an object the run calls: ``environment 'math' of nrl-env-math (entry point 'math')``."""

    kind: str
    name: str
    distribution: str
    entry_point: str

    @property
    def is_core(self) -> bool:
        """The core's own built-ins: their faults are the core's bugs, reported with a traceback."""
        return self.distribution == CORE_DISTRIBUTION

    def __str__(self) -> str:
        return f"{self.kind} '{self.name}' of {self.distribution} (entry point '{self.entry_point}')"


def call_plugin(owner: PluginOwner, method: str, log_dir: str | Path | None, function: Callable[..., T],
                *args: Any) -> T:
    """``function(*args)``, a call into ``owner``'s code: what it raises becomes :func:`plugin_fault`'s
    one line, except what is not the plugin's fault to report: an ``NrlError`` (a one-line message
    meant for the user already, or a worker's own report, re-raised as itself from inside Ray's
    wrapper) and anything the core's built-ins raise (the core's bugs keep their traceback)."""
    try:
        return function(*args)
    except Exception as exc:  # noqa: BLE001 - the plugin's fault, in one line naming it
        cause = remote_cause(exc)
        if isinstance(cause, NrlError) and cause is not exc:
            raise cause  # noqa: B904 - the worker's own report, as itself
        if isinstance(cause, NrlError) or owner.is_core:
            raise
        raise plugin_fault(owner, method, exc, log_dir) from exc


def plugin_fault(owner: PluginOwner, method: str, exc: BaseException, log_dir: str | Path | None) -> PluginError:
    """The one-line error for ``exc`` raised by ``owner``'s ``method``; its traceback goes to
    ``<log_dir>/faults/`` (named in the line) when the run has a log directory."""
    where = ""
    if log_dir is not None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        name = re.sub(r"[^\w.-]+", "-", f"{owner.entry_point}-{method}")
        path = Path(log_dir) / FAULTS_DIR / f"{stamp}-{os.getpid()}-{name}.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{owner}: {method}\n" + "".join(traceback.format_exception(exc)))
            where = f"; traceback in {path}"
        except OSError:
            pass
    cause = remote_cause(exc)
    return PluginError(f"{owner}: {method} raised {type(cause).__name__}: {' '.join(str(cause).split())}{where}")


def plugin_answer_error(owner: PluginOwner, method: str, problem: str) -> PluginError:
    """A wrong type or count at the boundary: the method, what came back and what was expected."""
    return PluginError(f"{owner}: {method} {problem}")


class PluginBoundary:
    """The core's side of an object a plugin built (an environment, a loss): its calls go through
    :func:`call_plugin` and its wrong answers through :func:`plugin_answer_error`, both naming
    ``owner`` and the object's class; any other attribute is the plugin's object's, which
    :attr:`plugin_object` holds for type checks of the plugin's own class."""

    def __init__(self, plugin_object: Any, owner: PluginOwner, log_dir: str | Path | None) -> None:
        self.plugin_object = plugin_object
        self._owner = owner
        self._log_dir = str(log_dir) if log_dir is not None else None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "plugin_object" not in self.__dict__:  # copy and pickle probe a bare object
            raise AttributeError(name)
        return getattr(self.plugin_object, name)

    def _call(self, method: str, function: Callable[..., T], *args: Any) -> T:
        return call_plugin(self._owner, self._qualified(method), self._log_dir, function, *args)

    def _wrong(self, method: str, problem: str) -> PluginError:
        return plugin_answer_error(self._owner, self._qualified(method), problem)

    def _qualified(self, method: str) -> str:
        return f"{type(self.plugin_object).__name__}.{method}"
