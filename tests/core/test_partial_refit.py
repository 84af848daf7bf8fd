"""Partial import (contract 14): an engine rank names the tensors it loads, gets only those through
every transport, and over the broadcast transport receives only those bytes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nrl_core.algorithms.refit_orchestrator import refit
from nrl_core.refit import RefitError
from nrl_core.refit.plan import RefitPlan
from nrl_core.refit.transports import split_by_skips
from nrl_core.testing.refit_host import PartialRecordingSink, RandomWeightSource

SHAPES = {"embed.weight": (64, 32), "layers.0.w": (32, 96), "layers.0.b": (96,), "layers.1.w": (96, 32),
          "layers.1.b": (32,), "norm.weight": (32,)}
PARTS = {0: ["embed", "norm", "layers.0."], 1: ["embed", "norm", "layers.1."]}


def _nbytes(names: list[str]) -> int:
    return sum(4 * int(torch.Size(SHAPES[name]).numel()) for name in names)


def _owned(rank: int) -> list[str]:
    return [name for name in SHAPES if any(part in name for part in PARTS[rank])]


def test_what_one_receiver_loads_goes_to_it_alone_and_the_rest_to_all() -> None:
    bucket = [(name, torch.zeros(1)) for name in ("a", "b", "c", "d", "unknown")]
    skips = {1: frozenset("cd"), 2: frozenset("bd"), 3: frozenset("bcd")}
    shared, private = split_by_skips(bucket, [1, 2, 3], skips)
    # "a": everyone; "b": rank 1 alone; "c": rank 2 alone; "d": nobody; "unknown" (the manifest never
    # named it, so nobody skips it) to everyone, whose manifest check refuses it
    assert [name for name, _ in shared] == ["a", "unknown"]
    assert {rank: [name for name, _ in tensors] for rank, tensors in private.items()} == {1: ["b"], 2: ["c"]}
    # two of three receivers load "b" (one rank in each of two engines): broadcast, so the sender
    # still sends each byte once
    shared, private = split_by_skips(bucket, [1, 2, 3], {3: frozenset("b")})
    assert [name for name, _ in shared] == ["a", "b", "c", "d", "unknown"] and private == {}


def test_in_one_process_a_partial_sink_gets_only_what_it_names() -> None:
    source = RandomWeightSource(SHAPES, seed=3)
    sink = PartialRecordingSink(PARTS, rank=1)
    report = refit(source, sink, RefitPlan(bucket_bytes=4096, delivery="wanted"))
    assert report.version == 1 and sink.asked == 1
    assert sorted(sink.received) == sorted(_owned(1))
    assert all(torch.equal(sink.received[name], source.tensors[name]) for name in _owned(1))
    whole = PartialRecordingSink(PARTS, rank=1)
    refit(source, whole, RefitPlan(bucket_bytes=4096))  # a refit that is not partial: the whole model, as before
    assert sorted(whole.received) == sorted(SHAPES) and whole.asked == 0


def test_a_sink_naming_a_tensor_the_source_does_not_send_is_refused_before_anything_loads() -> None:
    sink = PartialRecordingSink({0: ["embed"]})
    sink.refit_wants = lambda manifest: ["embed.weight", "layers.9.w"]  # type: ignore[method-assign]
    with pytest.raises(RefitError, match=r"^refit rejected, weights unchanged; the engine asks for 1 tensors the "
                                         r"training side does not send: layers\.9\.w"):
        refit(RandomWeightSource(SHAPES), sink, RefitPlan(delivery="wanted"))
    assert sink.weight_version == 0 and sink.received == {}


@pytest.fixture(scope="module")
def groups() -> Any:
    from tests.core.test_refit import ray_groups_of

    yield from ray_groups_of("nrl_core.testing.refit_host:PartialRecordingSink", SHAPES, {"parts": PARTS})


def _received_bytes(worker: Any) -> int:
    from nrl_core.refit.transports import broadcast_bytes_received

    return broadcast_bytes_received()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["broadcast", None])
def test_each_rank_gets_and_receives_only_its_part(groups, transport) -> None:
    """Over broadcast the embedding and norm (both ranks load them) are broadcast and each layer is
    sent to its rank alone: the bytes each rank received are its part's, counted by the transport."""
    from nrl_core.cluster._host import WorkerHost

    source, sinks = groups
    report = refit(source.endpoint(0), [sinks.endpoint(0), sinks.endpoint(1)], RefitPlan(transport=transport, bucket_bytes=8192, delivery="wanted"))
    assert report.transport == (transport or "shared_memory")
    expected = source.call("checksums", on=0)
    for rank, received in enumerate(sinks.call("checksums")):
        assert received == {name: expected[name] for name in _owned(rank)}
    if transport == "broadcast":
        assert sinks.call(WorkerHost.execute, _received_bytes) == [_nbytes(_owned(0)), _nbytes(_owned(1))]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["broadcast", None])
