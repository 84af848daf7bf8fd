"""One received bucket in memory at a time (``nrl_gen_vllm.released``): a consumer that keeps a
tensor past its bucket, as vLLM's layerwise reload keeps a part-loaded module's weights, still
lets the bucket's buffer go before the next bucket is received, and reads the same values."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from nrl_core.contracts import WeightSpec
from nrl_core.refit.manifest import verified_stream
from nrl_core.refit.slices import OwnedRegion
from nrl_gen_vllm.refit_reads import RefitReadCounter
from nrl_gen_vllm.released import released


def _received(count: int, alive: list[int]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of two tensors as views of a fresh buffer each, yielded from a call as the core's
    receivers yield them; each records, before its buffer is allocated, how many earlier buffers
    are still alive."""
    for index in range(count):
        alive.append(sum(not ref.expired() for ref in _buffers))
        yield _bucket(index)


def _bucket(index: int) -> list[tuple[str, torch.Tensor]]:
    flat = torch.full((64,), float(index))
    _buffers.append(StorageWeakRef(flat.untyped_storage()))
    return [(f"b{index}.first", flat[:32].view(4, 8)), (f"b{index}.second", flat[32:].view(4, 8))]


_buffers: list[StorageWeakRef] = []


def _manifest(count: int, shape: tuple[int, ...] = (4, 8)) -> list[WeightSpec]:
    return [WeightSpec(name=f"b{i}.{part}", shape=shape, dtype="float32")
            for i in range(count) for part in ("first", "second")]


def test_a_tensor_kept_past_its_bucket_does_not_keep_the_buffer() -> None:
    _buffers.clear()
    alive: list[int] = []
    kept = []
    for name, tensor in verified_stream(released(_received(4, alive)), _manifest(4)):
        if name.endswith("second"):  # the straddling module: its first weight waits for the next bucket
            kept.append(tensor)
    assert alive == [0, 0, 0, 0]  # each buffer gone before the next was allocated
    assert [float(t.sum()) for t in kept] == [0.0, 32.0, 64.0, 96.0]  # the kept tensors read as received


def test_without_release_the_kept_tensor_holds_its_buffer() -> None:
    """The failure the module prevents, so that the test above can fail."""
    _buffers.clear()
    alive: list[int] = []
    kept = []
    for name, tensor in verified_stream(_received(3, alive), _manifest(3)):
        if name.endswith("second"):
            kept.append(tensor)
    assert alive == [0, 1, 2]


def test_the_read_counter_follows_a_released_tensor() -> None:
    """A rank learning its blocks: the release's copy is no read of its loaders, and their later
    reads of a kept tensor still count under its name, at the box they read."""
    _buffers.clear()
    alive: list[int] = []
    counter = RefitReadCounter()
    kept = []
    with counter:
        kept = [(name, tensor) for name, tensor in counter.track(verified_stream(released(_received(2, alive)),
                                                                                 _manifest(2)))
                if name.endswith("second")]
        for _, tensor in kept:
            torch.empty(2, 4).copy_(tensor[1:3, 4:])
    assert alive == [0, 0]
    assert {name: counter.bytes_read[name] for name, _ in kept} == {name: 2 * 4 * 4 for name, _ in kept}
    assert {name: counter.regions[name] for name, _ in kept} == {name: [[1, 3], [4, 8]] for name, _ in kept}


def test_an_owned_regions_block_is_released() -> None:
    _buffers.clear()
    alive: list[int] = []

    def as_regions(buckets: Iterator[list[tuple[str, torch.Tensor]]]) -> Iterator[list[tuple[str, object]]]:
        return map(lambda bucket: [(name, OwnedRegion(name, tensor, ((0, 4), (0, 8)), (8, 8)))
                                   for name, tensor in bucket], buckets)

    kept = [region for name, region in verified_stream(released(as_regions(_received(2, alive))), _manifest(2, (8, 8)))
            if name.endswith("second")]
    assert alive == [0, 0]
    assert [float(region.narrow(0, 0, 4).sum()) for region in kept] == [0.0, 32.0]


def test_a_buffer_its_transport_keeps_is_not_copied_out_of() -> None:
    """Shared memory's receiver keeps each file mapped from refit to refit: copying a kept tensor
    out of it would free nothing, so the tensor stays a view of the mapping."""
    mapping = torch.arange(64.0)

    def kept_mapping() -> Iterator[list[tuple[str, torch.Tensor]]]:
        yield [("b0.first", mapping[:32].view(4, 8)), ("b0.second", mapping[32:].view(4, 8))]

    kept = [tensor for name, tensor in verified_stream(released(kept_mapping()), _manifest(1)) if name.endswith("second")]
    assert kept[0].untyped_storage().data_ptr() == mapping.untyped_storage().data_ptr()
    assert torch.equal(kept[0], mapping[32:].view(4, 8))


def test_a_mapped_file_is_copied_out_of_only_when_it_ends_with_the_bucket(tmp_path) -> None:
    """A file's pages stay until the file is removed, so copying out of its mapping frees nothing,
    unless the file goes with the bucket (the async engine's parts, removed once loaded)."""
    path = str(tmp_path / "part")
    torch.arange(64.0).numpy().tofile(path)

    def mapped() -> Iterator[list[tuple[str, torch.Tensor]]]:
        yield _file_bucket(path)

    for ends, copied in ((False, False), (True, True)):
        kept = [tensor for name, tensor in verified_stream(released(mapped(), files_end_with_the_bucket=ends),
                                                           _manifest(1)) if name.endswith("second")]
        assert (kept[0].untyped_storage().filename is None) is copied
        assert torch.equal(kept[0], torch.arange(32.0, 64.0).view(4, 8))


def _file_bucket(path: str) -> list[tuple[str, torch.Tensor]]:
    data = torch.from_file(path, shared=True, size=64, dtype=torch.float32)
    return [("b0.first", data[:32].view(4, 8)), ("b0.second", data[32:].view(4, 8))]


def test_only_the_tensors_still_held_are_copied(monkeypatch) -> None:
    """A copy costs time and memory: the tensors the engine let go are not copied, the last of
    each bucket included."""
    import nrl_gen_vllm.released as module

    copied: list[tuple[int, ...]] = []
    copy = module._own_copy
    monkeypatch.setattr(module, "_own_copy", lambda tensor: (copied.append(tuple(tensor.shape)), copy(tensor)))
    _buffers.clear()
    kept = []
    for name, tensor in verified_stream(released(_received(3, [])), _manifest(3)):
        if name.endswith("first"):
            kept.append(tensor)
        del tensor  # an engine's loop variable would hold the last one: a copy, and correct, but not this test
    assert len(copied) == 3 and [float(t.sum()) for t in kept] == [0.0, 32.0, 64.0]
