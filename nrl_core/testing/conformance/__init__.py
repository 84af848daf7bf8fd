"""The conformance kit: the checks every nrl backend must pass, as pytest classes a backend's own
test module adopts in one line each::

    from nrl_core.testing.conformance import training_backend_suite

    TestConformance = training_backend_suite("mine", overrides=["policy.optimizer.kwargs.lr=1e-2"])

What is checked, and why, is in docs/plugins.md. Importing this package imports pytest and the
core's contracts only; torch, transformers and the backend load when the checks run.
"""

from nrl_core.testing.conformance.suites import generation_backend_suite, training_backend_suite

__all__ = ["generation_backend_suite", "training_backend_suite"]
