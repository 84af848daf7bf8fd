"""A code environment: programs from model responses run against their task's tests in a Linux sandbox."""
