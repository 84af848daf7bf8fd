"""Errors that reach users as one line.

Every user-facing failure in nrl (a bad config value, a missing plugin, an unreadable checkpoint)
is an :class:`NrlError`. The CLI prints ``error: <message>`` and exits 2 for these, so each message
must stand alone: what was wrong, where, and how to fix it.

Many of these are raised inside Ray workers (a backend refusing its optimizer, an engine refusing
its ``max_model_len``) and travel to the driver pickled. Python pickles an exception as
``cls(*self.args)``, which breaks for any subclass whose ``__init__`` takes other arguments than
its message (``ConfigError(key_path, message)``): Ray would hand the driver an
``UnserializableException`` instead of the message. :class:`NrlError` therefore pickles itself
without calling ``__init__``, so every subclass, in the core or in a plugin, round-trips as it is.
"""

from __future__ import annotations

from typing import Any


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """Unpickle an :class:`NrlError`: the same class, ``args`` and attributes, ``__init__`` skipped."""
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class NrlError(Exception):
    """Base class of errors whose message is meant for the user, not a traceback."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args, dict(self.__dict__))


class ConfigError(NrlError):
    """A configuration problem at ``key_path`` (dotted, e.g. ``policy.optimizer.name``)."""

    def __init__(self, key_path: str, message: str) -> None:
        self.key_path = key_path
        self.message = message
        super().__init__(f"{key_path}: {message}" if key_path else message)


class PluginError(NrlError):
    """A plugin failed to load, registered something invalid, or a requested one is missing."""


class WorkerError(NrlError):
    """A remote worker died or raised; the message names the worker and its last log lines."""


class WorkerRaisedError(WorkerError):
    """A worker method raised something that is not an :class:`NrlError`: a bug, not a user mistake.

    ``__cause__`` is the remote exception and ``remote_traceback`` its trace, which the CLI prints
    (exit 1) instead of the one line it prints for user errors.
    """

    remote_traceback: str = ""


def remote_cause(exc: BaseException) -> BaseException:
    """The exception raised in another process, inside Ray's wrapper (Ray keeps it as ``.cause``
    when it unpickles); ``exc`` itself when it is not wrapped."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def first_line(exc: BaseException) -> str:
    """``Type: message`` from the first meaningful line of an exception's text, for one-line
    errors about a failure in another process (Ray wraps the worker's traceback in its text)."""
    for line in str(exc).strip().splitlines():
        line = line.strip()
        if line and not line.startswith("Traceback") and set(line) != {"="}:
            return f"{type(exc).__name__}: {line}"
    return type(exc).__name__
