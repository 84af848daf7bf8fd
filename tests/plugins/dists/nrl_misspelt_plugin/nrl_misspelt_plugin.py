"""A plugin with a misspelt hook name: check_pending must turn it into an error."""

from nrl_core import hookimpl


@hookimpl
def nrl_training_backend():  # the real hook is nrl_training_backends
    return []
