"""A plugin that declares a future nrl-core: the core must refuse it by version, not crash."""

from nrl_core import hookimpl


@hookimpl
def nrl_algorithms():
    return []