def test_a_rank_naming_an_unknown_tensor_is_refused_in_one_line_and_nothing_changes(groups, transport) -> None:
    from nrl_core.cluster._host import WorkerHost

    source, sinks = groups
    versions = sinks.call(WorkerHost.execute, lambda worker: worker.weight_version)
    sinks.call(WorkerHost.execute, _ask_for_a_missing_tensor, on=1)
    try:
        with pytest.raises(RefitError, match=r"asks for 1 tensors the training side does not send: layers\.7\.w"):
            refit(source.endpoint(0), [sinks.endpoint(0), sinks.endpoint(1)], RefitPlan(transport=transport, bucket_bytes=8192, delivery="wanted"))
    finally:
        sinks.call(WorkerHost.execute, lambda worker: delattr(worker, "refit_wants"), on=1)
    if transport == "broadcast":  # refused before anything was sent: neither rank loaded
        assert sinks.call(WorkerHost.execute, lambda worker: worker.weight_version) == versions
    else:  # each rank decides for itself: the other one loaded
        assert sinks.call(WorkerHost.execute, lambda worker: worker.weight_version) == [versions[0] + 1, versions[1]]
    refit(source.endpoint(0), [sinks.endpoint(0), sinks.endpoint(1)], RefitPlan(transport=transport, bucket_bytes=8192, delivery="wanted"))


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["broadcast", None])
def test_a_tensor_the_manifest_never_named_still_reaches_every_rank_and_is_refused(groups, transport) -> None:
    """Partial import drops only what a rank said it does not load: a training side that sends a
    tensor its manifest left out is refused by each rank's manifest check, as without it."""
    from nrl_core.cluster._host import WorkerHost

    source, sinks = groups
    versions = sinks.call(WorkerHost.execute, lambda worker: worker.weight_version)
    source.call(WorkerHost.execute, _send_an_unlisted_tensor)
    try:
        with pytest.raises(RefitError, match=r"refit rejected, weights unchanged; unexpected 1: layers\.9\.w"):
            refit(source.endpoint(0), [sinks.endpoint(0), sinks.endpoint(1)], RefitPlan(transport=transport, bucket_bytes=8192, delivery="wanted"))
    finally:
        source.call(WorkerHost.execute, lambda worker: delattr(worker, "export_weights"))
    assert sinks.call(WorkerHost.execute, lambda worker: worker.weight_version) == versions


def _send_an_unlisted_tensor(worker: Any) -> None:
    real = type(worker).export_weights.__get__(worker)

    def export_weights(bucket_bytes: int, dtype: str) -> Any:
        yield from real(bucket_bytes, dtype)
        yield [("layers.9.w", torch.ones(8))]

    worker.export_weights = export_weights


def _ask_for_a_missing_tensor(worker: Any) -> None:
    worker.refit_wants = lambda manifest: [spec.name for spec in manifest] + ["layers.7.w"]


@pytest.mark.slow
def test_a_rank_that_loads_nothing_receives_nothing(groups) -> None:
    """vLLM's async engine at tensor-parallel size 2: its first rank loads the whole model into both
    workers, and the second holds its place."""
    from nrl_core.cluster._host import WorkerHost

    source, sinks = groups
    sinks.call(WorkerHost.execute, _load_nothing, on=1)
    try:
        refit(source.endpoint(0), [sinks.endpoint(0), sinks.endpoint(1)], RefitPlan(transport="broadcast", bucket_bytes=8192, delivery="wanted"))
        assert sinks.call(WorkerHost.execute, _received_bytes) == [_nbytes(_owned(0)), 0]
    finally:
        sinks.call(WorkerHost.execute, lambda worker: delattr(worker, "refit_wants"), on=1)


def _load_nothing(worker: Any) -> None:
    worker.refit_wants = lambda manifest: []


def test_declaring_partial_import_needs_refit_wants_callable_with_the_manifest() -> None:
    from nrl_core.contract_versions import worker_gaps

    class Forgot:
        pass

    class Wrong:
        def refit_wants(self) -> list[str]:
            return []

    (forgot,) = [g for g in worker_gaps(Forgot, "generation", 14, "mine", {"partial_import"}) if "declares 'partial_import'" in g]
    assert forgot.endswith("declares 'partial_import' but refit_wants(manifest) is missing (docs/plugin_reference.md"
                           "#a-generation-backend-nrl_coregeneration_kit)")
    (wrong,) = [g for g in worker_gaps(Wrong, "generation", 14, "mine", {"partial_import"}) if "'partial_import' requires" in g]
    assert "'partial_import' requires refit_wants(manifest)" in wrong
    assert not [g for g in worker_gaps(PartialRecordingSink, "generation", 14, "mine", {"partial_import"})
                if "'partial_import'" in g]
