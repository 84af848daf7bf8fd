"""The pieces of ``benchmarks/bench_grpo_vs_trl.py`` that can break silently: the process-tree
sampler (memory and busy threads of a real child process), the generated nrl config (must stay a
valid config as the demo's evolves), the FLOP count's weight total (against the model itself), and
``bench_grpo_commits.py``'s PYTHONPATH (a commit's packages must win over the editable installs)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml

from benchmarks.bench_grpo_vs_trl import matmul_weights, nrl_config, phase_lines, phase_table
from benchmarks.process_tree_sampler import TreeSampler, busy_threads
from nrl_core.cli import main
from nrl_core.testing.tiny_models import cached_tiny_model

# A parent that starts a child which allocates 200 MB and spins one thread for 1.5 s.
_TREE = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
         "\"import time; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
         "t = time.time()\\nwhile time.time() - t < 1.5: pass\"], check=True)")


def test_sampler_sees_the_child_memory_and_its_one_busy_thread():
    proc = subprocess.Popen([sys.executable, "-c", _TREE])
    start = time.time()
    with TreeSampler(proc.pid, interval=0.1, mem_interval=0.2) as sampler:
        proc.wait()
    assert proc.returncode == 0
    assert max(s.processes for s in sampler.samples) == 2
    assert sampler.peak("pss") > 200 * 2**20 and sampler.peak("uss") > 200 * 2**20
    busy = busy_threads(sampler.samples, start + 0.5, time.time())
    assert busy["busy_threads"] == 1 and busy["pid"] != proc.pid
    assert 0 < busy["cores"] < 1.2  # one spinning thread; how much of a core it got depends on the machine's load
    assert busy_threads(sampler.samples, start - 10, start - 5) == {}


def test_generated_config_validates(tmp_path, capsys):
    model = cached_tiny_model("llama", size="small")
    path = tmp_path / "grpo_vs_trl.yaml"
    path.write_text(yaml.safe_dump(nrl_config(model, steps=3, log_dir=tmp_path / "logs")))
    assert main(["config", "check", str(path)]) == 0, capsys.readouterr().err


def test_matmul_weights_are_the_models_linear_weights():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model = cached_tiny_model("llama", size="small")
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    linear = sum(m.weight.numel() for m in hf.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_weights(model) == linear


def test_phase_table_compares_an_unsampled_phase_at_the_given_threads():
    step = {"tokens": 1000, "timing": {"generation": 1.0, "logprobs": 0.5, "training": 2.0},
            "threads": {"training": {"busy_threads": 1, "cores": 1.0}}}  # logprobs too short to be sampled
    phases = phase_table([{"steps": [step] * 3}], 1, weights=10**6, mm={1: 2e9, 2: 4e9},
                         forwards={"logprobs": 2, "training": 6}, omp_threads=2)
    assert phases["logprobs"]["threads"] == 2 and phases["logprobs"]["fraction_of_mm"] == pytest.approx(4e9 / 4e9)
    assert phases["training"]["threads"] == 1 and phases["training"]["fraction_of_mm"] == pytest.approx(3e9 / 2e9)
    lines = phase_lines(phases)
    assert lines[0].split() == ["generation", "1.000"]
    assert "not measured" in lines[1] and "on 2 thread(s)" in lines[1] and lines[1].endswith("100%")
    assert "(1.00 cores busy)" in lines[2] and lines[2].endswith("150%")


def test_commit_bench_imports_every_first_party_package_from_the_tree(tmp_path):
    """bench_grpo_commits runs a commit's code through PYTHONPATH: it must win over this venv's
    editable installs, for the core and for the plugin distributions alike."""
    from benchmarks.bench_grpo_commits import source_path

    for package in ("nrl_core", "nrl_backend_dtensor/src/nrl_backend_dtensor", "plugins/nrl_env_math/src/nrl_env_math"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    run_dir = tmp_path / "run"  # the bench's runs start in their own directory, not in the repository
    run_dir.mkdir()
    code = "import nrl_core, nrl_backend_dtensor, nrl_env_math as m; print(nrl_core.__file__, nrl_backend_dtensor.__file__, m.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": source_path(tmp_path)},
                         cwd=run_dir, capture_output=True, text=True, check=True).stdout.split()
    assert len(out) == 3 and all(path.startswith(str(tmp_path)) for path in out), out


def test_commit_bench_refuses_a_name_that_is_no_commit_in_one_line(tmp_path):
    from benchmarks.bench_grpo_commits import checkout

    with pytest.raises(SystemExit, match=r"^'no-such-commit' is not a commit of .*; give a hash, tag or branch"):
        checkout("no-such-commit", tmp_path)
    assert not any(tmp_path.iterdir())  # nothing checked out
