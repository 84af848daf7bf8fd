"""A plugin for tests/e2e/test_watchdog_run.py, loaded with ``NRL_PLUGINS`` in the driver and
every worker: rank ``$NRL_TEST_HANG_RANK`` never returns from saving the checkpoint of step
``$NRL_TEST_HANG_STEP`` (a save whose write blocks); it touches ``$NRL_TEST_HANG_MARK`` first.
The core calls the worker's own ``save_checkpoint``, so the plugin wraps that method."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from nrl_backend_dtensor.worker import DTensorPolicyWorker

_save = DTensorPolicyWorker.save_checkpoint


def _blocking_save(self: DTensorPolicyWorker, path: str, options: Any = None) -> None:
    if os.environ.get("RANK") == os.environ["NRL_TEST_HANG_RANK"] and \
            Path(path).parent.name == f".tmp_step_{os.environ['NRL_TEST_HANG_STEP']}":
        Path(os.environ["NRL_TEST_HANG_MARK"]).touch()
        while True:
            time.sleep(1)
    _save(self, path, options)


DTensorPolicyWorker.save_checkpoint = _blocking_save
