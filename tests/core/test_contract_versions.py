"""The plugin contract's versions: every version docs/plugins.md lists is served, a worker written
to exactly that version is adapted to the current one, and gaps and wrong types are one line each."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

from nrl_core.contract_adapters import adapted_class
from nrl_core.contract_versions import (
    CONTRACT_HISTORY,
    SERVED_CONTRACTS,
    adapter_path,
    check_result,
    declared_contract,
    methods_of,
    unwrap_path,
    worker_gaps,
)
from nrl_core.contracts import CONTRACT_VERSION, BatchShard, GenerationWorker, TokenBatch, TrainingWorker
from nrl_core.errors import PluginError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "contract.md"


def documented_versions() -> list[int]:
    """The contract versions in docs/contract.md's table (rows ``| N | release | ...``)."""
    section = DOCS.read_text().split("## Versions", 1)[1]
    return [int(m) for m in re.findall(r"^\| (\d+) \| \d+\.\d+\.\d+ \|", section, flags=re.M)]


def worker_of(role: str, version: int) -> type:
    """A worker class with exactly the methods contract ``version`` requires of ``role``; contract 1's
    logprobs are the whole batch's tensor, later ones a BatchShard."""

    def method(name: str):
        if name in ("get_logprobs", "get_reference_logprobs"):
            if version < 2:
                return lambda self, batch: torch.full((batch.size, 3), -1.0)
            return lambda self, batch: BatchShard(rows=list(range(batch.size)), values=torch.full((batch.size, 3), -1.0))
        if name == "generate":
            return lambda self, prompts, *, greedy=False: None
        arity = {m.name: len(m.args) for m in methods_of(role, version)}[name]
        return {0: lambda self: None, 1: lambda self, a: None, 2: lambda self, a, b: None}[arity]

    namespace = {m.name: method(m.name) for m in methods_of(role, version)}
    namespace["weight_version"] = 0
    return type(f"{role.title()}V{version}", (), namespace)


def batch(size: int = 2) -> TokenBatch:
    return TokenBatch(input_ids=torch.ones(size, 3, dtype=torch.long), input_lengths=torch.full((size,), 3), fields={})


def test_the_docs_list_every_served_version_and_the_history_is_ordered():
    assert documented_versions() == list(SERVED_CONTRACTS)
    assert [v.version for v in CONTRACT_HISTORY] == list(range(1, CONTRACT_VERSION + 1))


@pytest.mark.parametrize("version", SERVED_CONTRACTS)
def test_a_training_worker_of_every_served_version_is_adapted_to_the_current_one(version):
    cls = worker_of("training", version)
    assert worker_gaps(cls, "training", version, "p") == []
    adapted = adapted_class(cls, "training", version, "p")
    worker = adapted()
    assert isinstance(worker, TrainingWorker)
    assert isinstance(worker, cls)  # checkpoint hooks recognise the plugin's class in the MRO
    shard = worker.get_logprobs(batch())
    assert isinstance(shard, BatchShard) and shard.rows == [0, 1]
    assert BatchShard.assemble([shard], 2, 3).equal(torch.full((2, 3), -1.0))
    assert worker.offload_before_refit() is None and worker.prepare_for_training() is None


@pytest.mark.parametrize("version", SERVED_CONTRACTS)
def test_a_generation_worker_of_every_served_version_is_adapted_to_the_current_one(version):
    cls = worker_of("generation", version)
    assert worker_gaps(cls, "generation", version, "p") == []
    worker = adapted_class(cls, "generation", version, "p")()
    assert isinstance(worker, GenerationWorker)
    assert worker.finish_generation() in (False, None) and isinstance(worker.sampling_state(), (dict, type(None)))
    worker.shutdown()


def test_the_adapter_path_round_trips_and_resolves_to_the_adapted_class():
    path = adapter_path("tests.core.test_contract_versions:FIRST", "training", 1, "old")
    assert path.startswith("nrl_core.contract_adapters:")
    assert unwrap_path(path) == ("tests.core.test_contract_versions:FIRST", "training", 1, "old")
    assert adapter_path("m:W", "training", CONTRACT_VERSION, "new") == "m:W"
    from nrl_core.contracts import import_object

    adapted = import_object(path)
    assert issubclass(adapted, FIRST) and adapted is import_object(path)
    assert unwrap_path("m:W") == ("m:W", None, CONTRACT_VERSION, None)


