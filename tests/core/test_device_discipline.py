"""The CPU-side guard for GPU runs: every collective goes through ``nrl_core.device``, and what
that module does to devices, checked on the CPU (gloo, world size 1 and 2).

Why a source check: a CPU tensor handed to a collective on an NCCL group fails only on a GPU
node, which the suite never sees; parsing the source catches the call wherever it is written.
Object collectives (``broadcast_object_list``, ``all_gather_object``) and ``barrier`` are left
out: torch puts their tensors on the group's device itself.
"""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest
import torch

from nrl_core import device
from nrl_core.contracts import TokenBatch
from nrl_core.errors import NrlError
from nrl_core.testing.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("nrl_backend_dtensor/src", "nrl_backend_megatron/src", "nrl_core/refit", "nrl_gen_vllm/src")
TENSOR_COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
    "broadcast", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv",
})
_DIST_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")


def direct_collectives(source: str, filename: str) -> list[str]:
    """``file:line name`` of every call of a ``torch.distributed`` tensor collective in ``source``,
    however it was imported (``import torch``, ``import torch.distributed as dist``, ``from
    torch.distributed import all_reduce``, ``from torch import distributed``)."""
    tree = ast.parse(source, filename)
    modules: set[str] = set()  # local names bound to torch.distributed
    functions: dict[str, str] = {}  # local name -> collective
    torch_names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in _DIST_MODULES and alias.asname:
                    modules.add(alias.asname)
                elif alias.name.split(".")[0] == "torch":
                    torch_names.add(alias.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if node.module in _DIST_MODULES and alias.name in TENSOR_COLLECTIVES:
                    functions[alias.asname or alias.name] = alias.name
                elif f"{node.module}.{alias.name}" in _DIST_MODULES:
                    modules.add(alias.asname or alias.name)

    def dotted(expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Name):
            return expr.id
        if isinstance(expr, ast.Attribute):
            base = dotted(expr.value)
            return None if base is None else f"{base}.{expr.attr}"
        return None

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        if name is None:
            continue
        head, _, last = name.rpartition(".")
        if (not head and last in functions) or (last in TENSOR_COLLECTIVES and (
                head in modules or (head.split(".")[0] in torch_names and
                                    ("torch." + head.partition(".")[2]) in _DIST_MODULES))):
            found.append(f"{filename}:{node.lineno} {functions.get(last, last)}")
    return found


def test_every_collective_goes_through_nrl_core_device() -> None:
    offenders = []
    for folder in CHECKED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            offenders += direct_collectives(path.read_text(), str(path.relative_to(ROOT)))
    assert not offenders, ("direct torch.distributed collectives (use nrl_core.device, which puts tensors on "
                           "the group's device):\n" + "\n".join(offenders))


@pytest.mark.parametrize("source, name", [
    ("import torch.distributed as dist\ndist.all_reduce(t)\n", "all_reduce"),
    ("import torch\ntorch.distributed.broadcast(t, src=0)\n", "broadcast"),
    ("from torch.distributed import all_gather as ag\nag(parts, t)\n", "all_gather"),
    ("from torch import distributed\ndistributed.reduce_scatter_tensor(out, t)\n", "reduce_scatter_tensor"),
    ("import torch.distributed.distributed_c10d as c10d\nc10d.all_to_all_single(out, t)\n", "all_to_all_single"),
])
def test_the_guard_finds_direct_collectives_however_imported(source: str, name: str) -> None:
    assert direct_collectives(source, "x.py") == [f"x.py:2 {name}"]


def test_the_guard_leaves_object_collectives_and_other_broadcasts_alone() -> None:
    source = ("import torch.distributed as dist\nimport torch\ndist.broadcast_object_list(box, src=0)\n"
              "dist.barrier()\ntorch.broadcast_tensors(a, b)\nself._pg.broadcast([t], opts)\n")
    assert direct_collectives(source, "x.py") == []


# --------------------------------------------------------------------------- where collectives run


@pytest.mark.parametrize("config, tensor, expected", [
    ("cpu:gloo,cuda:gloo", "cpu", "cpu"),
    ("cpu:gloo,cuda:gloo", "cuda", "cpu"),  # gloo: host tensors
    ("cuda:nccl", "cpu", "cuda"),  # NCCL accepts only CUDA tensors
    ("cuda:nccl", "cuda", "cuda"),
    ("cpu:gloo,cuda:nccl", "cpu", "cpu"),  # a mixed group takes each tensor where it is
    ("cpu:gloo,cuda:nccl", "cuda", "cuda"),
    ("cpu:gloo,cuda:nccl", "meta", "cuda"),
    ("cpu:mpi", "cpu", "cpu"),  # other backends: left alone
])
def test_collective_device_follows_the_groups_backends(config: str, tensor: str, expected: str) -> None:
    assert device.collective_device(config, torch.device(tensor)).type == expected


def test_process_group_backend_is_mixed_only_with_cuda() -> None:
    assert device.process_group_backend(cuda=True) == "cpu:gloo,cuda:nccl"
    assert device.process_group_backend(cuda=False) == "gloo"


@pytest.mark.parametrize(("requested", "cuda", "expected"), [
    ("auto", True, "cpu:gloo,cuda:nccl"), ("auto", False, "gloo"), ("nccl", True, "cpu:gloo,cuda:nccl"),
    ("gloo", True, "gloo"), ("none", True, "none")])
def test_ray_worker_groups_join_the_mixed_group_on_gpus(requested: str, cuda: bool, expected: str) -> None:
    """What a worker group's ranks join (decided on the driver from what every actor sees), and
    whether they pick their CUDA device first: any group that includes NCCL."""
    from nrl_core.cluster.worker_group import group_backend

    backend = group_backend(requested, cuda=cuda)
    assert backend == expected
    assert device.uses_nccl(backend) is (expected != "gloo" and expected != "none")
    assert device.uses_nccl("nccl") and not device.uses_nccl("cpu:gloo")


def _collectives(rank: int, world: int) -> dict:
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    out = {"sum": device.all_reduce(t).tolist(), "same_object": True}
    out["max"] = device.all_reduce_values([rank, -rank], op=dist.ReduceOp.MAX)
    out["gather"] = [p.tolist() for p in device.all_gather(torch.tensor([rank, 10 * rank]))]
    b = torch.tensor([rank * 7.0, 1.0])
    out["broadcast"] = device.broadcast(b, src=1).tolist()
    out["same_object"] = device.broadcast(b, src=1) is b
    return out


def test_collectives_reduce_gather_and_broadcast_in_place_at_world_size_2() -> None:
    results = run_distributed(_collectives, 2)
    for r in results:
        assert r["sum"] == [3.0] and r["max"] == [1.0, 0.0]
        assert r["gather"] == [[0, 0], [1, 10]] and r["broadcast"] == [7.0, 1.0] and r["same_object"]


# --------------------------------------------------------------------------- batches, offload, precision


def _batch() -> TokenBatch:
    return TokenBatch(input_ids=torch.ones(2, 3, dtype=torch.long), input_lengths=torch.tensor([3, 2]),
                      fields={"advantages": torch.zeros(2, 3), "token_mask": torch.ones(2, 3)})


def test_to_device_moves_every_tensor_of_nested_batches_and_copies_nothing_in_place() -> None:
    batch = _batch()
    assert device.to_device(batch, "cpu").input_ids is batch.input_ids  # already there: no copy
    moved = device.to_device({"b": batch, "rows": [1, 2], "t": (batch.input_lengths,)}, "meta")
    assert moved["b"].fields["advantages"].device.type == "meta" and moved["b"].input_ids.device.type == "meta"
    assert moved["t"][0].device.type == "meta" and moved["rows"] == [1, 2]
    assert batch.input_ids.device.type == "cpu"  # the input is left as it was


def test_check_batch_device_names_the_field_on_the_wrong_device(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = _batch()
    batch.fields["advantages"] = batch.fields["advantages"].to("meta")
    monkeypatch.delenv(device.CHECK_DEVICES_ENV, raising=False)
    device.check_batch_device(batch, torch.device("cpu"), "train")  # off: no cost, no check
    monkeypatch.setenv(device.CHECK_DEVICES_ENV, "1")
    with pytest.raises(NrlError, match=r"^train: batch.fields\['advantages'\] is on meta but the logprobs are on cpu"):
        device.check_batch_device(batch, torch.device("cpu"), "train")
    device.check_batch_device(_batch(), torch.device("cpu"), "train")


def test_host_copies_never_share_storage_and_to_host_keeps_host_tensors() -> None:
    t = torch.arange(4.0)
    copy = device.host_copy(t)
    assert copy.data_ptr() != t.data_ptr() and torch.equal(copy, t)
    assert device.to_host(t) is t
    device.free_device_cache()  # a no-op without CUDA


def test_precision_defaults_by_device_and_keeps_an_explicit_choice() -> None:
    assert device.default_precision(torch.device("cpu")) == "float32"
    assert device.resolve_precision(None, torch.device("cpu")) == "float32"
    assert device.resolve_precision("bfloat16", torch.device("cpu")) == "bfloat16"
    assert device.resolve_precision("float32", torch.device("cuda")) == "float32"


def test_moving_tensors_to_where_they_are_keeps_their_storage() -> None:
    """How Megatron's fp32 main parameters are offloaded (``tensor.data`` moves, the tensor object an
    optimizer is keyed by stays): on the CPU a no-op, so training stays bit-identical here. The
    move itself needs CUDA (torch refuses ``.data`` across CPU and meta)."""
    param = torch.nn.Parameter(torch.ones(3))
    before = param.data_ptr()
    device.move_tensors([param], torch.device("cpu"))
    assert param.data_ptr() == before and param.device.type == "cpu"


def test_optimizer_state_moves_with_the_optimizer() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.Adam([param])
    param.grad = torch.ones(3)
    optimizer.step()
    device.move_optimizer_state(optimizer, torch.device("meta"))
    assert {v.device.type for s in optimizer.state.values() for v in s.values() if v.dim()} == {"meta"}


def test_optimizer_state_moves_through_megatrons_chained_proxy() -> None:
    """Where the Megatron GPU run failed at offload: a chained optimizer's ``state`` is Megatron's
    ``ProxyDict`` over its leaves' dicts, which has ``items`` but no ``values``."""
    ProxyDict = pytest.importorskip("megatron.core.optimizer.optimizer").ProxyDict
    leaves = []
    for _ in range(2):
        param = torch.nn.Parameter(torch.ones(3))
        leaves.append(torch.optim.Adam([param]))
        param.grad = torch.ones(3)
        leaves[-1].step()
    chained = types.SimpleNamespace(state=ProxyDict([leaf.state for leaf in leaves]))
    device.move_optimizer_state(chained, torch.device("meta"))
    assert {v.device.type for leaf in leaves for s in leaf.state.values() for v in s.values() if v.dim()} == {"meta"}


def _dtensor_to_cuda(rank: int, world: int) -> dict:
    """Where a GPU run failed first: FSDP2's optimizer state is DTensors, which have no sharding
    rule for ``is_pinned``; they must move through ``DTensor.to``, never through ``pin_memory``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dt = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    calls = []
    original = DTensor.to

    def record(self, *args, **kwargs):  # CUDA is absent here: record the move and stay on the CPU
        calls.append(str(args[0]))
        return original(self, "cpu")

    DTensor.to = record
    try:
        moved = device.to_device(dt, torch.device("cuda"))
    finally:
        DTensor.to = original
    return {"calls": calls, "dtensor": isinstance(moved, DTensor)}


def test_dtensors_move_without_pinning_which_has_no_sharding_rule() -> None:
    (result,) = run_distributed(_dtensor_to_cuda, 1)
    assert result == {"calls": ["cuda"], "dtensor": True}
