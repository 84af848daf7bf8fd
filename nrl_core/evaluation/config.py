"""``nrl eval``'s config: an nrl config with an ``eval`` section, or NeMo RL's evaluation layout.

Two files are accepted. An nrl config (a GRPO recipe, say) evaluates its model on the data its
validation reads, with its environment and prompt processing, so a number ``nrl eval`` prints is
comparable with the run's ``val/accuracy``. NeMo RL's ``examples/configs/evals/*.yaml`` put the
engine at the top (``generation``, ``tokenizer``) and the dataset in ``data`` with
``problem_key``/``solution_key``; :func:`from_nemo_rl_layout` moves those keys to nrl's places
(``policy.generation``, ``policy.tokenizer``, ``data.input_key``...). Either way the ``eval``
section holds NeMo RL's keys (``metric``, ``num_tests_per_prompt``, ``k_value``, ``seed``,
``save_path``) and nrl's ``split``, and the model is ``policy.model_name``: a Hugging Face
directory, or an nrl checkpoint directory whose ``hf_export`` holds one.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from nrl_core.checkpoint.manager import HF_EXPORT
from nrl_core.errors import ConfigError
from nrl_core.evaluation.adapters import is_adapter, merged_model_dir
from nrl_core.schema import Field, Section

__all__ = ["EVAL", "load_eval_config", "from_nemo_rl_layout", "resolve_model_dir"]

EVAL = Section(doc="What `nrl eval` computes (NeMo RL's eval keys, plus split).", fields={
    "metric": Field(type=str, default="pass@k", choices=("pass@k", "cons@k"),
                    doc="the headline score; both are reported when the environment states answers"),
    "num_tests_per_prompt": Field(type=int, default=1, minimum=1, doc="samples per problem (n)"),
    "k_value": Field(type=int, default=1, minimum=1, doc="k of pass@k and of the majority vote (cons@k)"),
    "seed": Field(type=int, default=42, doc="the engines' sampling seed"),
    "save_path": Field(type=str, default=None, nullable=True,
                       doc="directory for results.json and samples.jsonl; null: print only"),
    "split": Field(type=str, default="auto", choices=("auto", "val", "train"),
                   doc="which records of `data` to evaluate; auto: the validation ones when the config has them"),
    "max_problems": Field(type=int, default=None, nullable=True, minimum=1,
                          doc="evaluate the first N; null: all, or a GRPO config's grpo.max_val_samples"),
})

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# NeMo RL's data keys that name what nrl's data section calls otherwise.
_DATA_RENAMES = {"problem_key": "input_key", "solution_key": "output_key"}
# Keys of NeMo RL's eval `data` section nrl reads from the file itself or does not need.
_DATA_DROPPED = ("split", "file_format", "repeat")
# NeMo RL's prompt processors and nrl's equivalents.
_PROCESSORS = {"math_hf_data_processor": "math", "math_data_processor": "math"}
# `generation` keys that are not the engine's.
_GENERATION_MOVED = ("model_name", "num_prompts_per_step")


def load_eval_config(path: str, overrides: Iterable[str] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """The validated run config (the engines', data's and environment's sections) and the validated
    ``eval`` section of the file at ``path`` with ``overrides``."""
    from nrl_core.algorithms.installed import validate_config
    from nrl_core.config.loader import load_config

    raw = load_config(path, overrides)
    if "generation" in raw and "policy" not in raw:
        raw = from_nemo_rl_layout(raw)
    eval_cfg = EVAL.validate(raw.pop("eval", None), "eval")
    assert eval_cfg is not None
    if eval_cfg["max_problems"] is None and (raw.get("grpo") or {}).get("max_val_samples"):
        eval_cfg["max_problems"] = int(raw["grpo"]["max_val_samples"])  # the run's validation set
    if eval_cfg["k_value"] > eval_cfg["num_tests_per_prompt"]:
        raise ConfigError("eval.k_value", f"{eval_cfg['k_value']} is more than the {eval_cfg['num_tests_per_prompt']} "
                                          "samples per problem; raise eval.num_tests_per_prompt or lower k_value")
    policy = raw.setdefault("policy", {})
    policy["model_name"] = resolve_model_dir(policy.get("model_name"))
    engine = policy.setdefault("generation", {}).setdefault("vllm_cfg", {})
    engine["load_format"] = "auto"  # the engines read the model's weights; no refit follows
    engine["seed"] = eval_cfg["seed"]
    config = validate_config(raw, algorithm=None)
    # Validated as engines hosted on every device of the cluster; they run in their own actors,
    # with no training state to hand the devices to.
    config["policy"]["generation"]["colocated"]["enabled"] = False
    return config, eval_cfg


def from_nemo_rl_layout(raw: Mapping[str, Any]) -> dict[str, Any]:
    """NeMo RL's evaluation config in nrl's layout (see the module docstring)."""
    raw = copy.deepcopy(dict(raw))
    generation = dict(raw.pop("generation") or {})
    policy: dict[str, Any] = {"model_name": generation.get("model_name")}
    for key in _GENERATION_MOVED:
        generation.pop(key, None)
    vllm = generation.get("vllm_cfg") or {}
    if vllm.get("max_model_len"):
        policy["max_total_sequence_length"] = int(vllm["max_model_len"])
    tokenizer = raw.pop("tokenizer", None)
    if tokenizer:
        template = tokenizer.get("chat_template")
        policy["tokenizer"] = {"name": tokenizer.get("name"),
                               "chat_template": None if template == "default" else template}
        if tokenizer.get("chat_template_kwargs"):
            raise ConfigError("tokenizer.chat_template_kwargs", "is not supported by nrl's prompt processing; "
                                                                "remove it or put the rendered prompt in data")
    policy["generation"] = generation
    raw["policy"] = policy
    data = dict(raw.get("data") or {})
    named = data.get("dataset_name") and not Path(str(data["dataset_name"])).expanduser().exists()
    if int(data.get("repeat") or 1) != 1 and not named:
        raise ConfigError("data.repeat", "is not supported for a local file; sample each problem several times with "
                                         "eval.num_tests_per_prompt instead")
    for key in _DATA_DROPPED:
        if not (named and key == "repeat"):
            data.pop(key, None)
    for old, new in _DATA_RENAMES.items():
        if old in data:
            data[new] = data.pop(old)
    if data.get("processor") in _PROCESSORS and not named:
        data["processor"] = _PROCESSORS[data["processor"]]
    name = data.get("dataset_name")
    if name and not data.get("train_data_path") and not Path(str(name)).expanduser().exists():
        data = _named_eval_dataset(str(name), data)
    data.setdefault("shuffle", False)
    raw["data"] = data
    return raw


#: NeMo RL's evaluation datasets nrl does not read, by name (or name prefix), with what they need.
_NEMO_RL_EVAL_DATASETS = {
    "math": "MATH test set (read from a URL)",
    "math500": "MATH-500 test set (read from a URL)",
    "gpqa": "GPQA, scored by its multiple-choice processor and environment",
    "mmlu": "MMLU, scored by its multiple-choice processor and environment",
    "TwinkStart/MMAU": "MMAU (audio)",
    "mmau": "MMAU (audio)",
    "daily-omni": "Daily-Omni (video)",
}


def _named_eval_dataset(name: str, data: dict[str, Any]) -> dict[str, Any]:
    """A named dataset of NeMo RL's eval layout as nrl's data section: a registered dataset (the
    AIME sets, with NeMo RL's processor and prompt files) in NeMo RL's data layout, or one line
    naming what nrl lacks."""
    from nrl_core.plugins import get_plugin_manager

    if name in get_plugin_manager().datasets():
        entry = {"dataset_name": name, "repeat": data.pop("repeat", None)}
        for key in ("prompt_file", "system_prompt_file", "processor", "env_name", "data_path"):
            if key in data:
                entry[key] = data.pop(key)
        data.pop("dataset_name")
        return {**data, "train": entry}
    family = next((what for prefix, what in _NEMO_RL_EVAL_DATASETS.items()
                   if name == prefix or name.startswith(f"{prefix}_")), None)
    if family is not None:
        raise ConfigError("data.dataset_name", f"'{name}' is NeMo RL's {family}, which nrl lacks; evaluate a local "
                                               "file of problems and answers instead (data.problem_key, "
                                               "data.solution_key)")
    if "://" in name:
        raise ConfigError("data.dataset_name", f"'{name}' is a URL, and nrl reads local files: download it and set "
                                               "data.dataset_name to the file")
    raise ConfigError("data.dataset_name", f"'{name}' is neither a local file nor a registered dataset; set it to a "
                                           "local JSONL, JSON, CSV or Parquet file (with data.problem_key and "
                                           "data.solution_key naming its fields)")


def resolve_model_dir(model: Any) -> str:
    """A Hugging Face model directory for ``model``: itself, or the ``hf_export`` of an nrl run's
    checkpoint directory; a LoRA adapter (either of those) is merged into its base first. Anything
    else is one line saying what to pass."""
    if not model:
        raise ConfigError("policy.model_name", "no model to evaluate; set it (generation.model_name in NeMo RL's "
                                               "layout) to a Hugging Face directory or an nrl checkpoint directory")
    path = Path(str(model)).expanduser()
    if not path.exists() and _HUB_ID.fullmatch(str(model)):
        return str(model)  # a hub id, for machines that reach the hub
    for candidate in (path, path / HF_EXPORT, path.parent / HF_EXPORT):
        if (candidate / "config.json").is_file():
            return str(candidate)
        if is_adapter(candidate):  # a LoRA run's export: the engines load its base with the adapter merged in
            return str(merged_model_dir(candidate))
    if not path.exists():
        raise ConfigError("policy.model_name", f"'{model}' does not exist; pass a Hugging Face model directory "
                                               "or an nrl checkpoint directory")
    raise ConfigError("policy.model_name", f"'{model}' holds no Hugging Face model (config.json) and no hf_export; "
                                           "convert a checkpoint with `nrl convert checkpoint CKPT --out DIR` and "
                                           "pass DIR")
