"""The GPU check's CPU dry run (``scripts/gpu_check.sh --dry-run``): both training backends on two
gloo ranks, through the same code as on GPUs, on an interpreter where Ray and vLLM cannot be
imported (the GPU machine may have neither)."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(args: list[str], tmp_path: Path, bare: bool = False) -> subprocess.CompletedProcess[str]:
    """The script on this interpreter, Ray and vLLM unimportable; ``bare``: nrl's distributions
    too, as on a GPU machine where nothing but PyTorch's stack is installed (``-S`` skips the
    ``.pth`` files of their editable installs; the site directories stay on the path)."""
    absent = tmp_path / "absent"  # importing these fails, as where they are not installed
    for name in ("ray", "vllm"):
        (absent / name).mkdir(parents=True)
        (absent / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed here')\n")
    python, path = sys.executable, [str(absent)]
    if bare:
        python = str(tmp_path / "python-without-site")
        Path(python).write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
        os.chmod(python, 0o755)
        path += site.getsitepackages()
    env = dict(os.environ, PYTHON=python, PYTHONPATH=os.pathsep.join(path),
               NRL_MEGATRON_CHECKPOINT_DIR=str(tmp_path / "converted"))
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=600)


def test_without_a_gpu_the_check_says_to_use_the_dry_run(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    run = _run(["--out", str(tmp_path / "out")], tmp_path)
    assert run.returncode == 2 and "run with --dry-run" in run.stdout, run.stdout + run.stderr[-2000:]


def test_dry_run_of_the_refit_part_makes_and_destroys_its_groups_and_hands_parts_over(tmp_path: Path) -> None:
    """The refit part on the CPU: fifty gloo refit groups leave no thread or descriptor behind, and a
    part handed to a second process through /dev/shm lands whole (its CUDA IPC half needs a GPU).
    No nrl distribution is installed for it, as on the GPU machine: it runs from the checkout."""
    run = _run(["--dry-run", "--parts", "refit", "--out", str(tmp_path / "out")], tmp_path, bare=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    summary = json.loads((tmp_path / "out" / "refit.json").read_text())
    groups = summary["groups"]
    assert summary["ok"] and groups["backend"] == "gloo" and groups["rounds"] == 50
    assert groups["grew"]["threads"] <= 2 and groups["grew"]["descriptors"] <= 4, groups
    assert set(summary["transfers"]) == {"4 MiB through /dev/shm", "16 MiB through /dev/shm"}
    assert all(result["gb_per_s"] > 0 for result in summary["transfers"].values())


@pytest.mark.slow
def test_dry_run_trains_both_backends_and_matches_hf(tmp_path: Path) -> None:
    run = _run(["--dry-run", "--parts", "backends", "--out", str(tmp_path / "out")], tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    summary = json.loads((tmp_path / "out" / "backends.json").read_text())
    assert summary["world"] == 2 and summary["backend"] == "gloo" and summary["ok"] is True
    assert set(summary["results"]) == {"dtensor", "megatron", "dtensor-moe", "megatron-moe"}
    for name in ("dtensor", "megatron"):
        result = summary["results"][name]
        assert all(result["checks"].values()), (name, result["checks"])
        assert result["logprob_max_abs_diff"] <= 1e-4, name  # fp32 on both sides
        # same weights, same kernels: the reference pass and a checkpoint round trip are exact
        assert result["reference_vs_policy_before_training"] == 0.0, name
        assert result["reference_after_training_vs_before"] == 0.0 and result["policy_moved"] > 0, name
        assert result["checkpoint_round_trip_diff"] == 0.0, name
        assert result["tokens_per_s"] > 0 and result["mfu"] is None, name  # no peak figure for a CPU
        assert result["export_bytes"] > 0 and len(result["losses"]) == 2, name
    for name in ("dtensor-moe", "megatron-moe"):
        assert summary["results"][name]["logprob_max_abs_diff"] <= 1e-4, name
    for name in ("dtensor ", "megatron ", "dtensor-moe ", "megatron-moe "):
        assert f"{name.strip():13s} ok" in run.stdout, run.stdout
