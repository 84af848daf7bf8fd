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
