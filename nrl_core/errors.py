"""Errors that reach users as one line.

Every user-facing failure in nrl (a bad config value, a missing plugin, an unreadable checkpoint)
is an :class:`NrlError`. The CLI prints ``error: <message>`` and exits 2 for these, so each message
must stand alone: what was wrong, where, and how to fix it.
"""

from __future__ import annotations


class NrlError(Exception):
    """Base class of errors whose message is meant for the user, not a traceback."""


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