FIRST = worker_of("training", 1)


def test_a_missing_method_and_a_wrong_signature_are_one_line_each():
    cls = type("Gappy", (worker_of("training", 3),), {"export_hf": None, "train": lambda self: None})
    del_export = type("NoExport", (), {k: v for k, v in vars(worker_of("training", 3)).items() if k != "export_hf"})
    lines = worker_gaps(del_export, "training", 3, "mine")
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].startswith("plugin 'mine', ") and "TrainingWorker.export_hf(path) is missing" in lines[0]
    assert "contract 1 requires it" in lines[0] and "docs/plugins.md#4-the-worker" in lines[0]
    lines = worker_gaps(cls, "training", 3, "mine")
    assert [line.split(": ", 1)[1].split(" ", 1)[0] for line in lines] == ["train", "export_hf"]
    assert "cannot be called as train(batch, loss_fn)" in lines[0]
    with pytest.raises(PluginError, match="export_hf"):
        adapted_class(del_export, "training", 3, "mine")


def test_an_offload_method_missing_from_a_contract_2_worker_is_a_gap_not_adapted():
    cls = type("NoOffload", (), {k: v for k, v in vars(worker_of("training", 2)).items() if k != "offload_before_refit"})
    (line,) = worker_gaps(cls, "training", 2, "mine")
    assert "offload_before_refit() is missing; contract 2 requires it" in line
    assert worker_gaps(cls, "training", 1, "mine") == []  # written for 1: adapted instead


def test_a_tensor_annotation_where_a_shard_is_due_is_a_gap_from_contract_2():
    def get_logprobs(self, batch) -> torch.Tensor: ...

    cls = type("Annotated", (worker_of("training", 3),), {"get_logprobs": get_logprobs})
    (line,) = worker_gaps(cls, "training", 3, "mine")
    assert "get_logprobs is annotated to return torch.Tensor; contract 2 and later require BatchShard | None" in line
    assert worker_gaps(cls, "training", 1, "mine") == []


def test_a_wrong_result_type_is_one_line_naming_the_method_and_the_type_due():
    shard = BatchShard(rows=[0], values=torch.zeros(1, 1))
    assert check_result("get_logprobs", shard) is shard and check_result("get_logprobs", None) is None
    with pytest.raises(PluginError) as info:
        check_result("get_logprobs", torch.zeros(2, 3))
    message = str(info.value)
    assert message.startswith("get_logprobs returned torch.Tensor; contract 2 and later require a BatchShard or None")
    assert "\n" not in message


def test_the_kit_probes_result_types_before_any_check():
    from nrl_core.testing.conformance.scenarios import result_type_errors

    wrong = type("Wrong", (worker_of("training", 3),), {"get_reference_logprobs": lambda self, b: torch.zeros(2, 3)})()
    (line,) = result_type_errors(wrong, batch())
    assert line.startswith("get_reference_logprobs returned torch.Tensor;")
    assert result_type_errors(worker_of("training", 3)(), batch()) == []


def test_a_plugin_declares_its_contract_with_nrl_contract():
    assert declared_contract(types.ModuleType("silent"), "silent") == 1
    assert declared_contract(types.SimpleNamespace(NRL_CONTRACT=CONTRACT_VERSION), "new") == CONTRACT_VERSION
    with pytest.raises(PluginError, match=rf"written for contract {CONTRACT_VERSION + 1} .* upgrade nrl-core"):
        declared_contract(types.SimpleNamespace(NRL_CONTRACT=CONTRACT_VERSION + 1), "future")
    with pytest.raises(PluginError, match="no longer serves"):
        declared_contract(types.SimpleNamespace(NRL_CONTRACT=0), "ancient")
    with pytest.raises(PluginError, match="must be an int"):
        declared_contract(types.SimpleNamespace(NRL_CONTRACT="3"), "text")


def _entry_point(requirement: str):
    dist = types.SimpleNamespace(requires=[requirement], name="nrl-x", version="1")
    return types.SimpleNamespace(dist=dist, name="x")


