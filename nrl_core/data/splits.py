"""A run's records from its ``data`` section, whichever way the section names them: NeMo RL's
layout of registered datasets (:mod:`nrl_core.data.sources`), local files, or a generator
(:mod:`nrl_core.data.datasets` reads the files)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nrl_core.contracts import import_object
from nrl_core.data.datasets import Record, load_located_records
from nrl_core.data.sources import load_dataset_splits, uses_dataset_layout
from nrl_core.errors import ConfigError

if TYPE_CHECKING:
    from nrl_core.plugins import PluginManager

__all__ = ["DataSplits", "load_data_splits"]


@dataclass(frozen=True)
class DataSplits:
    """The records of a run: ``train`` always, ``val`` when the config provides validation data.

    ``train_where``/``val_where`` say where each record came from (``file:line``, ``file row i``,
    ``generator:arithmetic train index i``), for messages about single records.
    """

    train: list[Record]
    val: list[Record] | None
    source: str
    train_where: list[str] | None = None
    val_where: list[str] | None = None

    @classmethod
    def located(cls, train: list[tuple[str, Record]], val: list[tuple[str, Record]] | None,
                source: str) -> DataSplits:
        return cls(train=[r for _, r in train], val=None if val is None else [r for _, r in val], source=source,
                   train_where=[w for w, _ in train], val_where=None if val is None else [w for w, _ in val])


def load_data_splits(data_cfg: Mapping[str, Any], plugins: PluginManager,
                     read: Callable[[str], list[tuple[str, Record]]] | None = None, *,
                     kind: str = "prompt") -> DataSplits:
    """Records for the validated ``data`` config section.

    * ``train`` (NeMo RL's layout, with ``validation`` and ``default``): registered datasets,
      loaded by :func:`nrl_core.data.sources.load_dataset_splits` as records of ``kind``;
    * else ``train_data_path`` (and optionally ``val_data_path``): local files or dataset directories;
    * else ``dataset_name``: a built-in generator (``arithmetic``, arguments from ``data.generate``)
      or a local path, read like ``train_data_path``.

    ``plugins`` supply the named datasets and generators. ``read`` reads a local path (default: prompt–answer records with ``data.input_key`` and
    ``data.output_key``); preference data passes its own, since its records have another shape.
    """
    if uses_dataset_layout(data_cfg):
        train_records, val_records, names = load_dataset_splits(data_cfg, kind, plugins.datasets())
        return DataSplits.located(train_records, val_records, names)
    input_key = data_cfg.get("input_key") or "problem"
    output_key = data_cfg.get("output_key") or "expected_answer"
    if read is None:
        def read(path: str) -> list[tuple[str, Record]]:
            return load_located_records(path, input_key=input_key, output_key=output_key)
    train_path, val_path = data_cfg.get("train_data_path"), data_cfg.get("val_data_path")
    name = data_cfg.get("dataset_name")

    def val() -> list[tuple[str, Record]] | None:
        return read(val_path) if val_path else None

    if train_path:
        return DataSplits.located(read(train_path), val(), str(train_path))
    generators = plugins.dataset_generators()
    if name and name in generators:
        kwargs = dict(data_cfg.get("generate") or {})
        try:
            train, generated_val = import_object(generators.get(name, "data.dataset_name").generator)(**kwargs)
        except TypeError as exc:
            raise ConfigError("data.generate", f"bad arguments for the '{name}' generator: {exc}") from None
        source = f"generator:{name}"
        located_val = val()
        if located_val is None and generated_val:
            located_val = [(f"{source} val index {i}", r) for i, r in enumerate(generated_val)]
        return DataSplits.located([(f"{source} train index {i}", r) for i, r in enumerate(train)], located_val, source)
    if name:
        if Path(name).expanduser().exists():
            return DataSplits.located(read(name), val(), name)
        installed = ", ".join(generators.names()) or "none"
        raise ConfigError("data.dataset_name", f"'{name}' is neither a local file nor an installed generator "
                                               f"(generators: {installed}); set data.train_data_path to a local file, "
                                               "or data.train.dataset_name to a named dataset")
    raise ConfigError("data", "no training data; set data.train (NeMo RL's layout), data.train_data_path or "
                              "data.dataset_name")
