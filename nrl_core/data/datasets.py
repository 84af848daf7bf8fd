"""Prompt–answer records read from local disk: JSONL files and Hugging Face ``datasets`` formats.

Why our own JSONL reader: a training run that dies on line 48,213 of a data file should say so in
one line (file and line number), not in a traceback from inside a JSON parser. The other formats
(``.json``, ``.parquet``, ``.arrow`` files and ``save_to_disk`` directories) go through Hugging
Face ``datasets``, always from local paths; nothing here touches the network (named datasets
that load from the hub are :mod:`nrl_core.data.sources`').

A record is a plain ``dict``; every record must carry the configured ``input_key`` (the prompt)
and ``output_key`` (the ground truth, or the response for SFT). Problems are
:class:`~nrl_core.errors.NrlError`\\ s whose message names the file and the line or row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nrl_core.errors import NrlError

__all__ = [
    "DATASET_FORMATS",
    "load_located_records",
    "located_records",
    "load_records",
    "read_jsonl",
    "write_jsonl",
]

Record = dict[str, Any]

#: File suffix → the ``datasets`` builder that reads it (JSONL has its own reader, see above).
DATASET_FORMATS: dict[str, str] = {".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}

def read_jsonl(path: str | os.PathLike[str]) -> list[Record]:
    """Every object of a JSON Lines file; blank lines are skipped.

    A line that is not a JSON object is an ``NrlError`` naming the file and its 1-based line number.
    """
    return [record for _, record in _read_jsonl_numbered(Path(path))]


def _read_jsonl_numbered(p: Path) -> list[tuple[int, Record]]:
    records: list[tuple[int, Record]] = []
    try:
        with p.open("r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise NrlError(f"{p}:{lineno}: malformed JSON line ({exc.msg} at column {exc.colno}); "
                                   "each line must be one JSON object") from None
                if not isinstance(obj, dict):
                    raise NrlError(f"{p}:{lineno}: expected a JSON object per line, got {type(obj).__name__}")
                records.append((lineno, obj))
    except UnicodeDecodeError as exc:
        raise NrlError(f"{p}: not UTF-8 text ({exc.reason}); is it really a JSONL file?") from None
    except OSError as exc:
        raise NrlError(f"{p}: cannot read ({exc.strerror})") from None
    return records


def write_jsonl(records: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write ``records`` as JSON Lines (parent directories created); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(dict(record), ensure_ascii=False) + "\n")
    tmp.replace(p)  # a reader never sees a half-written file
    return p


def _load_hf(path: Path, split: str) -> list[Record]:
    """Read a ``save_to_disk`` directory or a json/parquet/arrow/csv file through ``datasets`` (local
    files need no hub; the process's hub setting is left alone, since a named dataset of the same
    run may read the hub)."""
    import datasets

    datasets.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity_error()
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
        else:
            builder = DATASET_FORMATS[path.suffix.lower()]
            loaded = datasets.load_dataset(builder, data_files=str(path), split="train")
    except NrlError:
        raise
    except Exception as exc:  # datasets raises many types; the user needs the file and the reason
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise NrlError(f"{path}: cannot be read as a dataset ({type(exc).__name__}: {reason})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise NrlError(f"{path}: dataset has no split '{split}' (splits: {', '.join(loaded)})")
        loaded = loaded[split]
    return [dict(row) for row in loaded]


def load_records(
    path: str | os.PathLike[str],
    *,
    input_key: str = "problem",
    output_key: str = "expected_answer",
    split: str = "train",
) -> list[Record]:
    """Load and check prompt–answer records from a local file or ``save_to_disk`` directory.

    ``.jsonl`` files use :func:`read_jsonl`; ``.json``, ``.parquet``, ``.arrow`` and ``.csv`` files
    and directories written by ``Dataset.save_to_disk`` use Hugging Face ``datasets`` (``split``
    picks the split of a saved ``DatasetDict``). Every record must have ``input_key`` and
    ``output_key`` with non-null values; a dataset with no records is an error.
    """
    return [record for _, record in load_located_records(path, input_key=input_key, output_key=output_key,
                                                         split=split)]


def load_located_records(
    path: str | os.PathLike[str],
    *,
    input_key: str = "problem",
    output_key: str = "expected_answer",
    split: str = "train",
) -> list[tuple[str, Record]]:
    """:func:`load_records` with where each record came from (``file:line`` or ``file row i``),
    for messages about single records."""
    numbered = located_records(path, split=split, needs=f"'{input_key}' and '{output_key}'")
    for where, record in numbered:
        for key in (input_key, output_key):
            if record.get(key) is None:
                present = ", ".join(sorted(k for k in record)) or "none"
                raise NrlError(f"{where}: record has no '{key}' (keys: {present}); "
                               f"fix the data or set data.{'input_key' if key == input_key else 'output_key'}")
    return numbered


def located_records(path: str | os.PathLike[str], *, split: str = "train",
                    needs: str = "fields") -> list[tuple[str, Record]]:
    """Every record of a local file or ``save_to_disk`` directory with where it came from, keys
    unchecked (the caller knows its record shape; ``needs`` says what a record must hold, for
    the empty-dataset message)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise NrlError(f"{p}: no such file or directory; check the data path (or generate the data first)")
    suffix = p.suffix.lower()
    if p.is_dir():
        if not ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()):
            raise NrlError(f"{p}: directory is not a dataset saved with save_to_disk; point at a data file instead")
        numbered = [(f"{p} row {i}", r) for i, r in enumerate(_load_hf(p, split))]
    elif suffix == ".jsonl":
        numbered = [(f"{p}:{line}", r) for line, r in _read_jsonl_numbered(p)]
    elif suffix in DATASET_FORMATS:
        numbered = [(f"{p} row {i}", r) for i, r in enumerate(_load_hf(p, split))]
    else:
        known = ", ".join([".jsonl", *DATASET_FORMATS])
        raise NrlError(f"{p}: unknown data file type '{suffix or '(none)'}'; use one of {known}")
    if not numbered:
        raise NrlError(f"{p}: dataset is empty; it needs at least one record with {needs}")
    return numbered
