"""The example backend against nrl's conformance kit: the three lines every backend's tests start with."""

from nrl_core.testing.conformance import training_backend_suite

TestConformance = training_backend_suite("example", overrides=["policy.optimizer.kwargs.lr=1e-3"])
