"""The first-contract backend against today's conformance kit, adapted by the core."""

from nrl_core.testing.conformance import training_backend_suite

TestConformance = training_backend_suite("first_contract", overrides=["policy.optimizer.kwargs.lr=1e-3"])
