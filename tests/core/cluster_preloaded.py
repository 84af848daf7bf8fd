"""A module a test worker group preloads (tests/core/test_cluster.py): it records when it was imported."""

import time

IMPORTED_AT = time.time()
