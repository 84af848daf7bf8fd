"""The kit on workers that break the contract: it must stop before anything runs, one line per gap."""

from nrl_core.testing.conformance import training_backend_suite

TestLacking = training_backend_suite("lacking")
TestWrongType = training_backend_suite("wrongtype")
