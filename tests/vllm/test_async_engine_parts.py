"""How the async engine hands a refit to its worker process: parts that end where a layer ends,
each in a ``/dev/shm`` file, or, on the worker's own GPU, in a device buffer lent by CUDA IPC
handle. Only the file path runs here; the lent buffer's checks of what it is given do too."""

from __future__ import annotations

import os

import pytest
import torch

from nrl_core.api import lend_device_buffer, open_lent_buffer
from nrl_gen_vllm.engines import _packed, _parts


def _layers(count: int) -> list[tuple[str, torch.Tensor]]:
    return [(f"model.layers.{i}.{part}.weight", torch.full((n,), float(i))) for i in range(count)
            for part, n in (("qkv", 8), ("up", 12), ("down", 4))]


def test_parts_end_where_a_layer_ends_when_the_next_would_not_fit() -> None:
    parts = list(_parts(_layers(5), part_bytes=50 * 4))  # layers of 24 elements: two a part
    assert [sorted({name.split(".")[2] for name, _ in part}) for part in parts] == [["0", "1"], ["2", "3"], ["4"]]


def test_a_part_off_the_gpu_goes_through_a_file_that_holds_its_bytes_and_is_removed() -> None:
    part = _layers(2)
    with _packed(part, lend_device=True) as (method, path, layout):
        assert method == "nrl_load_part_from_file" and os.path.exists(path)
        data = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
        for (name, tensor), (entry, dtype, shape, offset, nbytes) in zip(part, layout):
            assert (entry, dtype, shape) == (name, "float32", list(tensor.shape))
            assert torch.equal(data[offset:offset + nbytes].view(torch.float32), tensor)
    assert not os.path.exists(path)


def test_a_part_of_mixed_dtypes_reads_back_as_the_worker_reads_it() -> None:
    from nrl_gen_vllm.extension import _file_views

    part = [("model.layers.0.norm.weight", torch.arange(3, dtype=torch.bfloat16)),  # 6 bytes: odd for float32
            ("model.layers.0.mlp.weight", torch.arange(6, dtype=torch.float32).view(2, 3)),
            ("model.layers.0.mlp.bias", torch.arange(5, dtype=torch.float16))]
    with _packed(part, lend_device=False) as (_method, path, layout):
        read = _file_views(path, layout)
        assert [name for name, _ in read] == [name for name, _ in part]
        for (_, sent), (_, got) in zip(part, read):
            assert got.dtype == sent.dtype and torch.equal(got, sent)
        del read


def test_a_part_entry_that_does_not_fit_its_buffer_is_refused_in_one_line() -> None:
    from nrl_gen_vllm.part_layout import views

    data = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^refit part: 'w' names dtype 'load', which is not a torch dtype$"):
        views(data, [["w", "load", [2], 0, 8]])
    with pytest.raises(ValueError, match=r"^refit part: 'w' \(float32 \[4\]\) does not fit at byte 2 of a 64-byte"):
        views(data, [["w", "float32", [4], 2, 16]])
    with pytest.raises(ValueError, match="does not fit at byte 56 of a 64-byte buffer as 16 bytes"):
        views(data, [["w", "float32", [4], 56, 16]])


def test_a_lent_buffer_must_be_flat_bytes_on_a_gpu_and_its_handle_whole() -> None:
    with pytest.raises(ValueError, match=r"a flat contiguous uint8 CUDA tensor, got torch.uint8 \(8,\) on cpu"):
        lend_device_buffer(torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="a lent buffer's handle has 10 fields, got 3"):
        open_lent_buffer([0, b"", 8])
