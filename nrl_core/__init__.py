"""nrl: reinforcement-learning post-training for language models, as a small core and plugins."""

from nrl_core.contracts import CheckpointOptions
from nrl_core.errors import ConfigError, NrlError, PluginError
from nrl_core.hookspecs import hookimpl

__all__ = ["CheckpointOptions", "ConfigError", "NrlError", "PluginError", "hookimpl"]
__version__ = "1.27.0"
