"""Contract 4: checkpoints are the worker's own methods. A worker of contracts 1-3 is adapted so
that its plugin's (now deprecated) checkpoint hooks still save and load it, exactly as before,
with one warning per worker class naming the replacement."""

from __future__ import annotations

import logging

import pytest

from nrl_core import hookimpl
from nrl_core.contract_adapters import adapted_class
from nrl_core.contracts import CONTRACT_VERSION, CheckpointOptions
from nrl_core.errors import PluginError
from nrl_core.plugins import get_plugin_manager
from tests.core.test_contract_versions import worker_of

OPTIONS = CheckpointOptions()


class CurrentWorker(worker_of("training", 4)):
    calls: list[str] = []

    def save_checkpoint(self, path: str, options: CheckpointOptions) -> None:
        self.calls.append(f"save {path}")

    def load_checkpoint(self, path: str, options: CheckpointOptions) -> None:
        self.calls.append(f"load {path}")


OldWorker = worker_of("training", 3)  # no checkpoint methods: contract 3 had none


class OldWorkerWithMethods(OldWorker):
    """A contract-3 worker whose plugin forwarded the hooks to methods of the same names."""

    def save_checkpoint(self, path: str, options: CheckpointOptions) -> None:
        raise AssertionError("a contract-3 plugin's hooks decide how its worker saves")


class OldPlugin:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def _answer(self, worker, what: str, path: str) -> bool | None:
        if not isinstance(worker, OldWorker):
            return None  # not this plugin's worker
        self.calls.append(f"hook {what} {path}")
        return True

    @hookimpl
    def nrl_checkpoint_save(self, worker, path, options):
        return self._answer(worker, "save", path)

    @hookimpl
    def nrl_checkpoint_load(self, worker, path, options):
        return self._answer(worker, "load", path)


def test_the_core_calls_a_current_workers_methods_and_no_hook() -> None:
    plugin, worker = OldPlugin(), CurrentWorker()
    with get_plugin_manager().registered(plugin, name="old"):
        worker.save_checkpoint("/ckpt", OPTIONS)
        worker.load_checkpoint("/ckpt", OPTIONS)
    assert worker.calls == ["save /ckpt", "load /ckpt"] and plugin.calls == []


@pytest.mark.parametrize("cls", [OldWorker, OldWorkerWithMethods], ids=["without-methods", "with-methods"])
def test_a_contract_3_worker_checkpoints_through_its_plugins_hooks_warning_once(
        cls: type, caplog: pytest.LogCaptureFixture) -> None:
    plugin, worker = OldPlugin(), adapted_class(cls, "training", 3, "old")()
    with get_plugin_manager().registered(plugin, name="old"), caplog.at_level(logging.WARNING):
        worker.save_checkpoint("/a", OPTIONS)
        worker.save_checkpoint("/b", OPTIONS)
        worker.load_checkpoint("/b", OPTIONS)
    assert plugin.calls == ["hook save /a", "hook save /b", "hook load /b"]
    warnings = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(warnings) == 1 and f"set NRL_CONTRACT = {CONTRACT_VERSION}" in warnings[0]


def test_an_old_worker_no_plugin_saves_is_one_line_naming_the_methods() -> None:
    orphan = adapted_class(worker_of("training", 2), "training", 2, "orphaned")()
    with pytest.raises(PluginError, match=r"no installed plugin implements nrl_checkpoint_save for .*; give the "
                                          r"worker save_checkpoint\(path, options\)"):
        orphan.save_checkpoint("/x", OPTIONS)
