"""The checkpoint manager: atomic publication, deferred (async) saves, keep_top_k, resume."""

from __future__ import annotations

import pytest

from nrl_core.checkpoint.manager import CheckpointManager
from nrl_core.errors import NrlError


def _manager(tmp_path, **overrides):
    section = {"enabled": True, "checkpoint_dir": str(tmp_path / "ckpt"), "save_period": 1, "keep_top_k": None,
               "metric_name": "val_reward", "higher_is_better": True, **overrides}
    return CheckpointManager(section)


def _save(manager, step, reward=None, wait=None):
    tmp = manager.prepare(step)
    (tmp / "policy").mkdir()
    (tmp / "policy" / "weights.bin").write_bytes(b"x" * 10)
    metrics = {} if reward is None else {"val_reward": reward}
    manager.commit(step, tmp, {"metrics": metrics}, wait=wait)


def test_commit_publishes_atomically(tmp_path):
    manager = _manager(tmp_path)
    tmp = manager.prepare(1)
    assert manager.latest() is None  # in progress is not a checkpoint
    (tmp / "policy").mkdir()
    manager.commit(1, tmp, {"metrics": {"val_reward": 0.5}, "dataloader": {"epoch": 0, "index": 4}})
    latest = manager.latest()
    assert latest is not None and latest.name == "step_1" and not tmp.exists()
    info = manager.load_info(latest)
    assert info["step"] == 1 and info["dataloader"] == {"epoch": 0, "index": 4}


def test_deferred_commit_waits_for_the_backend_before_renaming(tmp_path):
    manager = _manager(tmp_path)
    events = []
    _save(manager, 1, wait=lambda: events.append("waited"))
    assert manager.latest() is None and events == []  # async save still running: not published
    _save(manager, 2)  # the next save publishes the previous one first
    assert events == ["waited"]
    assert [p.name for p in manager.checkpoints()] == ["step_1", "step_2"]
    _save(manager, 3, wait=lambda: events.append("waited again"))
    manager.close()
    assert events[-1] == "waited again" and manager.latest().name == "step_3"


def test_keep_top_k_keeps_the_best_and_the_latest(tmp_path):
    manager = _manager(tmp_path, keep_top_k=2)
    for step, reward in [(1, 0.1), (2, 0.9), (3, 0.5), (4, 0.7), (5, 0.2)]:
        _save(manager, step, reward)
    assert [p.name for p in manager.checkpoints()] == ["step_2", "step_4", "step_5"]
    assert manager.best().name == "step_2"


def test_keep_top_k_lower_is_better(tmp_path):
    manager = _manager(tmp_path, keep_top_k=1, metric_name="val_loss", higher_is_better=False)
    for step, loss in [(1, 3.0), (2, 1.0), (3, 2.0)]:
        tmp = manager.prepare(step)
        manager.commit(step, tmp, {"metrics": {"val_loss": loss}})
    assert [p.name for p in manager.checkpoints()] == ["step_2", "step_3"]


def test_without_metric_keep_top_k_keeps_the_newest(tmp_path):
    manager = _manager(tmp_path, keep_top_k=2)
    for step in range(1, 5):
        _save(manager, step)
    assert [p.name for p in manager.checkpoints()] == ["step_3", "step_4"]


def test_interrupted_save_is_ignored_and_cleaned_on_restart(tmp_path):
    manager = _manager(tmp_path)
    _save(manager, 1, 0.1)
    tmp = manager.prepare(2)
    (tmp / "policy").mkdir()
    (tmp / "policy" / "half_written.bin").write_bytes(b"x")
    # the process dies here; a new run starts
    restarted = _manager(tmp_path)
    assert restarted.latest().name == "step_1"
    assert not tmp.exists()
    assert (restarted.latest() / "policy" / "weights.bin").read_bytes() == b"x" * 10


def test_unwritable_checkpoint_dir_is_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(NrlError, match=r"checkpointing.checkpoint_dir: '.*a_file/ckpt' is not writable"):
        CheckpointManager({"enabled": True, "checkpoint_dir": str(blocker / "ckpt"), "save_period": 1})


def test_corrupt_info_is_one_line(tmp_path):
    manager = _manager(tmp_path)
    _save(manager, 1, 0.3)
    (manager.latest() / "training_info.json").write_text("{not json")
    with pytest.raises(NrlError, match="unreadable training_info.json"):
        manager.load_info(manager.latest())


