"""A ``save_pretrained``-compatible directory written from a backend's weight stream.

The stream (``export_weights``) is what refit sends and what the conformance kit checks against
the HF model, so an export built from it cannot disagree with what generation engines load. Rank
0 writes safetensors in HF's checkpoint layout (shards of at most ``max_shard_bytes`` with an
index, as ``save_pretrained`` does) as the stream arrives, the config with the exported dtype, and
the tokenizer."""

from __future__ import annotations

import copy
import logging
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from nrl_core.sdk.safetensors_stream import ShardWriter

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "chat_template.jinja", "added_tokens.json")
MAX_SHARD_BYTES = 5 * 2**30  # save_pretrained's default shard size


def copy_tokenizer(source: str, out: Path) -> None:
    """The tokenizer of ``source`` (a directory's files, else whatever ``transformers`` loads) into ``out``."""
    copied = [name for name in TOKENIZER_FILES if (Path(source) / name).is_file()]
    for name in copied:
        shutil.copy2(Path(source) / name, out / name)
    if copied:
        return
    try:  # a hub name, or a tokenizer in another layout
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(source).save_pretrained(str(out))
    except Exception as exc:  # noqa: BLE001 - a model without a tokenizer still exports
        logger.warning("tokenizer not exported: %s", exc)


def write_hf_export(buckets: Iterable[list[tuple[str, torch.Tensor]]], hf_config: Any, tokenizer_source: str,
                    path: str, *, dtype: str, writer: bool, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Consume ``buckets`` (every rank must: the stream is collective) and, on the ``writer``
    rank, write the export to ``path`` tensor by tensor (:mod:`nrl_core.sdk.safetensors_stream`);
    no rank holds more than the bucket in flight. Returns after the writer has finished (a barrier)."""
    out = Path(path)
    writer_shards = None
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        writer_shards = ShardWriter(out, max_shard_bytes)
    for bucket in buckets:  # each bucket is written, then dropped: the export never holds the model
        if writer_shards is not None:
            writer_shards.add_bucket(bucket)
        bucket.clear()
    if writer_shards is not None:
        writer_shards.close()
        config = copy.deepcopy(hf_config)
        config.dtype = getattr(torch, dtype)  # what the files hold: HF loads "auto" from it
        config.save_pretrained(str(out))
        copy_tokenizer(tokenizer_source, out)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
