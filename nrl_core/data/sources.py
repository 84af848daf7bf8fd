"""NeMo RL's data layout: ``data.train``, ``data.validation`` and ``data.default``, each dataset
named and registered through ``nrl_datasets``.

Resolving (:func:`resolve_datasets`) needs no data: it finds each name's spec, checks its split and
local paths, and says where each dataset would load from, so ``nrl config check`` refuses an
unknown name or a missing file in one line before anything starts. Loading
(:func:`load_dataset_splits`) reads each dataset from the hub repository its spec names (HF's
offline cache serves an offline machine) or from the local stand-in ``data_path`` names, turns
each row into a record with the spec's ``format``, holds out ``split_validation_size`` as NeMo RL
does (HF ``train_test_split``'s shuffle: ``numpy.random.default_rng(seed).permutation``, the first
share to validation) and repeats ``repeat`` times. docs/data.md is the user's side of this.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nrl_core.contracts import DatasetSpec, import_object
from nrl_core.errors import ConfigError, NrlError

__all__ = ["COMMON_KEYS", "DatasetSource", "describe_datasets", "load_dataset_splits",
           "resolve_datasets", "uses_dataset_layout"]

logger = logging.getLogger(__name__)

Record = dict[str, Any]
Located = list[tuple[str, Record]]

#: Keys every dataset entry may set: they say which dataset, and how its prompts are made.
COMMON_KEYS = ("dataset_name", "prompt_file", "system_prompt_file", "processor", "env_name")
DEFAULT_SEED = 42  # NeMo RL's seed of the held-out split when the config sets none

@dataclass(frozen=True)
class DatasetSource:
    """One dataset of the run, resolved: its entry (``data.default`` filled in), its spec, the
    split it reads and where it loads from."""

    key_path: str
    spec: DatasetSpec
    entry: Mapping[str, Any]
    split: str
    local: Path | None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def held_out(self) -> float:
        """The share (below 1) or number of rows held out for validation; 0: none."""
        if self.spec.split_validation_size is None:
            return 0.0
        size = self.entry.get("split_validation_size")
        return float(self.spec.split_validation_size if size is None else size)

    @property
    def seed(self) -> int:
        seed = self.entry.get("seed")
        return DEFAULT_SEED if seed is None else int(seed)

    @property
    def subsets(self) -> tuple[str | None, ...]:
        """The hub configurations read and concatenated: the entry's ``subset``, else the spec's."""
        if self.entry.get("subset") and "subset" in self.spec.keys:
            return (self.entry["subset"],)
        return self.spec.subsets or (None,)

    @property
    def repeat(self) -> int:
        """How many times over the dataset is read (AIME's ``repeat``; 1 for a dataset without it)."""
        return int(self.entry.get("repeat") or 1) if "repeat" in self.spec.keys else 1

    def where(self) -> str:
        """Where the rows come from, for ``nrl config check`` and messages about single rows."""
        if self.local is not None:
            return f"local {self.local}"
        hub = self.spec.hub or self.entry["data_path"]
        subsets = [s for s in self.subsets if s]
        subset = f" ({', '.join(subsets)})" if subsets else ""
        return f"hub {hub}{subset} split {self.split}"


def uses_dataset_layout(data_cfg: Mapping[str, Any]) -> bool:
    """Whether ``data`` uses NeMo RL's layout (``data.train``) rather than nrl's flat keys."""
    return data_cfg.get("train") is not None


def resolve_datasets(data_cfg: Mapping[str, Any], kind: str | None, registry: Any, *,
                     warn: bool = True) -> tuple[list[DatasetSource], list[DatasetSource]]:
    """The train and validation datasets of the validated ``data`` section; one ``ConfigError`` for
    an unknown name, a split the dataset lacks, a missing local file, or (with ``kind``) a
    dataset whose records are of another kind than the algorithm reads. ``warn``: name the keys a
    dataset does not read (once per validation, not again when the check describes the data).
    ``registry`` is the installation's ``nrl_datasets``."""
    train = [_resolve(f"data.train[{i}]", e, registry, kind, warn) for i, e in enumerate(data_cfg.get("train") or [])]
    val = [_resolve(f"data.validation[{i}]", e, registry, kind, warn)
           for i, e in enumerate(data_cfg.get("validation") or [])]
    return train, val


def _resolve(key_path: str, entry: Mapping[str, Any], registry: Any, kind: str | None, warn: bool) -> DatasetSource:
    name = entry.get("dataset_name")
    if not name:
        raise ConfigError(f"{key_path}.dataset_name", "is required: name a registered dataset (`nrl plugins` lists "
                                                      "them), e.g. ResponseDataset with data_path for a local file")
    spec: DatasetSpec = registry.get(name, f"{key_path}.dataset_name")
    if kind is not None and spec.kind != kind:
        raise ConfigError(f"{key_path}.dataset_name", f"'{name}' holds {spec.kind} records, and this algorithm reads "
                                                      f"{kind} records; name a {kind} dataset")
    split = entry.get("split") or spec.split
    if spec.splits and split not in spec.splits:
        raise ConfigError(f"{key_path}.split", f"'{name}' has no split '{split}' (splits: {', '.join(spec.splits)})")
    local = _local_path(key_path, entry, spec)
    if warn:
        _warn_unread_keys(key_path, entry, spec)
    return DatasetSource(key_path=key_path, spec=spec, entry=dict(entry), split=split, local=local)


def _local_path(key_path: str, entry: Mapping[str, Any], spec: DatasetSpec) -> Path | None:
    """The local file or directory the dataset reads, or None when it reads the hub."""
    data_path = entry.get("data_path")
    if not data_path:
        if spec.hub is None:
            raise ConfigError(f"{key_path}.data_path", f"is required for '{spec.name}': a local file or directory, "
                                                       "or a hub dataset id")
        return None
    path = Path(data_path).expanduser()
    if path.exists():
        return path
    looks_local = path.is_absolute() or data_path.startswith(".") or path.suffix or spec.hub is not None
    if looks_local:
        raise ConfigError(f"{key_path}.data_path", f"{path}: no such file or directory; point it at a local copy "
                                                   f"with the dataset's columns{' or remove it to read the hub' if spec.hub else ''}")
    return None  # a hub id, as NeMo RL's ResponseDataset reads it


def _warn_unread_keys(key_path: str, entry: Mapping[str, Any], spec: DatasetSpec) -> None:
    """NeMo RL's rule for a key its dataset does not take: a warning, and the key does nothing."""
    reads = {*COMMON_KEYS, "data_path", "split", *spec.keys}
    if spec.split_validation_size is not None:
        reads |= {"split_validation_size", "seed"}
    unread = sorted(k for k, v in entry.items()
                    if v is not None and k not in reads and not (k == "split_validation_size" and not v))
    if unread:
        logger.warning("%s: dataset '%s' does not read %s (as in NeMo RL, where it is ignored with a warning)",
                       key_path, spec.name, ", ".join(unread))


def describe_datasets(train: Sequence[DatasetSource], val: Sequence[DatasetSource], processor: str | None) -> list[str]:
    """One line per dataset for ``nrl config check``: its name, where it loads from, its processor."""
    lines = []
    for role, sources in (("train", train), ("validation", val)):
        for source in sources:
            held = source.held_out
            share = f"{held * 100:g}%" if 0 < held < 1 else f"{int(held)} rows"
            extra = f", {share} held out for validation (seed {source.seed})" if held else ""
            extra += f", repeated {source.repeat} times" if source.repeat > 1 else ""
            lines.append(f"data: {role} {source.name} from {source.where()}{extra}; processor "
                         f"{processor or 'none (preference pairs)'}")
    return lines


# --------------------------------------------------------------------------- loading


def load_dataset_splits(data_cfg: Mapping[str, Any], kind: str, registry: Any) -> tuple[Located, Located | None, str]:
    """The records of every dataset of ``data.train`` (concatenated) and the validation records:
    the shares train datasets hold out, then ``data.validation``'s datasets (``registry``'s).
    Returns ``(train, val or None, source)``."""
    train_sources, val_sources = resolve_datasets(data_cfg, kind, registry, warn=False)
    train: Located = []
    val: Located = []
    for source in train_sources:
        kept, held = _split_off(source, _records(source))
        train += kept * source.repeat
        val += held
    for source in val_sources:
        val += _records(source) * source.repeat
    names = " + ".join(s.name for s in train_sources)
    return train, (val or None), names


def _records(source: DatasetSource) -> Located:
    """Every row of ``source`` through its spec's ``format`` (``max_samples`` of them where the
    dataset reads that key)."""
    fmt = import_object(source.spec.format)
    where = f"{source.name} ({source.where()})"
    records: Located = []
    for i, row in enumerate(_rows(source)):
        try:
            record = fmt(row, source.entry)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise NrlError(f"{where} row {i}: cannot be read as {source.name} ({type(exc).__name__}: {exc}); "
                           f"its columns are {', '.join(sorted(row)) or 'none'}") from None
        if record is not None:
            records.append((f"{where} row {i}", record))
    if not records:
        raise NrlError(f"{where}: no records; check {source.key_path}")
    if source.entry.get("max_samples") and "max_samples" in source.spec.keys:
        records = _sample(records, int(source.entry["max_samples"]), source.seed)
    return records


def _sample(records: Located, count: int, seed: int) -> Located:
    """``count`` records in HF ``Dataset.shuffle(seed)``'s order, as NeMo RL draws ``max_samples``."""
    import numpy as np

    order = np.random.default_rng(seed).permutation(len(records))
    return [records[i] for i in order[:count]]


def _split_off(source: DatasetSource, records: Located) -> tuple[Located, Located]:
    """The records kept for training and those held out, as NeMo RL holds them out."""
    size = source.held_out
    if size <= 0:
        return records, []
    n_val = int(size) if size >= 1 else math.ceil(size * len(records))
    if n_val >= len(records):
        raise NrlError(f"{source.key_path}.split_validation_size={size:g} holds out all {len(records)} records of "
                       f"{source.name}; lower it")
    import numpy as np

    order = np.random.default_rng(source.seed).permutation(len(records))
    return [records[i] for i in order[n_val:]], [records[i] for i in order[:n_val]]


def _rows(source: DatasetSource) -> list[Mapping[str, Any]]:
    """The raw rows of ``source``: the local stand-in, or the hub (or HF's cache of it)."""
    if source.local is not None:
        from nrl_core.data.datasets import located_records

        return [row for _, row in located_records(source.local, split=source.split, needs=f"a {source.name} row")]
    hub = source.spec.hub or source.entry["data_path"]
    rows: list[Mapping[str, Any]] = []
    for subset in source.subsets:
        rows += _hub_rows(source, hub, subset)
    return rows


def _hub_rows(source: DatasetSource, hub: str, subset: str | None) -> list[Mapping[str, Any]]:
    """One configuration of a hub dataset, from the hub or HF's cache; a failure is one line that
    says how an offline machine gets the data."""
    import datasets

    try:
        loaded = datasets.load_dataset(hub, subset, split=source.split)
    except Exception as exc:  # noqa: BLE001 - the hub, the cache and the network fail in many types
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise NrlError(f"{source.key_path}: cannot load {hub}{f' ({subset})' if subset else ''} split {source.split} "
                       f"from the hub or HF's cache ({type(exc).__name__}: {reason}); on a machine without the hub, "
                       f"download it into the cache first or set {source.key_path}.data_path to a local copy") from None
    return [dict(row) for row in loaded]
