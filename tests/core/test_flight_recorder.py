"""PyTorch's flight recorder in a watchdog's dump: a GPU process keeps the recorder on (unless the
user chose its size) and writes its dump into the run's stack directory when the driver asks,
even while its main thread is busy; a process without a GPU does none of it. Run on CPU: the
dump is whatever this PyTorch's recorder holds (nothing NCCL ever ran here); not run on a GPU."""

from __future__ import annotations

import os
import pickle
import threading
import time
from pathlib import Path

import pytest

from nrl_core import stacks


def test_no_gpu_no_recorder(monkeypatch: pytest.MonkeyPatch) -> None:
    for visible, gpu in (("", False), ("-1", False), ("0", True), ("2,3", True)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert stacks.has_gpu() is gpu


def test_a_gpu_process_dumps_its_recorder_into_the_stack_directory(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed  # noqa: F401  (a rank has imported it long before it hangs)

    for name in stacks.FLIGHT_RECORDER_ENV:
        monkeypatch.delenv(name, raising=False)
    me = stacks.stack_file(os.getpid())
    me.parent.mkdir(parents=True, exist_ok=True)
    stacks._start_flight_recorder(me)  # what install_stack_dump does in a process with a GPU
    try:
        assert all(os.environ[name] == stacks.FLIGHT_RECORDER_ENTRIES for name in stacks.FLIGHT_RECORDER_ENV)
        busy = threading.Thread(target=time.sleep, args=(1.5,))  # the main thread of a rank waits in NCCL
        busy.start()
        status = stacks.dump_processes([stacks.StackTarget("policy-rank0-pid1", os.getpid())], tmp_path, wait_s=5)
        busy.join()
        dump = tmp_path / "policy-rank0-pid1.nccl_trace.pkl"
        assert dump.exists() and "flight recorder" in status["policy-rank0-pid1"], status
        expected = stacks.dump_flight_recorder()
        if expected is None:
            assert dump.read_bytes() == b"" and "no flight recorder" in status["policy-rank0-pid1"]
        else:
            assert "version" in pickle.loads(dump.read_bytes())
        assert not stacks._flight_recorder_request(os.getpid()).exists()  # answered
    finally:
        me.with_suffix(".fr-ready").unlink(missing_ok=True)
