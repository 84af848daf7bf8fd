"""A plugin's fault as the user sees it: one line naming the plugin (its distribution and entry
point) and the method, with the exception's own message, and the traceback in a file beside the
run's logs. A plugin raising is a fault of that plugin, not of the core, so the line points at it
instead of ending in forty lines of someone else's stack."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from nrl_core.errors import PluginError, first_line

FAULTS_DIR = "faults"


@dataclass(frozen=True)
class PluginOwner:
    """Who provides an object the run calls: ``environment 'math' of nrl-env-math (entry point 'math')``."""

    kind: str
    name: str
    distribution: str
    entry_point: str

    def __str__(self) -> str:
        return f"{self.kind} '{self.name}' of {self.distribution} (entry point '{self.entry_point}')"


def plugin_fault(owner: PluginOwner, method: str, exc: BaseException, log_dir: str | Path | None) -> PluginError:
    """The one-line error for ``exc`` raised by ``owner``'s ``method``; its traceback goes to
    ``<log_dir>/faults/`` (named in the line) when the run has a log directory."""
    where = ""
    if log_dir is not None:
        path = Path(log_dir) / FAULTS_DIR / f"{time.strftime('%Y%m%d-%H%M%S')}-{owner.entry_point}-{method}.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{owner}: {method}\n" + "".join(traceback.format_exception(exc)))
            where = f"; traceback in {path}"
        except OSError:
            pass
    message = first_line(exc) if _remote(exc) else f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return PluginError(f"{owner}: {method} raised {message}{where}")


def plugin_answer_error(owner: PluginOwner, method: str, problem: str) -> PluginError:
    """A wrong type or count at the boundary: the method, what came back and what was expected."""
    return PluginError(f"{owner}: {method} {problem}")


def _remote(exc: BaseException) -> bool:
    """Ray wraps an actor's exception in its own, whose text starts with the remote traceback."""
    return type(exc).__module__.startswith("ray.")
