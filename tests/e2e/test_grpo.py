"""GRPO end to end through ``nrl train grpo``: real Ray workers, a real training backend, vLLM and
the math environment, on a tiny locally built model. Each run is a subprocess, as a user runs it."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
from filelock import FileLock

from nrl_core.data import write_jsonl
from tests.launch import nrl

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "grpo_tiny_cpu.yaml"
TIMING = ("timing/", "throughput/", "train/step_seconds", "train/critic/step_seconds")
LOAD_RNG = ("policy.dtensor_config.load_rng=true",)


def nrl_train(tmp: Path, model: Path, *overrides: str, algorithm: str = "grpo",
              env: Mapping[str, str] | None = None, own_ray_from_zygote: bool = False) -> subprocess.CompletedProcess[str]:
    """``nrl train`` on the tiny CPU GRPO config, scaled to a few steps of a few prompts."""
    args = [
        f"policy.model_name={model}", "grpo.max_num_steps=3", "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=16", "grpo.val_period=2", "grpo.max_val_samples=8", "grpo.val_batch_size=8",
        "grpo.val_at_start=false", "data.generate.num_train=64", "data.generate.num_val=8", *overrides,
    ]
    return run_nrl(tmp, CONFIG, algorithm, args, env=env, own_ray_from_zygote=own_ray_from_zygote)


def cached_export(name: str, key: object, train: Callable[[Path], None]) -> Path:
    """The HF export of a short run, built once per cache directory (``$NRL_TEST_CACHE``, as the
    tiny models are) under ``<name>-<digest of key>``: ``train(work)`` runs with its checkpoints in
    ``work/ckpt`` and ``checkpointing.export_hf`` on."""
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]
    root = Path(os.environ.get("NRL_TEST_CACHE") or Path(tempfile.gettempdir()) / "nrl-test-models")
    target = root / f"{name}-{digest}"
    if (target / "model.safetensors").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{target.name}.lock")):  # another test process may be building it
        if (target / "model.safetensors").exists():
            return target
        work = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}."))
        train(work)
        (work / "ckpt" / "hf_export").rename(target)
        shutil.rmtree(work, ignore_errors=True)
    return target


def run_nrl(tmp: Path, config: Path, algorithm: str, overrides: list[str],
            env: Mapping[str, str] | None = None, own_ray_from_zygote: bool = False) -> subprocess.CompletedProcess[str]:
    """``nrl train ALGORITHM --config CONFIG`` in a new process, as a user runs it, writing its
    checkpoints and logs under ``tmp`` (checkpoints every step, no HF export, no plots unless the
    overrides say otherwise), on the suite's shared Ray unless ``env`` names a ``RAY_ADDRESS``
    (empty: a local Ray of the run's own, whose workers fork from the worker zygote with
    ``own_ray_from_zygote``)."""
    args = [f"checkpointing.checkpoint_dir={tmp / 'ckpt'}", "checkpointing.save_period=1",
            f"logger.log_dir={tmp / 'logs'}", "logger.tensorboard_enabled=false", "logger.plot=false",
            "checkpointing.export_hf=false", "checkpointing.keep_top_k=null", *overrides]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "NRL_STRICT_PLUGINS": "1", **(env or {})}
    return nrl(["train", algorithm, "--config", str(config), *args], env=env, cwd=tmp, join_shared_ray=True,
               own_ray_from_zygote=own_ray_from_zygote)


def metrics(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()]


def assert_ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


def finite(rows: list[dict]) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for row in rows for v in row.values())


@pytest.fixture(scope="module")
def three_steps(model, tmp_path_factory) -> Path:
    """The tiny config's three steps, checkpointing each one with its RNG state: several tests
    read this one run."""
    tmp = tmp_path_factory.mktemp("three_steps")
    proc = nrl_train(tmp, model, *LOAD_RNG, env={"NRL_TIMELINE": str(tmp / "timeline.jsonl")})
    assert_ok(proc)
    (tmp / "stderr.txt").write_text(proc.stderr)
    return tmp


@pytest.fixture(scope="module")
def separate_logprob_pass(model, tmp_path_factory) -> Path:
    """The same three steps with the previous policy's logprobs from a separate ``get_logprobs``
    pass (``loss_fn.force_on_policy_ratio=false``, NeMo RL's default), keeping the best checkpoint."""
    tmp = tmp_path_factory.mktemp("separate_pass")
    proc = nrl_train(tmp, model, *LOAD_RNG, "loss_fn.force_on_policy_ratio=false",
                     "checkpointing.keep_top_k=1", "checkpointing.metric_name=train_reward")
    assert_ok(proc)
    (tmp / "stderr.txt").write_text(proc.stderr)
    return tmp


def test_dtensor_colocated_three_steps(three_steps):
    rows = metrics(three_steps)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert finite(rows)
    assert rows[0]["train/weight_version"] == 0 and rows[2]["train/weight_version"] == 2  # refit each step
    assert "val/accuracy" in rows[1] and "val/accuracy" not in rows[0]
    # vLLM and the policy agree on the sampled tokens' logprobs (1.0 = identical)
    assert all(abs(r["train/token_mult_prob_error"] - 1.0) < 1e-3 for r in rows)
    assert sorted(p.name for p in (three_steps / "ckpt").iterdir()) == ["step_1", "step_2", "step_3"]


def test_the_policy_worker_imports_its_engines_while_the_driver_checks_the_config(three_steps):
    """``nrl train`` launches the policy's worker right after the config's schema pass: its actor
    imports the backend's and the colocated engine's modules (every one of them importable) while
    the driver runs the model-aware checks, and the run builds its policy on that same actor."""
    events = [json.loads(line) for line in (three_steps / "timeline.jsonl").read_text().splitlines()]
    first = {}
    for event in events:
        first.setdefault(event["event"], event)
    # The launch precedes the end of the driver's checks; when the actor's imports start relative
    # to either depends on how warm Ray's worker pool and the driver are, so it is not asserted.
    assert first["policy_launched"]["t"] < first["config_validated"]["t"]
    assert first["preload_start"]["t"] < first["preloaded"]["t"]
    assert first["preloaded"]["failed"] == 0
    assert first["preloaded"]["t"] < first["worker_build_start"]["t"]
    policy_actors = {e["pid"] for e in events if e["event"] == "actor_start" and e["group"].startswith("policy-")}
    assert policy_actors == {first["worker_built"]["pid"]}


def test_logprobs_from_the_training_forward_train_as_the_separate_pass(three_steps, separate_logprob_pass):
    """One optimizer step per GRPO step: the previous policy's logprobs come from the training
    forward (ratio exactly 1), and the run is the one the separate pass gives, to float noise."""
    assert "previous-policy logprobs: from the training forward" in (three_steps / "stderr.txt").read_text()
    assert "previous-policy logprobs: a separate get_logprobs pass" in (separate_logprob_pass / "stderr.txt").read_text()
    derived, separate = metrics(three_steps), metrics(separate_logprob_pass)
    for a, b in zip(derived, separate, strict=True):
        assert a["train/reward"] == b["train/reward"] and a["train/response_length"] == b["train/response_length"]
        for key in ("train/loss", "train/probs_ratio", "train/token_mult_prob_error", "train/grad_norm"):
            assert abs(a[key] - b[key]) < 1e-5 * max(1.0, abs(b[key])), (key, a[key], b[key])


def test_keep_top_k_keeps_the_best_and_the_latest(separate_logprob_pass):
    rows = metrics(separate_logprob_pass)
    best = max(rows, key=lambda r: (r["train/reward"], r["step"]))["step"]
    assert sorted(p.name for p in (separate_logprob_pass / "ckpt").iterdir()) == sorted({f"step_{best}", "step_3"})


def test_a_finished_run_extended_past_an_interrupted_save_continues_as_the_unbroken_run(tmp_path, model, three_steps):
    """A run that finished after one step (validating at its end, which the unbroken run does not
    do at step 1), then what a process killed while writing step 2 leaves (a half-written temporary
    directory); extended to three steps, the run removes it, resumes from step 1 and computes steps
    2 and 3 exactly as the unbroken three-step run did, leaving step 1's files as they were.
    (Replaces test_interrupted_save_then_resume_reproduces_step_three, which resumed from copies
    of the unbroken run's checkpoints: it checked the same removal, resume and equality.)"""
    ckpt = tmp_path / "ckpt"
    assert_ok(nrl_train(tmp_path, model, *LOAD_RNG, "grpo.max_num_steps=1"))
    first = metrics(tmp_path)
    assert [r["step"] for r in first] == [1] and "val/accuracy" in first[0]
    before = {p: p.read_bytes() for p in (ckpt / "step_1").rglob("*") if p.is_file()}
    partial = ckpt / ".tmp_step_2"
    shutil.copytree(ckpt / "step_1" / "policy", partial / "policy")
    for f in (partial / "policy").rglob("*"):
        if f.is_file():
            f.write_bytes(f.read_bytes()[: max(1, f.stat().st_size // 2)])
    resumed = nrl_train(tmp_path, model, *LOAD_RNG)
    assert_ok(resumed)
    assert "removing incomplete" in resumed.stderr and ".tmp_step_2" in resumed.stderr
    assert "resuming from" in resumed.stderr and "step_1" in resumed.stderr
    assert not partial.exists()
    assert {p: p.read_bytes() for p in (ckpt / "step_1").rglob("*") if p.is_file()} == before
    a, b = metrics(three_steps), metrics(tmp_path)
    assert [r["step"] for r in b] == [1, 2, 3]
    strip = lambda row: {k: v for k, v in row.items() if not k.startswith(TIMING)}  # noqa: E731
    assert [strip(r) for r in b[1:]] == [strip(r) for r in a[1:]]


def test_unknown_environment_missing_dataset_and_unwritable_checkpoints_are_one_line(tmp_path, model):
    proc = nrl_train(tmp_path, model, "data.env_name=chess")
    assert proc.returncode == 2
    assert re.search(r"error: data.env_name: environment 'chess' is not available \(installed: [^)]*\bmath\b[^)]*\); "
                     r"install the plugin that provides it", proc.stderr)
    proc = nrl_train(tmp_path, model, f"data.train_data_path={tmp_path / 'nope.jsonl'}")
    assert proc.returncode == 2 and "nope.jsonl" in proc.stderr and "Traceback" not in proc.stderr
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc = nrl_train(tmp_path, model, f"checkpointing.checkpoint_dir={blocker / 'ckpt'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (f"error: checkpointing.checkpoint_dir: '{blocker / 'ckpt'}' cannot be created: '{blocker}' is a file"
            in proc.stderr)


@pytest.mark.slow
def test_an_over_long_prompt_is_dropped_at_load_time_not_sampled(tmp_path, model):
    """The issue's case: one 10k-token prompt in the file killed the run at the step that sampled
    it; now it is dropped with a warning naming its line, and every step runs."""
    rows = [{"problem": f"What is {i} + {i}?", "expected_answer": str(2 * i)} for i in range(4)]
    rows.insert(2, {"problem": "1 + " * 5000 + "1", "expected_answer": "5001"})
    data = write_jsonl(rows, tmp_path / "train.jsonl")
    proc = nrl_train(tmp_path, model, f"data.train_data_path={data}", "data.dataset_name=null",
                     "grpo.max_num_steps=2", "grpo.num_prompts_per_step=4", "data.shuffle=false")
    assert_ok(proc)
    assert (f"dropped 1 of 5 examples of {data} whose prompt is too long for policy.max_total_sequence_length=64 "
            f"(no room to generate): {data}:3 (") in proc.stderr
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]
