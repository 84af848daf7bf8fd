"""A plugin's fault as the user sees it: one line naming the plugin (its distribution and entry
point) and the method, with the exception's own message, and the traceback in a file beside the
run's logs. A plugin raising is a fault of that plugin, not of the core, so the line points at it
instead of ending in forty lines of someone else's stack."""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from nrl_core.errors import NrlError, PluginError

FAULTS_DIR = "faults"
CORE_DISTRIBUTION = "nrl-core"


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


def reraise_unless_plugin_fault(owner: PluginOwner, exc: Exception) -> None:
    """Re-raise what is not a plugin's fault to report: an ``NrlError`` (a one-line message meant for
    the user already, or a worker's own report) and anything the core's built-ins raise."""
    if owner.is_core or isinstance(exc, NrlError) or isinstance(_cause(exc), NrlError):
        raise _cause(exc) if isinstance(_cause(exc), NrlError) else exc


def plugin_fault(owner: PluginOwner, method: str, exc: BaseException, log_dir: str | Path | None) -> PluginError:
    """The one-line error for ``exc`` raised by ``owner``'s ``method``; its traceback goes to
    ``<log_dir>/faults/`` (named in the line) when the run has a log directory."""
    where = ""
    if log_dir is not None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        path = Path(log_dir) / FAULTS_DIR / f"{stamp}-{os.getpid()}-{owner.entry_point}-{method}.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{owner}: {method}\n" + "".join(traceback.format_exception(exc)))
            where = f"; traceback in {path}"
        except OSError:
            pass
    cause = _cause(exc)
    return PluginError(f"{owner}: {method} raised {type(cause).__name__}: {' '.join(str(cause).split())}{where}")


def plugin_answer_error(owner: PluginOwner, method: str, problem: str) -> PluginError:
    """A wrong type or count at the boundary: the method, what came back and what was expected."""
    return PluginError(f"{owner}: {method} {problem}")


def _cause(exc: BaseException) -> BaseException:
    """The plugin's own exception inside Ray's wrapper (an actor's error arrives as ``.cause``)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc
