"""The public API's boundary: ``nrl_core.api`` serves every name it lists, lazily, and import-linter
holds the first-party plugins to it (``.importlinter``, run by scripts/test.sh)."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nrl_core import api

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _first_party_packages() -> set[str]:
    return {p.name for pattern in ("nrl_*/src/nrl_*", "plugins/*/src/nrl_*") for p in ROOT.glob(pattern)
            if (p / "__init__.py").exists()}


def _contracts() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    return config


def _lines(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip()]


def test_the_reference_and_stub_are_generated_from_the_table():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "api_reference.py"), "--check"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_plugin_entry_module_loads_no_engine():
    """Discovery imports every plugin's entry module, so the API names they take must not drag an
    engine in: each installed entry point of the ``nrl`` group, imported as discovery does."""
    program = ("import importlib, importlib.metadata as md, sys\n"
               "eps = md.entry_points(group='nrl')\n"
               "for ep in eps: importlib.import_module(ep.value.split(':')[0])\n"
               "print(len(eps), sorted(m for m in ('torch', 'ray', 'transformers', 'vllm', 'megatron') "
               "if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    count, loaded = run.stdout.strip().split(" ", 1)
    assert int(count) >= len(_first_party_packages()) and loaded == "[]", run.stdout


def test_a_name_not_in_the_api_is_one_line_naming_the_reference():
    with pytest.raises(AttributeError, match="^nrl_core.api has no name 'Registry'; docs/api.md lists them$"):
        api.Registry  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name 'Registry' from 'nrl_core.api'"):
        from nrl_core.api import Registry  # noqa: F401
    assert "TokenBatch" in dir(api) and "TokenBatch" in api.__all__


def test_a_public_name_is_the_internal_object_itself():
    from nrl_core.api import NONFINITE_KEY, TokenBatch
    from nrl_core.contracts import TokenBatch as internal
    from nrl_core.nonfinite import KEY

    assert TokenBatch is internal and NONFINITE_KEY == KEY


def test_the_boundary_contract_covers_every_first_party_plugin():
    contract = _contracts()["importlinter:contract:public-api"]
    assert set(_lines(contract["source_modules"])) == _first_party_packages()
    assert set(_lines(_contracts()["importlinter"]["root_packages"])) == _first_party_packages() | {"nrl_core"}


def _with_plugin(tmp_path: Path, package: str, search_path: Path) -> tuple[Path, dict[str, str]]:
    """The project's own contracts with one more plugin package held to them, and an environment
    that can import it."""
    config = _contracts()
    for section, key in (("importlinter", "root_packages"), ("importlinter:contract:public-api", "source_modules")):
        config[section][key] += f"\n{package}"
    path = tmp_path / "planted.importlinter"
    with path.open("w") as out:
        config.write(out)
    paths = (str(search_path), os.environ.get("PYTHONPATH"))
    return path, {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _lint(config: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo", "--contract", "public-api", str(config)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("source, kept", [
    ("from nrl_core.api import ConfigError, EnvironmentSpec\n", True),
    ("from nrl_core.errors import ConfigError\n", False),
    ("def load():\n    from nrl_core.algorithms.setup import load_tokenizer\n    return load_tokenizer\n", False),
    ("from nrl_core import hookimpl\n", False),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nrl_core.contracts import TokenBatch\n", False),
], ids=["through-the-api", "an-internal-module", "inside-a-function", "the-package-root", "for-type-checkers"])
def test_the_boundary_contract_refuses_a_planted_internal_import(tmp_path, source, kept):
    package = tmp_path / "nrl_planted_plugin"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "hooks.py").write_text(source)
    run = _lint(*_with_plugin(tmp_path, "nrl_planted_plugin", tmp_path))
    assert (run.returncode == 0) is kept, run.stdout + run.stderr
    if not kept:
        assert "nrl_planted_plugin.hooks -> nrl_core" in run.stdout, run.stdout


def test_the_walkthrough_plugin_keeps_to_the_public_api(tmp_path):
    """The example third parties copy (docs/plugins.md) is held to the same boundary."""
    run = _lint(*_with_plugin(tmp_path, "nrl_example_plugin", ROOT / "tests" / "plugins" / "dists" / "nrl_example_plugin"))
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("plant, contract, broken", [
    ({}, "core-layers", None),
    ({"config/planted.py": "def run():\n    from nrl_core.algorithms.setup import load_tokenizer\n"}, "core-layers",
     "nrl_core.config is not allowed to import nrl_core.algorithms"),
    ({"schema_extra.py": "from nrl_core.contracts import TokenBatch\n"}, "core-layers", None),  # unlisted: free
    ({"data/ping.py": "from nrl_core.data import pong\n", "data/pong.py": "from nrl_core.data import ping\n"},
     "core-acyclic", "No cycles are allowed in nrl_core.data"),
], ids=["as-is", "an-upward-import", "an-unlisted-module", "a-cycle"])
def test_the_core_s_layer_and_cycle_contracts_refuse_a_planted_import(tmp_path, plant, contract, broken):
    """A copy of nrl_core with modules planted in it, linted by the project's own contracts."""
    shutil.copytree(ROOT / "nrl_core", tmp_path / "nrl_core", ignore=shutil.ignore_patterns("__pycache__"))
    for relative, source in plant.items():
        (tmp_path / "nrl_core" / relative).write_text(source)
    config = _contracts()
    config["importlinter"]["root_packages"] = "\nnrl_core"
    path = tmp_path / "core.importlinter"
    with path.open("w") as out:
        config.write(out)
    run = subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo", "--contract", contract, str(path)],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path,
                         timeout=120)
    assert (run.returncode == 0) is (broken is None), run.stdout + run.stderr
    if broken is not None:
        assert broken in run.stdout, run.stdout
