"""Safetensors shards written tensor by tensor, so an export never holds the model in memory.

Why not ``safetensors.torch.save_file``: it takes a whole shard as a dict, so a writer holding
every tensor of a 5 GB shard (and, for one shard, the model). Here each tensor's bytes go to a
data file as they arrive; when a shard is full its header (names, dtypes, shapes, offsets) is
written and the data streamed after it. Files appear under HF's names (``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` with an index) only once every shard is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
COPY_CHUNK = 16 << 20


def _copy_rest(source: Any, target: Any, size: int) -> None:
    """``size`` bytes of ``source`` appended to ``target``, inside the kernel where it can."""
    copied = 0
    copy_range = getattr(os, "copy_file_range", None)  # Linux only
    try:
        while copy_range is not None and copied < size:
            n = copy_range(source.fileno(), target.fileno(), size - copied)
            if n == 0:
                break
            copied += n
    except OSError:  # a file system without it: through user space, in chunks
        source.seek(copied)
        target.seek(0, os.SEEK_END)
    if copied < size:
        shutil.copyfileobj(source, target, COPY_CHUNK)


class _Shard:
    def __init__(self, directory: Path, index: int) -> None:
        self.data_path = directory / f".shard-{index:05d}.data"
        self.path = directory / f".shard-{index:05d}.safetensors"
        self.data = open(self.data_path, "wb")  # noqa: SIM115 - closed in finish()
        self.header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        self.size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.dtype not in DTYPES:
            raise ValueError(f"export of {name}: dtype {tensor.dtype} has no safetensors code")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self.data.write(memoryview(flat.numpy()))
        self.header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                             "data_offsets": [self.size, self.size + flat.numel()]}
        self.size += flat.numel()

    def finish(self) -> None:
        self.data.close()
        header = json.dumps(self.header, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
        with open(self.path, "wb") as out, open(self.data_path, "rb") as data:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            out.flush()
            _copy_rest(data, out, self.size)
        os.unlink(self.data_path)

    @property
    def names(self) -> list[str]:
        return [k for k in self.header if k != "__metadata__"]


class ShardWriter:
    """Add tensors in order, then :meth:`close` to publish the shards (and the index) in ``out``."""

    def __init__(self, out: Path, max_shard_bytes: int) -> None:
        self.out, self.max_shard_bytes = out, max_shard_bytes
        self.shards: list[_Shard] = []
        self.names: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.names:
            raise ValueError(f"export: the weight stream yields {name} twice")
        self.names.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if not self.shards or (self.shards[-1].size and self.shards[-1].size + nbytes > self.max_shard_bytes):
            if self.shards:
                self.shards[-1].finish()
            self.shards.append(_Shard(self.out, len(self.shards) + 1))
        self.shards[-1].add(name, tensor)

    def add_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in bucket:
            self.add(name, tensor)

    def close(self) -> None:
        if not self.shards:
            self.shards.append(_Shard(self.out, 1))
        self.shards[-1].finish()
        if len(self.shards) == 1:
            os.replace(self.shards[0].path, self.out / "model.safetensors")
            return
        weight_map, total = {}, 0
        for i, shard in enumerate(self.shards, 1):
            file = f"model-{i:05d}-of-{len(self.shards):05d}.safetensors"
            os.replace(shard.path, self.out / file)
            weight_map.update(dict.fromkeys(shard.names, file))
            total += shard.size
        (self.out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
