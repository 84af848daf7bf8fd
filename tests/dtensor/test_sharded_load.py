"""Each rank fills its own shards from the checkpoint (``nrl_backend_dtensor.sharded_load``).

The data-parallel and tensor-parallel tests (test_distributed.py) count that a rank at world size
2 reads exactly the bytes it holds; here, in one process: what loads whole and why, and the path
for a rank part that is not one slice of the tensor."""

from __future__ import annotations

import pytest
import torch
from common import make_config
from safetensors.torch import save_file
from torch import nn

from nrl_backend_dtensor import sharded_load
from nrl_backend_dtensor.worker import DTensorPolicyWorker
from nrl_core.testing.distributed import init_local_group


def test_a_model_whose_weights_need_initialising_loads_whole_and_says_why() -> None:
    from scenarios import lora_config

    assert DTensorPolicyWorker(make_config(), 0, 1).load_stats.path == "sharded"
    lora = DTensorPolicyWorker(lora_config(), 0, 1).load_stats
    assert lora.path == "whole: LoRA adapters have fresh weights to initialise" and lora.bytes_read == 0


def test_parameters_on_meta_take_no_memory_and_buffers_stay_real() -> None:
    with sharded_load.parameters_on_meta():
        layer = nn.Linear(4, 3)
        layer.register_buffer("table", torch.arange(3.0), persistent=False)
    assert layer.weight.is_meta and layer.bias.is_meta and layer.weight.requires_grad
    assert torch.equal(layer.table, torch.arange(3.0))
    assert not nn.Linear(2, 2).weight.is_meta  # outside the block, as before


@pytest.mark.parametrize("one_slice", [True, False])
def test_a_rank_part_is_read_as_a_slice_or_from_the_whole_tensor(tmp_path, monkeypatch, one_slice: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    init_local_group()
    full = torch.randn(6, 4)
    save_file({"weight": full}, str(tmp_path / "model.safetensors"))
    module = nn.Module()
    module.weight = nn.Parameter(distribute_tensor(torch.empty(6, 4, device="meta"), init_device_mesh("cpu", (1,)),
                                                   [Shard(0)]))
    if not one_slice:  # as for FSDP over tensor-parallel rows (_StridedShard): no single region
        monkeypatch.setattr(sharded_load, "_own_slice", lambda param: None)
    index = sharded_load.checkpoint_index(str(tmp_path))
    stats = sharded_load.load_own_shards(module, str(tmp_path), index, torch.device("cpu"))
    assert isinstance(module.weight, DTensor) and torch.equal(module.weight.to_local(), full)
    assert stats.bytes_read == stats.local_bytes == stats.largest_read == full.numel() * 4


def test_buffers_stay_where_they_were_and_a_checkpointed_one_takes_its_value(tmp_path) -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(0, 4))  # an empty shard: nothing to read
            self.other = nn.Parameter(torch.empty(2, 2))
            self.register_buffer("scale", torch.ones(1))  # persistent: trained, in the checkpoint
            self.register_buffer("table", torch.arange(3.0), persistent=False)  # built, not saved

    save_file({"weight": torch.empty(0, 4), "other": torch.eye(2), "scale": torch.tensor([3.0])},
              str(tmp_path / "model.safetensors"))
    with sharded_load.parameters_on_meta():
        module = Scaled()
    table = module.table
    stats = sharded_load.load_own_shards(module, str(tmp_path), sharded_load.checkpoint_index(str(tmp_path)),
                                         torch.device("cpu"))
    assert module.table is table and torch.equal(module.table, torch.arange(3.0))
    assert torch.equal(module.scale, torch.tensor([3.0])) and torch.equal(module.other, torch.eye(2))
    assert module.weight.shape == (0, 4) and stats.bytes_read == stats.local_bytes == 16
