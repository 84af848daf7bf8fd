"""Checkpoints written by an earlier nrl, kept in ``tests/fixtures/checkpoints``, must resume on
today's backends: the same weights (logprobs equal), the same optimizer state and step (the next
training step's loss equals the one the writer recorded).

``python -m tests.reliability.checkpoint_compat write`` regenerates the fixtures; do that only on
purpose (a format change), and say so in docs/changelog.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints"
BACKENDS = ("dtensor", "megatron")


def _worker(backend: str) -> Any:
    from nrl_core.testing.tiny_models import cached_tiny_model

    model = str(cached_tiny_model("llama", size="tiny"))
    if backend == "dtensor":
        from nrl_backend_dtensor.worker import DTensorPolicyWorker
        from tests.dtensor.common import make_config

        config = make_config(model_name=model, scheduler=None)
        return DTensorPolicyWorker(config, rank=0, world_size=1)
    from nrl_backend_megatron.worker import MegatronPolicyWorker
    from tests.megatron._helpers import make_config

    return MegatronPolicyWorker(make_config(model), rank=0, world_size=1)


def _batch() -> Any:
    from tests.megatron._helpers import make_batch

    return make_batch(rows=4, width=12)


def _step(worker: Any) -> float:
    from nrl_core.algorithms.loss import NLLLoss

    return float(worker.train(_batch(), NLLLoss())["loss"])


def _logprobs(worker: Any) -> torch.Tensor:
    from nrl_core.testing.distributed import gather_shards

    return gather_shards(worker.get_logprobs(_batch()), _batch()).float()


def write(rank: int, world: int, backend: str) -> None:
    """Train two steps, save, then record the logprobs and the next step's loss."""
    worker = _worker(backend)
    _step(worker)
    _step(worker)
    target = FIXTURES / backend
    worker.save_checkpoint(str(target / "checkpoint"))
    worker.finalize_checkpoint()
    expected = {"logprobs": _logprobs(worker), "next_loss": _step(worker), "torch": str(torch.__version__)}
    torch.save(expected, target / "expected.pt")


def resume(rank: int, world: int, backend: str, checkpoint: str) -> dict[str, float]:
    """Load ``checkpoint`` (a copy of the fixture's) into a fresh worker: its logprobs' largest
    difference from the writer's and the next step's loss."""
    worker = _worker(backend)
    expected = torch.load(FIXTURES / backend / "expected.pt")
    worker.load_checkpoint(checkpoint)
    gap = float((_logprobs(worker) - expected["logprobs"]).abs().max())
    return {"logprob_gap": gap, "next_loss": _step(worker), "expected_next_loss": float(expected["next_loss"])}


if __name__ == "__main__" and sys.argv[1:] == ["write"]:
    import os
    import shutil

    from nrl_core.testing.distributed import run_distributed

    os.environ.setdefault("NRL_MEGATRON_CHECKPOINT_DIR", "/tmp/nrl-compat-converted")
    for name in BACKENDS:
        shutil.rmtree(FIXTURES / name, ignore_errors=True)
        (FIXTURES / name).mkdir(parents=True)
        run_distributed(write, 1, name)
        print(f"wrote {FIXTURES / name}")