def test_an_old_core_range_does_not_refuse_a_plugin_whose_contract_is_served():
    from nrl_core.plugins import _check_core_requirement, _own_version

    major = int(_own_version().split(".")[0])
    old = _entry_point("nrl-core>=0.1,<0.2")
    _check_core_requirement(old)  # before the import: only a newer core is refused
    _check_core_requirement(old, contract=1)
    with pytest.raises(PluginError, match=r"needs nrl-core>=99"):
        _check_core_requirement(_entry_point("nrl-core>=99"))
    with pytest.raises(PluginError, match=rf"needs nrl-core.*{major + 5}"):
        _check_core_requirement(_entry_point(f"nrl-core=={major + 5}.0"), contract=1)
    with pytest.raises(PluginError, match="serves contracts"):
        _check_core_requirement(old, contract=0)


def test_a_worker_declaring_nothing_that_already_meets_a_later_contract_keeps_its_own_methods():
    # the example plugin as the conformance kit first ran it: BatchShard and the hand-off, no NRL_CONTRACT
    current = worker_of("training", CONTRACT_VERSION)
    own_offload = current.offload_before_refit
    adapted = adapted_class(current, "training", 1, "kit-era")
    assert adapted.offload_before_refit is own_offload
    shard = adapted().get_logprobs(batch())
    assert isinstance(shard, BatchShard) and shard.rows == [0, 1]


def test_contract_4_spec_fields_are_accepted_with_a_warning_and_preload_is_still_imported_early():
    """Contract 5 took start-up tuning out of the specs; a plugin written before still loads."""
    from nrl_core.algorithms.policy_launch import _imports_of
    from nrl_core.contracts import LEGACY_PRELOAD, AlgorithmSpec, TrainingBackendSpec
    from nrl_core.schema import Section

    with pytest.warns(FutureWarning, match=r"TrainingBackendSpec\(preload=\.\.\.\) for old_mod:Worker is deprecated "
                                           r"since contract 5: name the modules in the worker class's lazy_imports"):
        spec = TrainingBackendSpec(name="old", config_key="old_cfg", priority=0, worker="old_mod:Worker",
                                   config_schema=Section(fields={}), distribution="old", preload=("heavy.module",))
    import dataclasses

    assert "preload" not in {f.name for f in dataclasses.fields(spec)}
    assert LEGACY_PRELOAD["old_mod:Worker"] == ("heavy.module",)
    assert _imports_of(spec) == ["old_mod:Worker", "heavy.module"]
    with pytest.warns(FutureWarning, match="early_policy_start=...\\) of algorithm 'old' has no effect since contract 5"):
        AlgorithmSpec(name="old", entry="old_mod:main", distribution="old", early_policy_start=True)


def test_the_method_tables_are_read_from_the_protocols():
    from nrl_core.contract_marks import capability_of
    from nrl_core.contract_versions import CAPABILITY_METHODS, GENERATION_METHODS, TRAINING_METHODS
    from nrl_core.contracts import CAPABILITY_PROTOCOLS, GENERATION_CAPABILITIES, TRAINING_CAPABILITIES

    def declared(protocol: type) -> list[str]:
        return [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]

    assert [m.name for m in TRAINING_METHODS] == declared(TrainingWorker)
    assert [m.name for m in GENERATION_METHODS] == declared(GenerationWorker)
    for protocol in CAPABILITY_PROTOCOLS:
        mark = capability_of(protocol)
        assert [m.name for m in CAPABILITY_METHODS[mark.name]] == declared(protocol)
        assert mark.name in (TRAINING_CAPABILITIES if mark.role == "training" else GENERATION_CAPABILITIES)
    assert {m.name: m.since for m in TRAINING_METHODS}["save_checkpoint"] == 4
    assert [m.call() for m in CAPABILITY_METHODS["streaming"]] == ["generate_groups(prompts, group_size, greedy=...)"]


def test_a_declared_capability_without_its_protocol_s_methods_is_one_line():
    cls = worker_of("generation", CONTRACT_VERSION)
    (line,) = worker_gaps(cls, "generation", CONTRACT_VERSION, "mine", capabilities={"streaming"})
    assert "declares 'streaming' but generate_groups(prompts, group_size, greedy=...) is missing" in line
    streams = type("Streams", (cls,), {"generate_groups": lambda self, prompts, group_size, *, greedy=False: iter(())})
    assert worker_gaps(streams, "generation", CONTRACT_VERSION, "mine", capabilities={"streaming"}) == []
