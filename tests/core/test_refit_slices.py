"""Blocks of refit tensors (``sliced_import``): what a rank names, what the broadcast transport
cuts for it, and the tensor it is handed, which reads inside its block and refuses outside it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from nrl_core.contracts import WeightSpec
from nrl_core.refit.endpoints import slices_of, wanted_part
from nrl_core.refit.manifest import RefitError
from nrl_core.refit.slices import OwnedRegion, WeightSlice, as_owned, cut
from nrl_core.refit.transports import split_by_skips

FULL = torch.arange(48.0).view(8, 6)
ROWS = ((4, 8), (0, 6))  # a column-parallel rank's half
COLUMNS = ((0, 8), (0, 3))  # a row-parallel rank's half


def owned(region):
    return OwnedRegion("w", cut(FULL, region).clone(), region, FULL.shape)


@pytest.mark.parametrize("region, inside, outside", [
    (ROWS, lambda t: t.narrow(0, 4, 4), lambda t: t.narrow(0, 3, 2)),
    (COLUMNS, lambda t: t.narrow(1, 0, 3), lambda t: t[:, 2:4]),
    (ROWS, lambda t: t.chunk(2)[1], lambda t: t.chunk(2)[0]),
    (ROWS, lambda t: t.unsqueeze(0).unbind()[0][5:7], lambda t: t.unsqueeze(0).unbind()[0]),
    (COLUMNS, lambda t: t.t()[1], lambda t: t.t()[4]),
    (ROWS, lambda t: t[6], lambda t: t[1]),
])
def test_a_block_reads_inside_and_refuses_outside(region, inside, outside) -> None:
    tensor = owned(region)
    assert tensor.shape == FULL.shape and tensor.dtype == FULL.dtype
    view = inside(tensor)
    assert type(view) is torch.Tensor and torch.equal(view.clone(), inside(FULL))
    into = torch.empty(view.shape)
    into.copy_(view)
    assert torch.equal(into, inside(FULL))
    for read in (lambda t: t.clone(), lambda t: torch.empty(t.shape).copy_(t), lambda t: t.sum(),
                 lambda t: t.to(torch.float64)):
        with pytest.raises(RefitError, match=r"^refit failed: this engine rank read w outside the block it named"):
            read(outside(tensor))


def test_a_block_that_is_the_whole_tensor_is_the_tensor_itself_and_a_wrong_block_is_refused() -> None:
    assert OwnedRegion("w", FULL, ((0, 8), (0, 6)), FULL.shape) is FULL
    with pytest.raises(RefitError, match=r"w arrived as \[8, 6\], not the block \[\(4, 8\), \(0, 6\)\]"):
        OwnedRegion("w", FULL, ROWS, FULL.shape)


def test_as_owned_hands_blocks_whether_the_transport_cut_them_or_not() -> None:
    shapes = {"w": (8, 6), "norm": (6,)}
    norm = torch.ones(6)
    for sent in (cut(FULL, ROWS).clone(), FULL):
        [[(name, tensor), (other, whole)]] = list(as_owned([[("w", sent), ("norm", norm)]], {"w": ROWS}, shapes))
        assert (name, other) == ("w", "norm") and tensor.shape == (8, 6) and whole is norm
        assert torch.equal(tensor.narrow(0, 4, 4).clone(), FULL[4:])


def test_wanted_part_checks_each_block_against_its_tensor() -> None:
    manifest = [WeightSpec(name="w", shape=(8, 6), dtype="float32"), WeightSpec(name="norm", shape=(6,), dtype="float32")]
    wants = [WeightSlice("w", ROWS), "norm"]
    assert wanted_part(manifest, wants) == manifest and slices_of(wants) == {"w": ROWS}
    for bad in (WeightSlice("w", ((4, 9), (0, 6))), WeightSlice("w", ((0, 4),)), WeightSlice("w", ((5, 4), (0, 6)))):
        with pytest.raises(RefitError, match=r"^refit rejected, weights unchanged; rank 1 asks for w\[.*which is not a "
                                             r"block of its shape \[8, 6\]"):
            wanted_part(manifest, [bad], who="rank 1")


def test_the_broadcast_sender_sends_each_rank_its_block_and_shared_tensors_once() -> None:
    norm, expert = torch.ones(6), torch.zeros(4, 4)
    bucket = [("w", FULL), ("norm", norm), ("expert", expert)]
    skips = {1: frozenset(), 2: frozenset({"expert"})}
    slices = {1: {"w": ((0, 4), (0, 6))}, 2: {"w": ROWS}}
    shared, private = split_by_skips(bucket, [1, 2], skips, slices)
    assert [name for name, _ in shared] == ["norm"]  # both load it whole: broadcast once
    assert [name for name, _ in private[1]] == ["w", "expert"] and [name for name, _ in private[2]] == ["w"]
    assert torch.equal(private[1][0][1], FULL[:4]) and torch.equal(private[2][0][1], FULL[4:])
    # a rank that wants whole what another wants a block of gets it whole, alone
    shared, private = split_by_skips(bucket, [1, 2], skips, {2: {"w": ROWS}})
    assert private[1][0][1] is FULL and torch.equal(private[2][0][1], FULL[4:])


# ---------------------------------------------------------------- every transport, counted per rank

SHAPES = {"embed.weight": (64, 32), "layers.0.qkv.weight": (96, 32), "layers.0.out.weight": (32, 32),
          "layers.0.norm.weight": (31,), "lm_head.weight": (64, 32)}


def _whole_bytes() -> int:
    return sum(4 * torch.Size(shape).numel() for shape in SHAPES.values())


def _block_bytes(world_size: int) -> int:
    """What a rank of ``world_size`` loads: its rows of each tensor they divide, the others whole."""
    return sum(4 * torch.Size(shape).numel() // (world_size if shape[0] % world_size == 0 else 1)
               for shape in SHAPES.values())


def _expected(source, rank: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in source.tensors.items():
        rows = tensor.shape[0] // 2
        out[name] = tensor[rank * rows:(rank + 1) * rows] if tensor.shape[0] % 2 == 0 else tensor
    return out


def test_in_one_process_each_rank_copies_out_its_blocks_alone() -> None:
    from nrl_core.algorithms.refit_orchestrator import refit
    from nrl_core.refit.plan import RefitPlan
    from nrl_core.testing.refit_host import RandomWeightSource, SlicedRecordingSink

    source = RandomWeightSource(SHAPES, seed=7)
    for rank in (0, 1):
        sink = SlicedRecordingSink(rank=rank, world_size=2)
        refit(source, sink, RefitPlan(bucket_bytes=4096, delivery="wanted"))
        assert sink.copied == _block_bytes(2) <= 0.55 * _whole_bytes()
        assert {name: torch.equal(t, _expected(source, rank)[name]) for name, t in sink.received.items()} == \
            dict.fromkeys(SHAPES, True)
    greedy = SlicedRecordingSink(rank=1, world_size=2)
    greedy.overreach = True
    with pytest.raises(RefitError, match=r"^refit failed: this engine rank read embed\.weight outside the block it named"):
        refit(source, greedy, RefitPlan(bucket_bytes=4096, delivery="wanted"))


@pytest.fixture(scope="module")
def groups():
    from tests.core.test_refit import ray_groups_of

    yield from ray_groups_of("nrl_core.testing.refit_host:SlicedRecordingSink", SHAPES)


def _counts(worker) -> tuple[int, int]:
    from nrl_core.refit.transports import broadcast_bytes_received

    return worker.copied, broadcast_bytes_received()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["broadcast", "shared_memory"])
def test_between_actors_each_rank_receives_and_copies_out_its_blocks_alone(groups, transport) -> None:
    """Over broadcast (across nodes) each rank receives its blocks and the norm, counted by the
    transport; over shared memory (one node) both map the same buckets and each copies out its
    blocks alone."""
    from nrl_core.algorithms.refit_orchestrator import refit
    from nrl_core.cluster._host import WorkerHost
    from nrl_core.refit.plan import RefitPlan

    source, sinks = groups
    report = refit(source.endpoint(0), [sinks.endpoint(0), sinks.endpoint(1)],
                   RefitPlan(transport=transport, bucket_bytes=8192, delivery="wanted"))
    assert report.transport == transport
    counts = sinks.call(WorkerHost.execute, _counts)
    assert [copied for copied, _ in counts] == [_block_bytes(2)] * 2 and _block_bytes(2) <= 0.55 * _whole_bytes()
    if transport == "broadcast":
        assert [received for _, received in counts] == [_block_bytes(2)] * 2
    tensors = source.call(WorkerHost.execute, lambda worker: worker.tensors, on=0)
    for rank, received in enumerate(sinks.call("checksums")):
        blocks = {name: t[rank * (t.shape[0] // 2):(rank + 1) * (t.shape[0] // 2)] if t.shape[0] % 2 == 0 else t
                  for name, t in tensors.items()}
        assert received == {name: float(t.double().sum()) for name, t in blocks.items()}


def test_the_receiving_filters_keep_no_bucket_while_the_next_arrives() -> None:
    """``_without`` and ``as_owned`` between a receiver and the sink: a bucket the sink dropped is
    gone before the next is received (issue 59: one bucket in memory, not two)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from nrl_core.refit.endpoints import _without
    from nrl_core.refit.slices import as_owned

    buffers: list[StorageWeakRef] = []
    alive: list[int] = []

    def bucket(index: int) -> list[tuple[str, torch.Tensor]]:
        flat = torch.zeros(32)
        buffers.append(StorageWeakRef(flat.untyped_storage()))
        return [(f"w{index}", flat[:16].view(4, 4)), (f"x{index}", flat[16:].view(4, 4))]

    def received() -> Iterator[list[tuple[str, torch.Tensor]]]:
        for index in range(3):
            alive.append(sum(not ref.expired() for ref in buffers))
            yield bucket(index)

    slices = {f"w{i}": ((0, 2), (0, 4)) for i in range(3)}
    for handed in as_owned(_without(received(), frozenset({"x1"})), slices, {f"w{i}": (4, 4) for i in range(3)}):
        del handed  # the sink is done with it
    assert alive == [0, 0, 0]
