"""The one-time conversion at size: rank 0 writes one sharded checkpoint at TP=1; TP=2 and PP=2
load from it, each rank reading only its part (counted in bytes read from the stored tensors); a
rank that cannot see the conversion fails, with every other rank, in one line naming the directory
and ``NRL_MEGATRON_CHECKPOINT_DIR``; with ``convert_on_each_node`` each node converts its own copy."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core", reason="nrl-backend-megatron's engine is not installed")
pytest.importorskip("nrl_backend_megatron")

from _helpers import make_batch, make_config, run_world

from nrl_core.testing.distributed import gather_shards
from nrl_core.testing.tiny_models import cached_tiny_model


@contextmanager
def counting_checkpoint_reads() -> Iterator[list[int]]:
    """Bytes of stored tensors (``*.distcp`` files) read through torch's checkpoint reader, the
    file system layer under Megatron's loader; the index every rank reads is not counted."""
    from torch.distributed.checkpoint import filesystem

    count = [0]

    class Counting(io.FileIO):
        def readinto(self, buffer: Any) -> int:
            n = super().readinto(buffer)
            count[0] += n or 0
            return n

        def read(self, size: int = -1) -> bytes:
            data = super().read(size)
            count[0] += len(data or b"")
            return data

        def readall(self) -> bytes:
            data = super().readall()
            count[0] += len(data)
            return data

    @contextmanager
    def create_stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
        # unbuffered: a buffer's read-ahead would count bytes the reader never asked for
        counted = mode == "rb" and str(path).endswith(".distcp")  # the stored tensors, not the index
        with Counting(str(path), "rb") if counted else Path(path).open(mode) as stream:
            yield stream

    saved = filesystem.FileSystem.create_stream
    filesystem.FileSystem.create_stream = create_stream
    try:
        yield count
    finally:
        filesystem.FileSystem.create_stream = saved


@contextmanager
def counting_conversion_memory() -> Iterator[dict[str, Any]]:
    """What the conversion holds: the bytes of parameters given memory at once (their peak, and
    each part's), and every HF tensor it reads, counted as it goes."""
    from nrl_backend_megatron.convert import sharded

    seen: dict[str, Any] = {"live": 0, "peak": 0, "parts": [], "reads": [], "warnings": []}
    give, open_, warn = sharded._give_memory, sharded.SafetensorsReader.open, sharded.logger.warning

    def counted_give(model: Any, name: str, device: str = "cpu") -> Any:
        param = give(model, name, device)
        seen["live"] += param.nbytes if device != "meta" else -param.nbytes
        seen["peak"] = max(seen["peak"], seen["live"])
        return param

    @contextmanager
    def counted_open(self: Any) -> Iterator[Any]:
        seen["parts"].append(seen["live"])
        with open_(self) as get:
            yield lambda name: seen["reads"].append(name) or get(name)

    sharded._give_memory, sharded.SafetensorsReader.open = counted_give, counted_open
    sharded.logger.warning = lambda message, *args: seen["warnings"].append(message % args)
    try:
        yield seen
    finally:
        sharded._give_memory, sharded.SafetensorsReader.open, sharded.logger.warning = give, open_, warn


@contextmanager
def recording_part_loads() -> Iterator[list[str]]:
    """The order of the load's reads (``read``: one part from dist_checkpointing) and of what goes
    into the model (``into``: a ``load_state_dict``)."""
    import torch
    from megatron.core import dist_checkpointing

    events: list[str] = []
    read, into = dist_checkpointing.load, torch.nn.Module.load_state_dict

    def recorded_read(*args: Any, **kwargs: Any) -> Any:
        events.append("read")
        return read(*args, **kwargs)

    def recorded_into(self: Any, *args: Any, **kwargs: Any) -> Any:
        events.append("into")
        return into(self, *args, **kwargs)

    dist_checkpointing.load, torch.nn.Module.load_state_dict = recorded_read, recorded_into
    try:
        yield events
    finally:
        dist_checkpointing.load, torch.nn.Module.load_state_dict = read, into


def world1(rank: int, world: int, path: str) -> dict[str, Any]:
    from safetensors import safe_open

    from nrl_backend_megatron.worker import MegatronPolicyWorker

    with counting_checkpoint_reads() as read, counting_conversion_memory() as conversion:
        w = MegatronPolicyWorker(make_config(path), rank, world)
    batch = make_batch()
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        hf = {name: f.get_slice(name).get_shape() for name in f.keys()}
    return {"converted": w.conversion.converted, "path": str(w.conversion.path), "read": read[0],
            "logprobs": gather_shards(w.get_logprobs(batch), batch), "conversion": conversion,
            "model_bytes": sum(p.nbytes for p in w.model.parameters()), "hf": sorted(hf)}


