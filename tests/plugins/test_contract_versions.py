"""Plugins of an older contract and plugins that break theirs, installed for real (pip --target):
``nrl plugins`` names each plugin's contract, ``nrl config check`` passes an adaptable one and
refuses a gap in one line, and the conformance kit names gaps in one line each, never crashing
inside itself. GRPO on the first-contract backend: tests/e2e/test_first_contract_plugin.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nrl_core.contracts import CONTRACT_VERSION

DISTS = Path(__file__).parent / "dists"
FIRST = "nrl_first_contract_plugin"
GAPS = "nrl_contract_gaps_plugin"
LACKING = ("error: plugin 'contract_gaps', nrl_contract_gaps_plugin.LackingWorker: TrainingWorker.export_hf(path) is "
           "missing; contract 1 requires it (docs/plugins.md#4-the-worker)")
WRONG_TYPE = ("error: plugin 'contract_gaps', nrl_contract_gaps_plugin.WrongTypeWorker: get_logprobs is annotated to "
              "return torch.Tensor; contract 2 and later require BatchShard | None (nrl_core.contracts.BatchShard) "
              "(docs/plugins.md#4-the-worker)")


def install(target: Path, *dists: str) -> Path:
    """A private, non-editable install of ``dists`` (names under ``dists/``) into ``target``."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target",
                    str(target), *(str(DISTS / d) for d in dists)], check=True, capture_output=True, text=True)
    return target


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return install(tmp_path_factory.mktemp("contract-site"), FIRST, GAPS)


def environment(site: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
            "NRL_STRICT_PLUGINS": "1", "NRL_BLOCKED_PLUGINS": "", "NRL_DISABLE_PLUGIN_AUTOLOAD": "", **extra}


def nrl(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nrl_core.cli", *args], capture_output=True, text=True,
                          env=environment(site))


def config(tmp_path: Path, backend: str) -> Path:
    path = tmp_path / f"{backend}.yaml"
    path.write_text(f"policy:\n  model_name: /m\n  {backend}_cfg: {{enabled: true}}\n  generation: null\n")
    return path


def test_plugins_lists_each_plugin_with_its_contract(site):
    proc = nrl(site, "plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    plugins = {p["name"]: p for p in json.loads(proc.stdout)}
    # written for nrl-core 0.1 (its range says <0.2) and declaring nothing: contract 1, still served
    assert plugins["first_contract"]["distribution"] == "nrl-first-contract-plugin"
    assert plugins["first_contract"]["contract"] == 1
    assert plugins["contract_gaps"]["contract"] == 3
    assert plugins["nrl_core.builtin"]["contract"] == CONTRACT_VERSION
    text = nrl(site, "plugins")
    assert any(line.startswith("first_contract ") and " contract 1 " in line for line in text.stdout.splitlines())


def test_config_check_passes_the_first_contract_backend_and_says_what_it_adapts(site, tmp_path):
    proc = nrl(site, "config", "check", str(config(tmp_path, "first_contract")))
    assert proc.returncode == 0, proc.stderr
    assert "training backend: first_contract (nrl-first-contract-plugin)" in proc.stdout
    assert (f"contract: training backend 'first_contract' is written for contract 1 (this core: {CONTRACT_VERSION}); adapted: no-op "
            "offload_before_refit, no-op offload_after_refit, no-op prepare_for_training, tensor logprobs wrapped "
            "into BatchShard, checkpoints through the plugin's (deprecated) checkpoint hooks") in proc.stdout


@pytest.mark.parametrize("backend,line", [("lacking", LACKING), ("wrongtype", WRONG_TYPE)])
def test_config_check_refuses_a_gap_in_one_line(site, tmp_path, backend, line):
    proc = nrl(site, "config", "check", str(config(tmp_path, backend)))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [line]


def test_the_kit_names_each_gap_in_one_line_before_anything_runs(site):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests",
                           "-k", "test_worker_satisfies_the_training_protocol"], cwd=DISTS / GAPS,
                          capture_output=True, text=True, env=environment(site), timeout=300)
    assert proc.returncode != 0
    out = proc.stdout
    for line in (LACKING, WRONG_TYPE):
        assert line.removeprefix("error: ") + "\n" in out, out[-3000:]
    assert "Traceback" not in out and "BatchShard.assemble" not in out and "run_distributed" not in out
    assert "2 errors" in out.strip().splitlines()[-1]


@pytest.mark.slow
def test_the_first_contract_backend_passes_the_conformance_kit_adapted(site):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                          cwd=DISTS / FIRST, capture_output=True, text=True, env=environment(site))
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "failed" not in summary and " passed" in summary, summary