def test_save_period(tmp_path):
    manager = _manager(tmp_path, save_period=3)
    assert [s for s in range(1, 8) if manager.should_save(s)] == [3, 6]
    assert manager.should_save(7, last_step=True)
    assert not _manager(tmp_path, enabled=False).should_save(3)


def _metric_mix(rng):
    special = [float("nan"), float("inf"), float("-inf"), None]
    return [rng.choice(special) if rng.random() < 0.4 else round(rng.uniform(-1, 1), 3) for _ in range(rng.randint(1, 6))]


@pytest.mark.parametrize("higher_is_better", [True, False])
def test_nonfinite_metrics_never_rank_as_best(tmp_path, higher_is_better):
    import math
    import random
    import shutil

    rng = random.Random(0 if higher_is_better else 1)
    for trial in range(48):
        manager = _manager(tmp_path, higher_is_better=higher_is_better)
        values = _metric_mix(rng)
        for step, value in enumerate(values, start=1):
            _save(manager, step, value)
        finite = [(v, s) for s, v in enumerate(values, start=1) if v is not None and math.isfinite(v)]
        if finite:
            best_value = max(v if higher_is_better else -v for v, _ in finite)
            expected = max(s for v, s in finite if (v if higher_is_better else -v) == best_value)
        else:  # no number anywhere: the newest checkpoint without a NaN/Inf metric, else the newest
            clean = [s for s, v in enumerate(values, start=1) if v is None]
            expected = clean[-1] if clean else len(values)
        assert manager.best().name == f"step_{expected}", (trial, values)
        shutil.rmtree(manager.root)


def test_keep_top_k_never_keeps_a_nan_over_a_number(tmp_path):
    manager = _manager(tmp_path, keep_top_k=2)
    for step, reward in [(1, 0.3), (2, float("nan")), (3, 0.1), (4, float("inf")), (5, float("nan"))]:
        _save(manager, step, reward)
    # the two finite ones by rank, plus the newest (always kept so that a run can resume)
    assert [p.name for p in manager.checkpoints()] == ["step_1", "step_3", "step_5"]
    assert manager.best().name == "step_1"


def _flip(path, offset=0, count=64):
    data = bytearray(path.read_bytes())
    for i in range(offset, min(offset + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_checksums_are_recorded_and_a_flipped_byte_falls_back(tmp_path, caplog):
    manager = _manager(tmp_path)
    _save(manager, 1, 0.1)
    _save(manager, 2, 0.2)
    info = manager.load_info(manager.latest())
    assert info["checksum"] in ("xxh3_64", "blake2b") and set(info["files"]) == {"policy/weights.bin"}
    assert info["files"]["policy/weights.bin"]["size"] == 10
    assert manager.latest_verified().name == "step_2"
    weights = manager.latest() / "policy" / "weights.bin"
    _flip(weights, 3, 1)
    assert weights.stat().st_size == 10
    with pytest.raises(NrlError, match=r"file 'policy/weights.bin' fails its .* checksum") as info:
        manager.verify(manager.latest())
    assert "\n" not in str(info.value)
    with caplog.at_level("WARNING"):
        assert manager.latest_verified().name == "step_1"
    assert "step_2: file 'policy/weights.bin' fails" in caplog.text
    (manager.root / "step_1" / "policy" / "weights.bin").unlink()
    with pytest.raises(NrlError, match="every checkpoint under .* fails its checksums"):
        manager.latest_verified()


def test_interrupted_replace_is_repaired_at_the_next_start(tmp_path):
    manager = _manager(tmp_path)
    _save(manager, 1, 0.1)
    _save(manager, 2, 0.2)
    root = manager.root
    (root / "step_1").rename(root / ".old_step_1")  # killed between the two renames of a replace
    (root / ".old_step_3").mkdir()  # an incomplete leftover
    _manager(tmp_path)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".write")) == ["step_1", "step_2"]


def test_hf_export_is_published_in_one_rename(tmp_path):
    manager = _manager(tmp_path)

    def write(directory):
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"new")

    def crash(directory):
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"ha")
        raise RuntimeError("killed while writing")

    export = manager.export(write)
    assert export == manager.root / "hf_export" and (export / "model.safetensors").read_bytes() == b"new"
    with pytest.raises(RuntimeError):
        manager.export(crash)
    assert (export / "model.safetensors").read_bytes() == b"new"  # the old export is untouched
    export.rename(manager.root / ".old_hf_export")  # killed between the two renames of a replace
    _manager(tmp_path)
    assert sorted(p.name for p in manager.root.iterdir() if not p.name.startswith(".write")) == ["hf_export"]
    assert (export / "model.safetensors").read_bytes() == b"new"
