"""Same-size corruption of real DTensor and Megatron checkpoints: the checksum recorded in the
completion marker names the file, resume falls back to the checkpoint before, and Megatron's
own load errors are one line."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from nrl_core.checkpoint.checksums import ChecksumError
from nrl_core.checkpoint.manager import CheckpointManager


def flip(path: Path, count: int = 64) -> None:
    """Invert ``count`` bytes in the middle of ``path``, in place (the size does not change)."""
    data = bytearray(path.read_bytes())
    start = max(0, len(data) // 2 - count // 2)
    for i in range(start, min(start + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def manager_at(root: Path) -> CheckpointManager:
    return CheckpointManager({"enabled": True, "checkpoint_dir": str(root), "save_period": 1, "keep_top_k": None,
                              "metric_name": None})


def largest_file(root: Path, pattern: str) -> Path:
    return max(root.rglob(pattern), key=lambda p: p.stat().st_size)


def save_steps(worker: Any, manager: CheckpointManager, batch: Any, loss: Any, steps: int = 2) -> None:
    for step in range(1, steps + 1):
        worker.train(batch, loss)
        tmp = manager.prepare(step)
        worker.save_checkpoint(str(tmp / "policy"))
        manager.commit(step, tmp, {"metrics": {}})


def check_fallback(manager: CheckpointManager, shard: Path, caplog: pytest.LogCaptureFixture) -> None:
    rel = shard.relative_to(manager.root / "step_2").as_posix()
    with pytest.raises(ChecksumError) as info:
        manager.verify(manager.root / "step_2")
    assert f"file '{rel}' fails its" in str(info.value) and "\n" not in str(info.value)
    with caplog.at_level("WARNING"):
        assert manager.latest_verified() == manager.root / "step_1"
    assert f"step_2: file '{rel}' fails" in caplog.text


def test_dtensor_flipped_shard_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    import torch
    from common import make_batch, make_config

    from nrl_backend_dtensor.worker import DTensorPolicyWorker
    from nrl_core.algorithms.loss import NLLLoss

    worker = DTensorPolicyWorker(make_config(), 0, 1)
    manager = manager_at(tmp_path / "ckpt")
    save_steps(worker, manager, make_batch(), NLLLoss())
    shard = largest_file(manager.root / "step_2", "*.distcp")
    size = shard.stat().st_size
    flip(shard)
    assert shard.stat().st_size == size
    check_fallback(manager, shard, caplog)
    fresh = DTensorPolicyWorker(make_config(), 0, 1)
    fresh.load_checkpoint(str(manager.latest_verified() / "policy"))
    assert fresh.step == 1
    assert all(torch.isfinite(p.detach()).all() for p in fresh.model.parameters())  # one rank: plain tensors


def megatron_scenario(rank: int, world: int, model: str, root: str, witness: str) -> dict[str, Any]:
    from _helpers import make_batch, make_config

    from nrl_backend_megatron.worker import MegatronPolicyWorker
    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.errors import NrlError

    worker = MegatronPolicyWorker(make_config(model), rank, world)
    manager = manager_at(Path(root))
    save_steps(worker, manager, make_batch(), NLLLoss())
    out: dict[str, Any] = {}
    step2 = manager.root / "step_2" / "policy"
    broken = manager.root / "no_common"
    shutil.copytree(step2, broken)
    (broken / "common.pt").unlink()
    shard = largest_file(broken, "*.distcp")
    truncated = manager.root / "truncated"
    shutil.copytree(step2, truncated)
    with open(truncated / shard.name, "r+b") as handle:
        handle.truncate(shard.stat().st_size // 2)
    planted = {"metadata": plant_metadata(step2, manager.root / "planted_metadata", witness),
               "object": plant_sharded_object(step2, manager.root / "planted_object", witness)}
    for tag, path in (("no_common", broken), ("truncated", truncated), *planted.items()):
        try:
            worker.load_checkpoint(str(path))
            out[tag] = "loaded"
        except NrlError as exc:
            out[tag] = f"{type(exc).__name__}: {exc}"
    out["code_ran"] = Path(witness).exists()
    worker.load_checkpoint(str(step2))  # nrl's own checkpoint passes the safe readers
    return out


class _Payload:
    """Unpickling this creates ``path``: the stand-in for code a hostile checkpoint would run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def plant_metadata(source: Path, target: Path, witness: str) -> Path:
    """A copy of ``source`` whose DCP ``.metadata`` runs code when unpickled (issue 62's attack)."""
    import pickle

    shutil.copytree(source, target)
    (target / ".metadata").write_bytes(pickle.dumps(_Payload(witness)))
    return target


def plant_sharded_object(source: Path, target: Path, witness: str) -> Path:
    """A copy of ``source`` whose sharded object (this rank's RNG state) is a payload: appended to
    a new shard file and pointed at by benign metadata."""
    import io
    import pickle

    from nrl_core.sdk.safe_dcp import SafeFileSystemReader

    shutil.copytree(source, target)
    metadata = SafeFileSystemReader(str(target)).read_metadata()
    buffer = io.BytesIO()
    torch.save({"payload": _Payload(witness)}, buffer)
    (target / "__planted.distcp").write_bytes(buffer.getvalue())
    (index,) = [i for i in metadata.storage_data if i.fqn.startswith("rng_state")]
    info = metadata.storage_data[index]
    metadata.storage_data[index] = type(info)("__planted.distcp", 0, len(buffer.getvalue()))
    (target / ".metadata").write_bytes(pickle.dumps(metadata))
    return target


@pytest.mark.slow
def test_megatron_flipped_shard_falls_back_and_load_errors_are_one_line(tmp_path, caplog):
    pytest.importorskip("megatron.core")
    from _helpers import run_world

    from nrl_core.testing.tiny_models import cached_tiny_model

    root = tmp_path / "ckpt"
    witness = tmp_path / "code_ran"
    (out,) = run_world(megatron_scenario, 1, str(cached_tiny_model("llama")), str(root), str(witness),
                       env={"NRL_MEGATRON_CHECKPOINT_DIR": str(tmp_path / "conv")})
    # issue 62: a planted .metadata, or a planted sharded object, is refused naming it and never runs
    assert out["code_ran"] is False and not witness.exists()
    assert out["metadata"].startswith(f"UnsafeCheckpointError: checkpoint file '{root / 'planted_metadata' / '.metadata'}' "
                                      f"cannot be loaded safely (it references io.open)"), out["metadata"]
    assert out["object"].startswith(f"UnsafeCheckpointError: checkpoint file '{root / 'planted_object'}' cannot be "
                                    f"loaded safely (entry 'rng_state"), out["object"]
    assert "\n" not in out["metadata"] + out["object"]
    assert "'common.pt' is missing" in out["no_common"] and "\n" not in out["no_common"]
    assert "rank 0:" in out["truncated"] and "CheckpointException" not in out["truncated"], out["truncated"]
    assert "\n" not in out["truncated"]
    manager = manager_at(root)
    shard = largest_file(root / "step_2", "*.distcp")
    flip(shard)
    check_fallback(manager, shard, caplog)
