"""The pieces of ``benchmarks/bench_grpo_vs_trl.py`` that can break silently: the process-tree
sampler (memory and busy threads of a real child process), the generated nrl config (must stay a
valid config as the demo's evolves) and the FLOP count's weight total (against the model itself)."""

from __future__ import annotations

import subprocess
import sys
import time

import yaml

from benchmarks.bench_grpo_vs_trl import matmul_weights, nrl_config
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
