"""A name two plugins register in one registry is refused in one line naming both distributions,
by ``nrl plugins`` and by validation (``nrl config check``, so ``nrl train``), whichever of them
loads first: which one would win depends on load order, so neither may."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "grpo_tiny_cpu.yaml"

PLUGIN = '''
from nrl_core.api import EnvironmentSpec, Section, TrainingBackendSpec, hookimpl

@hookimpl
def nrl_{hook}():
    return [{spec}]
'''
ENVIRONMENT = 'EnvironmentSpec(name="dice", environment="x:Y", config_schema=Section(), distribution="{dist}")'
BACKEND = ('TrainingBackendSpec(name="dtensor", config_key="{module}_cfg", worker="x:Y", distribution="{dist}", '
           'priority=1, config_schema=Section())')


def _nrl(tmp_path: Path, plugins: list[str], *argv: str, blocked: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NRL_PLUGINS": ",".join(plugins), "NRL_BLOCKED_PLUGINS": blocked,
           "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)}
    env.pop("NRL_STRICT_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "nrl_core.cli", *argv], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)


def _write(tmp_path: Path, module: str, hook: str, spec: str) -> None:
    (tmp_path / f"{module}.py").write_text(PLUGIN.format(hook=hook, spec=spec.format(module=module,
                                                                                     dist=module.replace("_", "-"))))


@pytest.mark.parametrize("first, second", [("nrl_dice_a", "nrl_dice_b"), ("nrl_dice_b", "nrl_dice_a")])
def test_two_plugins_naming_one_environment_are_refused_in_either_order(tmp_path, first, second):
    for module in (first, second):
        _write(tmp_path, module, "environments", ENVIRONMENT)
    expected = (f"error: environment 'dice' is registered twice (by entry point '{first}' of "
                f"{first.replace('_', '-')} and by entry point '{second}' of {second.replace('_', '-')}); uninstall "
                f"one distribution or block one entry point, e.g. NRL_BLOCKED_PLUGINS={second}")
    for argv in (["plugins"], ["config", "check", str(CONFIG)]):
        run = _nrl(tmp_path, [first, second], *argv)
        assert run.returncode == 2, (argv, run.stdout, run.stderr)
        assert [line for line in run.stderr.splitlines() if line.startswith("error:")] == [expected], run.stderr
    followed = _nrl(tmp_path, [first, second], "config", "check", str(CONFIG), blocked=second)  # the line's advice
    assert followed.returncode == 0, followed.stdout + followed.stderr


def test_a_plugin_taking_a_first_party_backend_name_is_refused_before_the_config_is_read(tmp_path):
    """The clash the docs promised to refuse and did not: which backend a config got depended on
    ``sys.path`` order, and the losing order said no plugin provides the section."""
    _write(tmp_path, "nrl_other_dtensor", "training_backends", BACKEND)
    run = _nrl(tmp_path, ["nrl_other_dtensor"], "config", "check", str(CONFIG))
    assert run.returncode == 2, run.stdout + run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.stderr
    assert errors[0].startswith("error: training backend 'dtensor' is registered twice (by entry point ")
    assert "of nrl-backend-dtensor and by entry point 'nrl_other_dtensor' of nrl-other-dtensor)" in errors[0]
    assert "NRL_BLOCKED_PLUGINS=nrl_other_dtensor" in errors[0]


def test_without_a_clash_both_commands_pass(tmp_path):
    _write(tmp_path, "nrl_dice_a", "environments", ENVIRONMENT)
    listing = _nrl(tmp_path, ["nrl_dice_a"], "plugins")
    assert listing.returncode == 0 and "nrl_dice_a" in listing.stdout, listing.stdout + listing.stderr
    check = _nrl(tmp_path, ["nrl_dice_a"], "config", "check", str(CONFIG))
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("body, said", [
    ('raise RuntimeError("the catalogue\\nis offline")', "nrl_environments raised RuntimeError: the catalogue is offline "
                                                         "(NRL_DEBUG=1 shows its traceback)"),
    ('return {"dice": 1}', "nrl_environments returned dict; it must return a list of specs (or None)"),
], ids=["raises", "answers-a-dict"])
def test_a_hook_that_fails_while_the_registry_is_built_is_one_line_naming_its_plugin(tmp_path, body, said):
    (tmp_path / "nrl_broken_hook.py").write_text(
        f"from nrl_core.api import hookimpl\n\n@hookimpl\ndef nrl_environments():\n    {body}\n")
    for argv in (["plugins"], ["config", "check", str(CONFIG)]):
        run = _nrl(tmp_path, ["nrl_broken_hook"], *argv)
        assert run.returncode == 2 and "Traceback" not in run.stderr, (argv, run.stderr)
        errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
        assert errors == [f"error: plugin 'nrl_broken_hook' (an NRL_PLUGINS module): {said}"], run.stderr