def world2(rank: int, world: int, path: str, elsewhere: str) -> dict[str, Any]:
    from nrl_backend_megatron.checkpoint_dir import ENV_VAR
    from nrl_backend_megatron.worker import MegatronPolicyWorker
    from nrl_core.errors import NrlError

    out: dict[str, Any] = {}
    batch = make_batch()
    for tag, megatron in (("tp2", {"tensor_model_parallel_size": 2}), ("pp2", {"pipeline_model_parallel_size": 2})):
        with counting_checkpoint_reads() as read, recording_part_loads() as parts:
            w = MegatronPolicyWorker(make_config(path, megatron=megatron), rank, world)
        out[f"{tag}/part_loads"] = parts
        out[f"{tag}/converted"] = w.conversion.converted
        out[f"{tag}/read"] = read[0]
        out[f"{tag}/logprobs"] = gather_shards(w.get_logprobs(batch), batch)
    if rank == 1:  # as on a node where the variable names a directory rank 0's node does not share
        os.environ[ENV_VAR] = elsewhere
    try:
        MegatronPolicyWorker(make_config(path), rank, world)
    except NrlError as exc:
        out["unseen"] = (type(exc).__name__, str(exc))
    os.environ["LOCAL_RANK"] = "0"  # each rank the first of its "node": by choice, each node converts its own
    w = MegatronPolicyWorker(make_config(path, megatron={"convert_on_each_node": True}), rank, world)
    out["per_node"] = (w.conversion.converted, str(w.conversion.path), gather_shards(w.get_logprobs(batch), batch))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("mcore-sharded")
    path = str(cached_tiny_model("llama"))
    (one,) = run_world(world1, 1, path, env={"NRL_MEGATRON_CHECKPOINT_DIR": str(root)})
    two = run_world(world2, 2, path, str(tmp_path_factory.mktemp("not-shared")),
                    env={"NRL_MEGATRON_CHECKPOINT_DIR": str(root)})
    return one, two


def _size(path: str) -> int:
    """Bytes of the stored tensors (the files torch's checkpoint reader reads)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*.distcp"))


@pytest.mark.slow
def test_tp1_conversion_loads_at_tp2_and_pp2_each_rank_reading_its_part(runs) -> None:
    one, two = runs
    total = _size(one["path"])
    assert one["converted"] and all(not r[f"{t}/converted"] for r in two for t in ("tp2", "pp2"))
    parts = json.loads((Path(one["path"]) / "parts.json").read_text())["parts"]  # saved part by part
    assert Path(one["path"]).name == "nrl_megatron" and len(parts) == 5  # embedding, 2 layers, final norm, head
    assert all((Path(one["path"]) / part["dir"] / "metadata.json").is_file() for part in parts)
    print(f"\nconversion {total} B; read by TP1 {one['read']}, TP2 {[r['tp2/read'] for r in two]}, "
          f"PP2 {[r['pp2/read'] for r in two]}")
    assert one["read"] >= total  # TP=1 reads every stored chunk (each read also parses the chunk's own header)
    for tag in ("tp2", "pp2"):
        reads = [r[f"{tag}/read"] for r in two]
        # each rank about half of what the whole model takes (measured: 0.50-0.52), the replicated norms twice
        assert all(read < 0.6 * one["read"] for read in reads), tag
        assert sum(reads) >= one["read"], tag
        assert (two[0][f"{tag}/logprobs"] - one["logprobs"]).abs().max() < 1e-5, tag


@pytest.mark.slow
def test_the_conversion_holds_one_part_at_a_time_and_reads_each_hf_tensor_once(runs) -> None:
    """Counted, so it holds at any size: the model is built on the meta device, the parameters
    given memory at once never exceed the largest part (one decoder layer, or one module outside
    them), which is less than the model, and each HF tensor is read exactly once."""
    one, _ = runs
    seen = one["conversion"]
    assert seen["live"] == 0 and all(live == 0 for live in seen["parts"])  # each part dropped before the next
    assert len(seen["parts"]) == 5  # embedding, 2 layers, final norm, head
    assert 0 < seen["peak"] < 0.5 * one["model_bytes"]
    assert sorted(seen["reads"]) == one["hf"]
    assert not seen["warnings"]  # built on the meta device: no parameter had memory before its part


@pytest.mark.slow
@pytest.mark.slow
def test_each_part_goes_into_the_model_as_soon_as_it_is_read(runs) -> None:
    """Some of a part's tensors are new ones (a gated MLP's input projection, read as two halves):
    held until every part is read they would add up to a large share of the model. Each rank
    reads a part and puts it into the model before it reads the next."""
    for rank in runs[1]:
        for tag in ("tp2", "pp2"):
            events = rank[f"{tag}/part_loads"]
            assert len(events) >= 4 and events == ["read", "into"] * (len(events) // 2), (tag, events)


def test_each_node_converts_its_own_copy_only_when_asked(runs) -> None:
    one, two = runs
    (reused, path0, lp0), (converted, path1, lp1) = two[0]["per_node"], two[1]["per_node"]
    assert not reused and path0 == one["path"]  # rank 0's node already had one
    assert converted and path1 != path0  # the other "node" converted into its own directory
    assert (lp0 - one["logprobs"]).abs().max() < 1e-5 and (lp1 - lp0).abs().max() == 0


@pytest.mark.slow
def test_a_rank_that_cannot_see_the_conversion_fails_every_rank_in_one_line(runs) -> None:
    _, two = runs
    (kind, message), (kind1, message1) = two[0]["unseen"], two[1]["unseen"]
    assert kind == kind1 == "CheckpointDirError" and message == message1 and "\n" not in message
    assert message.startswith("rank 1 on ") and "NRL_MEGATRON_CHECKPOINT_DIR" in message
    assert "nrl_megatron" in message and "cannot see the converted checkpoint" in message
