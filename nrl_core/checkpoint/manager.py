"""Step checkpoints on disk: atomic, resumable, pruned by a metric.

Layout under ``checkpointing.checkpoint_dir``::

    step_3/                 complete checkpoints only
      training_info.json    step, metrics, dataloader position, config, plugin versions
      policy/               whatever the training backend wrote (through nrl_checkpoint_save)
    .tmp_step_4/            a save in progress (or one a killed run left behind)

A checkpoint is written into ``.tmp_step_N`` and renamed to ``step_N`` only once every file is
complete, asynchronous backend saves included: with ``wait`` the rename is deferred until the
next save or :meth:`close`, after the backend's writes finished. A directory without
``training_info.json`` is never a checkpoint, so a crash at any point leaves the previous ones
intact and resume picks the latest complete one.

``training_info.json`` also records the size and checksum of every other file of the checkpoint
(:mod:`nrl_core.checkpoint.checksums`). Resume verifies them and, when a file differs, warns and
falls back to the checkpoint before; a NaN/Inf metric never ranks a checkpoint as the best.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nrl_core.checkpoint.checksums import ChecksumError, default_algorithm, tree_digests, verify_tree
from nrl_core.errors import NrlError

logger = logging.getLogger(__name__)

INFO_FILE = "training_info.json"
HF_EXPORT = "hf_export"
STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class _Pending:
    step: int
    tmp: Path
    info: dict[str, Any]
    wait: Callable[[], None]


class CheckpointManager:
    """Owns ``checkpoint_dir``: where saves go, which to keep, which to resume from."""

    def __init__(self, section: Mapping[str, Any],
                 on_publish: Callable[[int, Path, Mapping[str, Any]], None] | None = None) -> None:
        self.enabled = bool(section["enabled"])
        self.on_publish = on_publish  # (step, directory, training_info) once a checkpoint is in place
        self.root = Path(section["checkpoint_dir"]).expanduser()
        self.save_period = int(section["save_period"])
        self.keep_top_k = section.get("keep_top_k")
        self.metric_name = section.get("metric_name")
        self.higher_is_better = bool(section.get("higher_is_better", True))
        self._pending: _Pending | None = None
        if self.enabled:
            self._check_writable()
            self._remove_incomplete()

    def _check_writable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.root, prefix=".write_test_"):
                pass
        except OSError as exc:
            raise NrlError(f"checkpointing.checkpoint_dir: '{self.root}' is not writable ({exc.strerror}); "
                           f"choose a directory you can write to") from None

    def _remove_incomplete(self) -> None:
        for path in [*self.root.glob(".tmp_step_*"), self.root / f".tmp_{HF_EXPORT}"]:
            if path.exists():
                logger.warning("removing incomplete %s left by an interrupted run", path)
                shutil.rmtree(path, ignore_errors=True)
        for path in [*self.root.glob(".old_step_*"), self.root / f".old_{HF_EXPORT}"]:
            if not path.exists():
                continue
            # a replace of step_N was interrupted: if step_N is missing the old one is all there is
            final = self.root / path.name.removeprefix(".old_")
            if final.exists() or (final.name != HF_EXPORT and not (path / INFO_FILE).is_file()):
                logger.warning("removing %s left by an interrupted checkpoint replace", path)
                shutil.rmtree(path, ignore_errors=True)
            else:
                logger.warning("restoring %s from %s (its replacement was interrupted)", final, path)
                path.rename(final)

    # ------------------------------------------------------------------ saving

    def should_save(self, step: int, *, last_step: bool = False) -> bool:
        return self.enabled and (last_step or (self.save_period > 0 and step % self.save_period == 0))

    def prepare(self, step: int) -> Path:
        """A fresh temporary directory for step ``step`` (publishing any deferred save first)."""
        self.finish_pending()
        tmp = self.root / f".tmp_step_{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, step: int, tmp: Path, info: Mapping[str, Any], *, wait: Callable[[], None] | None = None) -> None:
        """Publish ``tmp`` as ``step_<step>`` now, or, with ``wait``, once ``wait()`` has returned
        (at the next :meth:`prepare` or at :meth:`close`)."""
        pending = _Pending(step, tmp, {"step": step, **info}, wait or (lambda: None))
        if wait is None:
            self._publish(pending)
        else:
            self._pending = pending

    def finish_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._publish(pending)

    def close(self) -> None:
        self.finish_pending()

    def _publish(self, pending: _Pending) -> None:
        pending.wait()
        algorithm = default_algorithm()
        pending.info["checksum"] = algorithm
        pending.info["files"] = tree_digests(pending.tmp, algorithm, skip=frozenset({INFO_FILE}))
        info_path = pending.tmp / INFO_FILE
        with open(info_path, "w") as handle:
            json.dump(pending.info, handle, indent=2, default=str)
            handle.flush()
            os.fsync(handle.fileno())
        final = self.root / f"step_{pending.step}"
        self._replace(pending.tmp, final)
        logger.info("saved checkpoint %s", final)
        self._prune()
        if self.on_publish is not None:
            self.on_publish(pending.step, final, pending.info)

    def _replace(self, tmp: Path, final: Path) -> None:
        """Rename ``tmp`` to ``final``; an existing ``final`` is retired to ``.old_<name>`` first and
        removed after (a crash in between is repaired at the next start)."""
        if final.exists():
            retired = self.root / f".old_{final.name}"
            shutil.rmtree(retired, ignore_errors=True)
            final.rename(retired)
            tmp.rename(final)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            tmp.rename(final)

    def export(self, write: Callable[[Path], None]) -> Path:
        """``write(directory)`` the HF export into a temporary directory, then publish it as
        ``hf_export`` in one rename, so that a crash never leaves a half-written export there."""
        final = self.root / HF_EXPORT
        tmp = self.root / f".tmp_{HF_EXPORT}"
        shutil.rmtree(tmp, ignore_errors=True)
        write(tmp)
        self._replace(tmp, final)
        return final

    # ------------------------------------------------------------------ reading

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest step first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = STEP_DIR.match(path.name)
            if match and (path / INFO_FILE).is_file():
                found.append((int(match.group(1)), path))
        return [path for _, path in sorted(found)]

    def latest(self) -> Path | None:
        complete = self.checkpoints()
        return complete[-1] if complete else None

    @staticmethod
    def load_info(path: Path) -> dict[str, Any]:
        try:
            return json.loads((path / INFO_FILE).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise NrlError(f"checkpoint {path} has an unreadable {INFO_FILE} ({exc}); delete that directory to resume "
                           f"from the one before") from None

    def verify(self, path: Path) -> None:
        """Raise :class:`ChecksumError` naming the first file of checkpoint ``path`` that differs from
        the size and checksum recorded at save. Checkpoints from before checksums pass."""
        info = self.load_info(path)
        if "files" in info:
            verify_tree(path, info["files"], info.get("checksum", "xxh3_64"))

    def first_verified(self, candidates: list[Path]) -> Path | None:
        """The first of ``candidates`` whose files verify, warning for each one that does not."""
        for path in candidates:
            try:
                self.verify(path)
            except ChecksumError as exc:
                logger.warning("%s; skipping it", exc)
                continue
            return path
        return None

    def latest_verified(self) -> Path | None:
        """The newest complete checkpoint whose files verify (a corrupted one falls back to the one before)."""
        complete = self.checkpoints()
        found = self.first_verified(complete[::-1])
        if complete and found is None:
            raise NrlError(f"every checkpoint under {self.root} fails its checksums (see the warnings above); move "
                           f"them away to start afresh")
        return found

    def best(self) -> Path | None:
        """The checkpoint with the best finite metric; without one, the newest whose metric is not NaN/Inf."""
        preference = self.preference()
        return preference[0] if preference else None

    def preference(self) -> list[Path]:
        """Every complete checkpoint, best first: ranked by a finite metric, then the newest without a
        metric, then those whose metric is NaN/Inf (never preferred to a checkpoint with a number)."""
        ranked = self._ranked()
        rest = [p for p in self.checkpoints()[::-1] if p not in ranked]
        poisoned = [p for p in rest if self._metric(p) is not None]
        return ranked + [p for p in rest if p not in poisoned] + poisoned

    def _metric(self, path: Path) -> float | None:
        value = self.load_info(path).get("metrics", {}).get(self.metric_name) if self.metric_name else None
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def _ranked(self) -> list[Path]:
        """Checkpoints that carry a finite metric, best first (ties: the later step first)."""
        scored = []
        for path in self.checkpoints():
            value = self._metric(path)
            if value is not None and math.isfinite(value):
                scored.append((value, self.load_info(path)["step"], path))
        scored.sort(key=lambda t: (t[0] if self.higher_is_better else -t[0], t[1]), reverse=True)
        return [path for _, _, path in scored]

    def _prune(self) -> None:
        if not self.keep_top_k:
            return
        keep = set(self._ranked()[: self.keep_top_k])
        complete = self.checkpoints()
        if complete:
            keep.add(complete[-1])
        if len(keep) < self.keep_top_k:  # too few carry the metric: keep the newest instead
            keep.update(complete[-self.keep_top_k:])
        for path in complete:
            if path not in keep:
                logger.info("removing checkpoint %s (keep_top_k=%d by %s)", path, self.keep_top_k, self.metric_name)
                shutil.rmtree(path, ignore_errors=True)
