"""The docs backend against nrl's conformance kit (run against the installed distribution)."""

from nrl_core.testing.conformance import training_backend_suite

TestConformance = training_backend_suite("docs", overrides=["policy.optimizer.kwargs.lr=1e-3"])
