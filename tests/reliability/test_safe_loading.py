"""A checkpoint from someone else must not run code on resume: every file the dtensor backend
reads is refused, naming it, when it would need more than tensors and plain values."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from nrl_core.contracts import CheckpointOptions


class Payload:
    """Unpickling this creates ``path``: the stand-in for code a hostile checkpoint would run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from common import make_batch, make_config

    from nrl_backend_dtensor.worker import DTensorPolicyWorker
    from nrl_core.algorithms.loss import NLLLoss

    worker = DTensorPolicyWorker(make_config(), 0, 1)
    worker.train(make_batch(), NLLLoss())
    root = tmp_path_factory.mktemp("safe")
    worker.save_checkpoint(str(root / "sharded"))
    worker.save_checkpoint(str(root / "consolidated"), CheckpointOptions(fully_parallel_save=False))
    return worker, root


def test_rng_and_trainer_state_load_with_weights_only(saved):
    import random

    import numpy as np

    worker, root = saved
    for name in ("trainer_state.pt", "rng/rank0.pt"):
        torch.load(root / "sharded" / name, weights_only=True)
    expected = (torch.rand(3), random.random(), np.random.rand())  # the draws right after the save
    for _ in range(2):
        worker.load_checkpoint(str(root / "sharded"), CheckpointOptions(load_rng=True))
        drawn = (torch.rand(3), random.random(), np.random.rand())
        assert torch.equal(drawn[0], expected[0]) and drawn[1:] == expected[1:]


@pytest.mark.parametrize("target, fmt", [("trainer_state.pt", "sharded"), ("model_optim/.metadata", "sharded"),
                                         ("consolidated.pt", "consolidated"), ("rng/rank0.pt", "sharded")])
@pytest.mark.parametrize("fully_parallel_load", [True, False])
def test_a_file_that_runs_code_is_refused_naming_it(saved, tmp_path, target, fmt, fully_parallel_load):
    import json
    import shutil

    from nrl_backend_dtensor.checkpoint import MARKER, _file_sizes

    worker, root = saved
    copy = tmp_path / fmt
    shutil.copytree(root / fmt, copy)
    witness = tmp_path / "code_ran"
    with open(copy / target, "wb") as handle:
        pickle.dump(Payload(witness), handle) if target.endswith(".metadata") else \
            torch.save({"step": 1, "scheduler": Payload(witness)}, handle)
    marker = json.loads((copy / MARKER).read_text())
    (copy / MARKER).write_text(json.dumps(dict(marker, files=_file_sizes(str(copy)))))  # sizes agree: not "truncated"
    with pytest.raises(Exception) as info:
        worker.load_checkpoint(str(copy), CheckpointOptions(load_rng=True, fully_parallel_load=fully_parallel_load))
    message = str(info.value)
    assert type(info.value).__name__ == "UnsafeCheckpointError", message
    assert f"'{copy / target}' cannot be loaded safely" in message and "\n" not in message
    assert not witness.exists()
