"""The data NeMo RL's own script for an environment draws, for recipes that name it only in ``env``.

NeMo RL trains some recipes with a script of their environment's (``run_grpo_sliding_puzzle.py``)
that draws the prompts and reads no ``data`` section, so such a recipe's data section (inherited
from another recipe) is never read. nrl trains it the same way, through the environment's
``EnvironmentSpec.runner_data``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from nrl_core.contracts import EnvironmentSpec, import_object

logger = logging.getLogger(__name__)

#: What the flat data keys hold after NeMo RL's layout was read; the drawn data replaces all of it.
_RECIPE_DATA = ("train", "validation", "train_data_path", "val_data_path", "prompt_file", "system_prompt_file",
                "dataset_name")
_NOTED: set[str] = set()  # one warning per command, which validates its config more than once


def draw_runner_data(config: dict[str, Any], name: str, spec: EnvironmentSpec) -> None:
    """Give ``config`` the data environment ``name``'s NeMo RL script draws, unless it names that
    data itself (its dataset or its processor). The drawn ``data`` keys replace the config's; of a
    mapping such as ``data.generate``, the config keeps the keys it sets that the drawn one has
    (a twin's fewer examples). Other keys fill only what the config leaves unset."""
    drawn = import_object(spec.runner_data)(config["env"][name], config)  # type: ignore[arg-type]
    data = config["data"]
    if data.get("dataset_name") == drawn.get("data.dataset_name") or data.get("processor") == drawn.get("data.processor"):
        return
    unread = ", ".join(str(e.get("dataset_name")) for e in data.get("train") or []) or data.get("dataset_name") \
        or data.get("train_data_path")
    data.update(dict.fromkeys(_RECIPE_DATA))
    for key, value in drawn.items():
        *parents, last = key.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        if key.startswith("data."):
            own = node.get(last) if isinstance(node.get(last), Mapping) else {}
            node[last] = {**value, **{k: v for k, v in own.items() if k in value}} if isinstance(value, Mapping) else value
        elif node.get(last) is None:
            node[last] = value
    message = (f"data: {name}'s recipes train on what NeMo RL's own script for it draws ("
               + ", ".join(f"{k}={v}" for k, v in drawn.items() if not isinstance(v, Mapping))
               + f"), not on the data section{f' ({unread} is not read)' if unread else ''}")
    if message not in _NOTED:
        _NOTED.add(message)
        logger.warning(message)
