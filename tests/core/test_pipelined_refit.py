"""Pipelined refit without any engine: the handle channel, the per-tensor manifest check, and a
refit between Ray actors where the sinks load each bucket while the source exports the next."""

from __future__ import annotations

import contextlib
import glob
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from nrl_core.algorithms.refit_orchestrator import refit
from nrl_core.refit.buckets import iter_buckets, manifest_bytes
from nrl_core.refit.channel import ChannelAddress, ChannelReader, ChannelWriter, channel_directory, remove_channel
from nrl_core.refit.manifest import RefitError, TornRefitError, verified_stream
from nrl_core.refit.plan import RefitPlan
from nrl_core.refit.transports import RefitSession
from nrl_core.testing.refit_host import RandomWeightSource
from tests.core.test_refit import ray_groups_of

SHAPES = {"embed.weight": (64, 32), "layers.0.w": (32, 96), "layers.0.b": (96,), "layers.1.w": (96, 32),
          "norm.weight": (32,), "scalar": ()}


def _channel_files(before: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The refit channels' files in shared memory, less ``before``: those of refits this test did
    not make (another test's, running beside it on the machine)."""
    return sorted(set(glob.glob(os.path.join(channel_directory(), "nrl-refit-*-chan-*"))) - set(before))


def _address() -> ChannelAddress:
    return ChannelAddress(RefitSession().id)


# --------------------------------------------------------------------------- the channel


def test_channel_delivers_header_and_handles_in_order_to_every_reader_while_they_are_written() -> None:
    address = _address()
    writer = ChannelWriter(address)
    got: dict[int, list[Any]] = {0: [], 1: []}

    def read(i: int) -> None:
        reader = ChannelReader(address, timeout_s=30)
        got[i].append(reader.header())
        got[i].extend(reader.handles())

    threads = [threading.Thread(target=read, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    try:
        writer.header("session", ["manifest"])
        for k in range(5):
            time.sleep(0.01)  # the readers are already waiting on the next handle
            writer.put({"bucket": k})
        writer.close()
        for t in threads:
            t.join(30)
        assert got[0] == got[1] == [("session", ["manifest"]), *({"bucket": k} for k in range(5))]
    finally:
        remove_channel(address)
    assert not glob.glob(address.prefix + "*")


def test_channel_reader_raises_the_writers_error_after_what_arrived() -> None:
    address = _address()
    writer = ChannelWriter(address)
    writer.header("s", [])
    writer.put("first")
    writer.fail(RuntimeError("export broke"))
    try:
        reader = ChannelReader(address, timeout_s=30)
        reader.header()
        handles = reader.handles()
        assert next(handles) == "first"
        with pytest.raises(RefitError, match="the exporting side raised RuntimeError: export broke"):
            next(handles)
    finally:
        remove_channel(address)


def test_channel_reader_stops_waiting_when_the_exporter_is_gone_or_at_its_timeout() -> None:
    address = _address()
    ChannelWriter(address).header("s", [])
    try:
        start = time.monotonic()
        with pytest.raises(RefitError, match="ended without finishing its weights"):
            list(ChannelReader(address, timeout_s=300, exporter_done=lambda: True).handles())
        assert time.monotonic() - start < 60  # noticed at the liveness check, not at the 300 s timeout
        with pytest.raises(RefitError, match=r"no weights from the exporting side in 0 s \(waiting for .*h000000\)"):
            list(ChannelReader(address, timeout_s=0.05).handles())
    finally:
        remove_channel(address)


# --------------------------------------------------------------------------- per-tensor checks


def _buckets(source: RandomWeightSource) -> list[list[tuple[str, torch.Tensor]]]:
    return list(source.export_weights(2048, "float32"))


def test_verified_stream_passes_the_manifests_tensors_as_they_come() -> None:
    source = RandomWeightSource(SHAPES, seed=1)
    manifest = source.weight_manifest("float32")
    assert [n for n, _ in verified_stream(_buckets(source), manifest)] == [s.name for s in manifest]


@pytest.mark.parametrize("defect, field, match", [
    ("extra", "extra", r"failed part-way: bogus: unexpected"),
    ("duplicate", "duplicate", r"failed part-way: layers.0.w: sent more than once"),
    ("reshaped", "mismatched", r"failed part-way: layers.0.w: wrong shape or dtype \(got \[96, 32\] float32, "
                               r"expected \[32, 96\] float32\)"),
    ("missing", "missing", r"failed part-way: missing 1: scalar"),
])
def test_verified_stream_stops_at_the_first_bad_tensor_after_the_good_ones(defect, field, match) -> None:
    source = RandomWeightSource(SHAPES, seed=1)
    manifest = source.weight_manifest("float32")
    named = [item for bucket in _buckets(source) for item in bucket]
    if defect == "extra":
        named.insert(2, ("bogus", torch.zeros(3)))
    elif defect == "duplicate":
        named.insert(2, named[1])
    elif defect == "reshaped":
        named[1] = (named[1][0], named[1][1].reshape(96, 32))
    else:
        named = named[:-1]
    passed = []
    with pytest.raises(TornRefitError, match=match) as raised:
        for name, _ in verified_stream(iter_buckets(iter(named), 2048), manifest):
            passed.append(name)
    assert getattr(raised.value, field) and passed == [n for n, _ in named[:len(passed)]]
    assert len(passed) == (len(named) if defect == "missing" else 1 if defect == "reshaped" else 2)


def test_a_pipelined_export_publishes_chunks_of_whole_tensors_whatever_the_bucket_size() -> None:
    from nrl_core.refit.endpoints import _Chunked

    source = RandomWeightSource(SHAPES, seed=3)
    chunks = list(_Chunked(source, 2048).export_weights(1 << 30, "float32"))
    assert len(list(source.export_weights(1 << 30, "float32"))) == 1 and len(chunks) > 1
    assert [n for c in chunks for n, _ in c] == [s.name for s in source.weight_manifest("float32")]
    assert all(sum(t.numel() * t.element_size() for _, t in c) <= 2048 or len(c) == 1 for c in chunks)


# --------------------------------------------------------------------------- between Ray actors

PIPELINED_SINK = "nrl_core.testing.refit_host:PipelinedRecordingSink"


@pytest.fixture(scope="module")
def ray_groups():
    """A weight source and two pipelined sinks, each a worker group of one rank."""
    yield from ray_groups_of(PIPELINED_SINK)


def _sinks(group: Any) -> list[Any]:
    return [group.endpoint(r) for r in range(group.world_size)]


def _hold_after_first_bucket(marker: str, what: str) -> Any:
    """Make the hosted source, after its first bucket, wait for ``marker`` (which the sinks create
    when their first tensor arrives), then ``what``: "continue", "raise" or "die"."""

    def patch(worker: Any) -> None:
        real = type(worker).export_weights.__get__(worker)

        def export_weights(bucket_bytes: int, dtype: str) -> Any:
            buckets = real(bucket_bytes, dtype)
            yield next(buckets)
            deadline = time.monotonic() + 30
            while not os.path.exists(marker):
                if time.monotonic() > deadline:
                    raise RuntimeError("no sink loaded the first bucket while the export was under way")
                time.sleep(0.005)
            if what == "raise":
                raise RuntimeError("the training side failed mid-export")
            if what == "die":
                os._exit(1)
            yield from buckets

        worker.export_weights = export_weights

    return patch


def _set_marker(marker: str | None) -> Any:
    def set_it(worker: Any) -> None:
        worker.on_first_tensor = marker
    return set_it


@contextlib.contextmanager
def _held_export(source: Any, sinks: Any, marker: str, what: str) -> Iterator[None]:
    """The sinks mark their first tensor and the source holds after its first bucket (then
    ``what``); both undone on the way out."""
    from nrl_core.cluster._host import WorkerHost

    sinks.call(WorkerHost.execute, _set_marker(marker))
    source.call(WorkerHost.execute, _hold_after_first_bucket(marker, what))
    try:
        yield
    finally:
        source.call(WorkerHost.execute, lambda worker: delattr(worker, "export_weights"))
        sinks.call(WorkerHost.execute, _set_marker(None))


@pytest.mark.slow
def test_sinks_load_the_first_bucket_before_the_export_ends_and_receive_every_tensor(ray_groups, tmp_path) -> None:
    others = set(_channel_files())
    source, sinks = ray_groups
    with _held_export(source, sinks, str(tmp_path / "first-tensor"), "continue"):
        report = refit(source.endpoint(0), _sinks(sinks), RefitPlan(bucket_bytes=2048, mode="pipelined"))
    assert (report.transport, report.placement) == ("shared_memory", "same_node")
    assert sinks.call("checksums") == [source.call("checksums", on=0)] * 2
    assert report.bytes == 2 * manifest_bytes(RandomWeightSource(SHAPES).weight_manifest("float32"))
    assert not _channel_files(others)  # the channel went with the refit's cleanup


@pytest.mark.slow
def test_an_export_that_fails_part_way_tears_the_sinks_until_the_next_refit(ray_groups, tmp_path) -> None:
    others = set(_channel_files())
    from nrl_core.cluster import WorkerRaisedError
    from nrl_core.cluster._host import WorkerHost

    source, sinks = ray_groups
    with _held_export(source, sinks, str(tmp_path / "first-tensor"), "raise"):
        with pytest.raises(WorkerRaisedError, match=r"source\[rank 0\] pid \d+: nrl_refit_export_streamed\(\) raised "
                                                    r"RuntimeError: the training side failed mid-export"):
            refit(source.endpoint(0), _sinks(sinks), RefitPlan(bucket_bytes=2048, mode="pipelined"))
    torn = sinks.call(WorkerHost.execute, lambda worker: worker.torn)
    assert all(t and "the exporting side raised RuntimeError: the training side failed mid-export" in t for t in torn)
    assert all(n > 0 for n in sinks.call(WorkerHost.execute, lambda worker: worker.loaded))
    refit(source.endpoint(0), _sinks(sinks), RefitPlan(bucket_bytes=2048, mode="pipelined"))  # the next refit restores them
    assert sinks.call(WorkerHost.execute, lambda worker: worker.torn) == [None, None]
    assert sinks.call("checksums") == [source.call("checksums", on=0)] * 2
    assert not _channel_files(others)


@pytest.mark.slow
def test_a_source_that_dies_mid_export_ends_the_sinks_wait_at_once(ray_groups, tmp_path) -> None:
    """The sinks hold a reference to the export call: its failure ends their wait for the next
    bucket, long before the channel's timeout."""
    others = set(_channel_files())
    from nrl_core.cluster import WorkerDiedError, WorkerGroup
    from nrl_core.cluster._host import WorkerHost

    _, sinks = ray_groups
    marker = str(tmp_path / "first-tensor")
    doomed = WorkerGroup("nrl_core.testing.refit_host:RandomWeightSource", 1, name="doomed-source",
                         init_kwargs={"shapes": SHAPES, "seed": 8}, distributed_backend="none")
    sinks.call(WorkerHost.execute, _set_marker(marker))
    try:
        doomed.call(WorkerHost.execute, _hold_after_first_bucket(marker, "die"))
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"^doomed-source\[rank 0\] pid \d+ died"):
            refit(doomed.endpoint(0), _sinks(sinks), RefitPlan(bucket_bytes=2048, mode="pipelined", timeout_s=300))
        assert time.monotonic() - start < 120
        torn = sinks.call(WorkerHost.execute, lambda worker: worker.torn)
        assert all(t and "ended without finishing its weights" in t for t in torn)
    finally:
        sinks.call(WorkerHost.execute, _set_marker(None))
        doomed.shutdown()
    assert not _channel_files(others)  # the sink that saw the exporter gone removed its channel


def _shift_weights(worker: Any) -> None:
    """``WorkerHost.execute`` target: the source's weights change (a training step's stand-in)."""
    for tensor in worker.tensors.values():
        tensor.add_(1.0)


def _stop_reading_after_first_bucket(worker: Any) -> None:
    """``WorkerHost.execute`` target: this sink's next pipelined import stops after one bucket."""
    real = type(worker).import_weights_pipelined.__get__(worker)

    def import_weights_pipelined(buckets: Any, manifest: Any) -> int:
        def cut() -> Iterator[Any]:
            for k, bucket in enumerate(buckets):
                if k == 1:
                    raise RuntimeError("the engine stopped reading")
                yield bucket
        del worker.import_weights_pipelined  # once
        return real(cut(), manifest)

    worker.import_weights_pipelined = import_weights_pipelined


@pytest.mark.slow
def test_broadcast_receivers_load_as_it_arrives_and_one_that_stops_still_lets_the_group_finish(ray_groups) -> None:
    """Over the broadcast group each pipelined sink loads a bucket as it arrives. One that stops
    part-way reads the rest of the stream, so the sender and the other sink finish: that one has
    every weight, the stopped one is torn until the next refit, which goes through the same group."""
    from nrl_core.cluster._host import WorkerHost
    from nrl_core.refit.manifest import TornRefitError

    source, sinks = ray_groups
    sinks.call(WorkerHost.execute, lambda worker: setattr(worker, "loaded", 0))
    report = refit(source.endpoint(0), _sinks(sinks), RefitPlan(transport="broadcast", bucket_bytes=2048, mode="pipelined"))
    assert report.transport == "broadcast"
    tensors = len(RandomWeightSource(SHAPES).weight_manifest("float32"))
    assert sinks.call(WorkerHost.execute, lambda worker: worker.loaded) == [tensors, tensors]  # as they came
    assert sinks.call("checksums") == [source.call("checksums", on=0)] * 2
    source.call(WorkerHost.execute, _shift_weights, on=0)  # new weights: a torn sink then holds a mix
    sinks.call(WorkerHost.execute, _stop_reading_after_first_bucket, on=0)
    with pytest.raises(TornRefitError, match="the engine stopped reading"):  # a group left waiting: a timeout
        refit(source.endpoint(0), _sinks(sinks), RefitPlan(transport="broadcast", bucket_bytes=2048, mode="pipelined", timeout_s=60))
    torn = sinks.call(WorkerHost.execute, lambda worker: worker.torn)
    assert torn[0] and "the engine stopped reading" in torn[0] and torn[1] is None
    assert sinks.call("checksums", on=1) == source.call("checksums", on=0)  # the other sink got it all
    refit(source.endpoint(0), _sinks(sinks), RefitPlan(transport="broadcast", bucket_bytes=2048, mode="pipelined"))
    assert sinks.call(WorkerHost.execute, lambda worker: worker.torn) == [None, None]
    assert sinks.call("checksums") == [source.call("checksums", on=0)] * 2
