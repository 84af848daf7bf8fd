"""The explicit runtime: below ``nrl_core.algorithms`` (the layers ``.importlinter`` lists after it)
no module reaches the process-wide plugin manager, and no module keeps a launched worker group in
a global to be fished out later; the CLI's :class:`~nrl_core.algorithms.runtime.Runtime` carries
both. ``tests/e2e/test_grpo.py`` shows a run taking the group the runtime launched early."""

from __future__ import annotations

import ast
import configparser
import inspect
from pathlib import Path

import pytest

from nrl_core.algorithms.runtime import Runtime, call_with_runtime

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "nrl_core"
#: Where the global lives and is defined, not reached.
DEFINES_IT = {"plugins.py"}
#: The one reach allowed, with its reason: the deprecated checkpoint hooks of contract 1-3 plugins
#: are a dispatch over every plugin of the worker's process (in-process registrations included),
#: and the adapter that serves those old plugins has nothing else to dispatch over.
ALLOWED = {"contract_adapters.py": 2}  # lines naming it: its import and its call
#: Launched groups are handed over through the runtime; the one module-level set of groups is
#: the watchdog's weak registry of the live ones, read to dump and stop every process of a hang.
LIVE_REGISTRY = {("cluster/worker_group.py", "_LIVE")}
GROUP_TYPES = ("WorkerGroup", "LaunchedGroup", "LaunchedPolicy")


def layers_below_algorithms() -> list[str]:
    """The modules and packages ``core-layers`` puts below ``algorithms``, as paths under nrl_core."""
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    layers = [line.strip() for line in config["importlinter:contract:core-layers"]["layers"].splitlines() if line.strip()]
    below = layers[layers.index("algorithms") + 1:]
    return [name.strip() for layer in below for name in layer.split("|")]


def modules_below_algorithms() -> list[Path]:
    found = []
    for name in layers_below_algorithms():
        package, module = CORE / name, CORE / f"{name}.py"
        found += sorted(package.rglob("*.py")) if package.is_dir() else [module] if module.exists() else []
    return [path for path in found if path.relative_to(CORE).as_posix() not in DEFINES_IT]


def reaches_the_global_manager(source: str) -> list[int]:
    """Lines that name ``get_plugin_manager``: imported, called or passed along."""
    tree = ast.parse(source)
    lines = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id == "get_plugin_manager"]
    lines += [node.lineno for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and node.attr == "get_plugin_manager"]
    lines += [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
              and any(alias.name == "get_plugin_manager" for alias in node.names)]
    return sorted(set(lines))


def globals_holding_groups(source: str) -> list[str]:
    """Module-level names annotated or assigned as worker groups, and names a function rebinds with
    ``global`` to a launched group (a call to ``launch_*`` or ``WorkerGroup``)."""
    tree = ast.parse(source)
    held = []
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                any(kind in ast.unparse(node.annotation) for kind in GROUP_TYPES):
            held.append(node.target.id)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                any(kind in ast.unparse(node.value.func) for kind in ("WorkerGroup", "launch_")):
            held += [target.id for target in node.targets if isinstance(target, ast.Name)]
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        declared = {name for node in ast.walk(function) if isinstance(node, ast.Global) for name in node.names}
        for node in ast.walk(function):
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None and \
                    any(kind in ast.unparse(node.value) for kind in ("launch_", "WorkerGroup(")):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                held += [t.id for t in targets if isinstance(t, ast.Name) and t.id in declared]
    return held


def test_the_layers_below_the_algorithms_are_the_ones_the_contract_names():
    below = layers_below_algorithms()
    assert {"cluster", "refit", "config", "data", "logging", "checkpoint", "watchdog", "contract_adapters"} <= set(below)
    assert "algorithms" not in below and "cli" not in below
    assert len(modules_below_algorithms()) > 60


def test_nothing_below_the_algorithms_reaches_the_global_plugin_manager():
    reached = {path.relative_to(CORE).as_posix(): lines for path in modules_below_algorithms()
               if (lines := reaches_the_global_manager(path.read_text()))}
    assert {module: len(lines) for module, lines in reached.items()} == ALLOWED, \
        f"pass the registries down instead (nrl_core/algorithms/runtime.py): {reached}"


@pytest.mark.parametrize("source", [
    "from nrl_core.plugins import get_plugin_manager\n",
    "def f():\n    from nrl_core import plugins\n    return plugins.get_plugin_manager().datasets()\n",
    "def f(pm=None):\n    return pm or get_plugin_manager()\n",
])
def test_the_scan_finds_every_way_of_reaching_it(source):
    assert reaches_the_global_manager(source)


def test_no_module_keeps_a_launched_worker_group_in_a_global():
    held = {(path.relative_to(CORE).as_posix(), name) for path in sorted(CORE.rglob("*.py"))
            for name in globals_holding_groups(path.read_text())}
    assert held == LIVE_REGISTRY, "hand launched groups over through the run's Runtime"


@pytest.mark.parametrize("source", [
    "_early: LaunchedPolicy | None = None\n",
    "_early = None\ndef launch(config):\n    global _early\n    _early = launch_policy(config)\n",
    "GROUP = WorkerGroup('m:W', 2, name='g')\n",
])
def test_the_scan_finds_every_way_of_parking_a_group(source):
    assert globals_holding_groups(source)


def test_an_algorithm_entry_gets_the_runtime_only_when_it_takes_one():
    runtime = Runtime.__new__(Runtime)
    seen = []

    def current(config, runtime=None):
        seen.append(runtime)

    def older(config):
        seen.append("no runtime")

    call_with_runtime(current, {}, runtime)
    call_with_runtime(older, {}, runtime)
    assert seen == [runtime, "no runtime"]
    from nrl_core.algorithms import dpo, grpo, sft

    for entry in (grpo.main, sft.main, dpo.main):
        assert "runtime" in inspect.signature(entry).parameters, entry
