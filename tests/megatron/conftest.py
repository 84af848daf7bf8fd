import os

os.environ.setdefault("NRL_CHECK_DEVICES", "1")  # the worker checks the loss's batch device (nrl_core.device)
