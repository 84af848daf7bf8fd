"""The dtensor backend against nrl's conformance kit (nrl_core/testing/conformance)."""

from nrl_core.testing.conformance import training_backend_suite

TestConformance = training_backend_suite("dtensor", overrides=["policy.optimizer.kwargs.lr=1e-3"])
