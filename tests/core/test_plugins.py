"""The plugin manager in-process: registries, duplicates, check_pending, dispatch hooks."""

from __future__ import annotations

import pytest

from nrl_core import CheckpointOptions, hookimpl
from nrl_core.contracts import EnvironmentSpec, import_object
from nrl_core.errors import ConfigError, PluginError
from nrl_core.plugins import PluginManager, Registry, get_plugin_manager
from nrl_core.schema import Section


def _env(name: str, distribution: str) -> EnvironmentSpec:
    return EnvironmentSpec(name=name, environment="x:Y", config_schema=Section(), distribution=distribution)


class Envs:
    def __init__(self, *specs):
        self.specs = list(specs)

    @hookimpl
    def nrl_environments(self):
        return self.specs


def test_registered_plugin_is_visible_only_inside_the_block():
    pm = PluginManager()
    with pm.registered(Envs(_env("dice", "nrl-dice")), name="dice-plugin"):
        assert "dice" in pm.environments()
        assert "dice-plugin" in {p.name for p in pm.list_plugins()}
    assert "dice" not in pm.environments()
    assert "dice-plugin" not in {p.name for p in pm.list_plugins()}


def test_a_name_registered_twice_fails_in_one_line_where_it_is_used(caplog):
    """In the registry the other names still resolve, and using the clashing one says which entry
    point to block (NRL_BLOCKED_PLUGINS takes entry-point names); validation and ``nrl plugins``
    refuse any clash up front (tests/core/test_plugin_clashes.py)."""
    pm = PluginManager()
    with pm.registered(Envs(_env("dice", "nrl-dice")), name="a"), \
            pm.registered(Envs(_env("dice", "nrl-dice2")), name="b"), \
            pm.registered(Envs(_env("coin", "nrl-coin")), name="c"):
        registry = pm.environments()
        assert registry.get("coin", "env.coin").distribution == "nrl-coin"
        with pytest.raises(PluginError, match=r"^environment 'dice' is registered twice \(by entry point 'a' of nrl-dice "
                                              r"and by entry point 'b' of nrl-dice2\); uninstall one distribution or "
                                              r"block one entry point, e.g. NRL_BLOCKED_PLUGINS=b$"):
            registry.get("dice", "env.dice")
        assert pm.clashes() == [registry.clashes["dice"]]
    assert "registered twice" in caplog.text


def test_misspelt_hook_registered_in_process_is_rejected():
    class Misspelt:
        @hookimpl
        def nrl_enviroments(self):
            return []

    pm = PluginManager()
    with pytest.raises(PluginError, match="'misspelt' implements a hook nrl does not define: nrl_enviroments "
                                          r"\(did you mean nrl_environments\?\)"):
        with pm.registered(Misspelt(), name="misspelt"):
            pass
    assert "misspelt" not in {p.name for p in pm.list_plugins()}


def test_registry_miss_names_installed_and_the_fix():
    registry = Registry("training backend", [])
    with pytest.raises(ConfigError, match=r"policy.x: training backend 'megatron' is not available \(installed: none\); "
                                          r"pip install nrl-backend-megatron"):
        registry.get("megatron", "policy.x")


def test_dispatch_hook_goes_to_the_owner_and_a_miss_is_an_error(tmp_path):
    class Worker:
        saved: list = []

    class Owner:
        @hookimpl
        def nrl_checkpoint_save(self, worker, path, options):
            if not isinstance(worker, Worker):
                return None
            worker.saved.append((path, options))
            return True

    pm = PluginManager()
    options = CheckpointOptions(async_save=True)
    with pm.registered(Owner(), name="owner"):
        pm.checkpoint_save(Worker(), str(tmp_path), options)
        with pytest.raises(PluginError, match="no installed plugin implements nrl_checkpoint_save for builtins.object"):
            pm.checkpoint_save(object(), str(tmp_path), options)
    assert Worker.saved == [(str(tmp_path), options)]


def test_checkpoint_options_defaults_and_validation():
    assert CheckpointOptions() == CheckpointOptions(fully_parallel_save=True, fully_parallel_load=True,
                                                    async_save=False, load_rng=False)
    assert CheckpointOptions.from_section({"async_save": True, "load_rng": None}).async_save is True
    with pytest.raises(TypeError, match="async_save must be a bool"):
        CheckpointOptions(async_save="yes")
    with pytest.raises(TypeError):
        CheckpointOptions(True)  # keyword-only


def test_import_object_errors_are_one_line():
    with pytest.raises(PluginError, match="not an import path"):
        import_object("no_colon_here")
    with pytest.raises(PluginError, match="cannot import 'nrl_core.nope'"):
        import_object("nrl_core.nope:X")
    with pytest.raises(PluginError, match="has no attribute 'Missing'"):
        import_object("nrl_core.errors:Missing")


def test_process_wide_manager_is_a_singleton():
    assert get_plugin_manager() is get_plugin_manager()
