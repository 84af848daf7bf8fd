"""Every hook is documented (who calls it, when, what it returns), listed in the architecture
doc, and exercised by at least one test (datasette's rule)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from nrl_core import hookspecs

REPO = Path(__file__).resolve().parents[2]
HOOKS = sorted(name for name, fn in vars(hookspecs).items() if name.startswith("nrl_") and inspect.isfunction(fn))


def test_there_are_hooks():
    assert len(HOOKS) == 18


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_documented(name):
    doc = inspect.getdoc(getattr(hookspecs, name)) or ""
    assert "Called" in doc, f"{name}: say who calls it and when"
    kinds = ("Collecting", "first non-None result", "by the driver")
    assert any(kind in doc for kind in kinds), f"{name}: say collecting, first-result or driver-side lifecycle"
    assert f"`{name}" in (REPO / "docs" / "architecture.md").read_text(), f"{name} missing from docs/architecture.md"


@pytest.mark.parametrize("name", HOOKS)
def test_hook_has_a_test(name):
    tests = [p for p in (REPO / "tests").rglob("test_*.py") if p.name != "test_hookspecs.py"]
    plugin_sources = list((REPO / "tests").rglob("*.py"))
    used_in_tests = any(name in p.read_text() for p in tests + plugin_sources if p.name != "test_hookspecs.py")
    assert used_in_tests, f"no test implements or calls {name}"


def test_hook_arguments_have_no_defaults():
    # pluggy never passes an argument to an implementation parameter with a default value.
    for name in HOOKS:
        for param in inspect.signature(getattr(hookspecs, name)).parameters.values():
            assert param.default is inspect.Parameter.empty, f"{name}({param.name}) must not have a default"
