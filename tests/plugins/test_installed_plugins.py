"""Plugins installed for real with pip and discovered through the ``nrl`` entry-point group.

The four distributions under ``dists/`` are installed into a private ``--target`` directory that
only the subprocesses of these tests put on ``PYTHONPATH``, so the test environment itself is not
changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DISTS = Path(__file__).parent / "dists"
ALL_BUT_MISSPELT = "misspelt"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(target),
         *(str(d) for d in sorted(DISTS.iterdir()) if d.is_dir())],
        check=True, capture_output=True, text=True,
    )
    return target


def nrl(site: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
                   "NRL_STRICT_PLUGINS": "", "NRL_DISABLE_PLUGIN_AUTOLOAD": "", "NRL_TRACE_HOOKS": "", **env}
    environment.setdefault("NRL_BLOCKED_PLUGINS", ALL_BUT_MISSPELT)
    return subprocess.run([sys.executable, "-m", "nrl_core.cli", *args], capture_output=True, text=True, env=environment)


def test_installed_distribution_is_listed_with_its_hooks(site):
    proc = nrl(site, "plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    plugins = {p["name"]: p for p in json.loads(proc.stdout)}
    assert plugins["example"] == {"name": "example", "distribution": "nrl-example-plugin", "version": "1.3.0",
                                  "contract": 14, "hooks": ["nrl_algorithms", "nrl_training_backends"]}
    assert plugins["nrl_core.builtin"]["distribution"] == "nrl-core"


def test_broken_plugin_is_a_warning_and_the_others_load(site):
    proc = nrl(site, "plugins", "--json")
    assert "plugin 'broken' (nrl-broken-plugin 0.0.1) failed to load: RuntimeError: this plugin is broken on purpose" in proc.stderr
    names = {p["name"] for p in json.loads(proc.stdout)}
    assert "example" in names and "broken" not in names


def test_strict_mode_makes_a_broken_plugin_fatal(site):
    proc = nrl(site, "plugins", "--json", NRL_STRICT_PLUGINS="1", NRL_BLOCKED_PLUGINS="misspelt,future")
    assert proc.returncode == 2
    assert "error: plugin 'broken' (nrl-broken-plugin 0.0.1) failed to load" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_misspelt_hook_unloads_its_plugin_only_with_a_did_you_mean(site):
    proc = nrl(site, "plugins", "--json", NRL_BLOCKED_PLUGINS="broken", NRL_STRICT_PLUGINS="0")
    assert proc.returncode == 0, proc.stderr
    assert ("plugin 'misspelt' implements a hook nrl does not define: nrl_training_backend (did you mean "
            "nrl_training_backends?); it is not loaded") in proc.stderr
    names = {p["name"] for p in json.loads(proc.stdout)}
    assert "example" in names and "misspelt" not in names
    strict = nrl(site, "plugins", NRL_BLOCKED_PLUGINS="broken,future", NRL_STRICT_PLUGINS="1")
    assert strict.returncode == 2 and "error: plugin 'misspelt' implements a hook nrl does not define" in strict.stderr


def test_plugin_needing_another_core_version_is_refused_by_name(site):
    proc = nrl(site, "plugins", "--json")
    assert "plugin 'future' (nrl-future-plugin 0.0.1) failed to load: PluginError: needs nrl-core>=99" in proc.stderr


def test_block_list_and_disabled_autoload(site):
    blocked = json.loads(nrl(site, "plugins", "--json", NRL_BLOCKED_PLUGINS="misspelt,example,broken").stdout)
    assert {p["name"] for p in blocked} >= {"nrl_core.builtin"} and "example" not in {p["name"] for p in blocked}
    proc = nrl(site, "plugins", "--json", NRL_DISABLE_PLUGIN_AUTOLOAD="1", NRL_BLOCKED_PLUGINS="")
    assert proc.returncode == 0 and proc.stderr == ""
    assert [p["name"] for p in json.loads(proc.stdout)] == ["nrl_core.builtin"]


def test_installed_backend_is_selected_and_its_algorithm_runs(site, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("policy:\n  model_name: /m\n  example_cfg: {enabled: true}\n  generation: null\n")
    check = nrl(site, "config", "check", str(config))
    assert check.returncode == 0, check.stderr
    assert "training backend: example (nrl-example-plugin)" in check.stdout
    run = nrl(site, "train", "hello", "--config", str(config), "policy.model_name=/other")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "hello from the example plugin: model /other"


def test_a_third_party_algorithm_brings_its_config_section(site, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("policy:\n  model_name: /m\n  example_cfg: {enabled: true}\n  generation: null\n"
                      "hello: {greeting: hi, times: 2}\n")
    assert nrl(site, "config", "check", str(config)).returncode == 0
    run = nrl(site, "train", "hello", "--config", str(config))
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["hi from the example plugin: model /m"] * 2
    for override, line in [("hello.times=0", "error: hello.times: must be positive (1 or more), got 0"),
                           ("+hello.volume=3", "error: hello.volume: unknown key; valid keys are: greeting, times")]:
        bad = nrl(site, "config", "check", str(config), override)
        assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == line, bad.stderr


def test_hook_tracing_prints_calls(site, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("policy:\n  model_name: /m\n  example_cfg: {enabled: true}\n  generation: null\n")
    quiet = nrl(site, "config", "check", str(config))
    traced = nrl(site, "config", "check", str(config), NRL_TRACE_HOOKS="1")
    assert traced.returncode == 0
    assert "nrl_training_backends" not in quiet.stderr
    assert "nrl_training_backends" in traced.stderr and "nrl_environments" in traced.stderr


@pytest.mark.slow
def test_example_backend_passes_the_conformance_kit(site):
    """The example backend's own test module (three lines) run as its author would, against the
    installed distribution: every check of nrl_core.testing.conformance passes."""
    dist = DISTS / "nrl_example_plugin"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
                   "NRL_STRICT_PLUGINS": "1", "NRL_BLOCKED_PLUGINS": "broken,misspelt,future"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=dist,
                          capture_output=True, text=True, env=environment)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "failed" not in summary and " passed" in summary, summary
