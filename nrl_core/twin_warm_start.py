"""A warm start for twins whose rewards must differ.

Dynamic sampling (``grpo.use_dynamic_sampling``, DAPO's) keeps only prompts whose responses earn
different rewards. A random-init tiny model earns the same reward on every response, so the
twin of such a recipe would stop at its first step. Its warm start is a short SFT of the tiny
model on the twin's own training prompts, as the recipe renders them, answered in the first
format the recipe's environment rewards: afterwards the model writes that format and gets some
sums right, which is what dynamic sampling needs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from nrl_core.errors import ConfigError

if TYPE_CHECKING:
    from nrl_core.plugins import PluginManager

#: Answer formats tried against the recipe's environment, in this order.
FORMATS = ("Answer: {answer}", "\\boxed{{{answer}}}", "<answer>{answer}</answer>", "{answer}")
STEPS = 120  # measured: the tiny models then write the format and get some of the twin's sums right
BATCH = 16
LEARNING_RATE = 3e-3


def needs_warm_start(config: Mapping[str, Any]) -> bool:
    """Whether the validated twin config keeps only prompts with differing rewards."""
    return bool((config.get("grpo") or {}).get("use_dynamic_sampling"))


def answer_format(config: Mapping[str, Any]) -> str:
    """The first of :data:`FORMATS` that the config's environment rewards for a right answer and
    not for a wrong one; one line when none is."""
    from nrl_core.algorithms.setup import build_environment
    from nrl_core.contracts import EnvSample

    name = config["data"]["env_name"]
    try:
        environment = build_environment(config)  # as a run builds it, behind the plugin boundary
    except Exception as exc:  # one that needs more than its section (a reward model's devices)
        raise ConfigError(f"env.{name}", f"cannot start here to pick the warm start's answer format ({exc}); pass "
                                         "--model DIR, a model that answers in its format") from exc
    refused = ""
    try:
        for form in FORMATS:
            samples = [EnvSample(prompt="1+2", response=form.format(answer=answer), metadata={"ground_truth": "3"})
                       for answer in ("3", "4")]
            try:
                right, wrong = environment.score(samples).rewards
            except Exception as exc:  # an environment that scores other tasks (programs, games) may refuse sums
                refused = refused or f"; it raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                continue
            if float(right) > float(wrong):
                return form
    finally:
        environment.shutdown()
    raise ConfigError(f"env.{name}", "rewards none of the answer formats a twin's warm start writes ("
                                     + ", ".join(f.format(answer="3") for f in FORMATS) + f"){refused}; pass "
                                     "--model DIR, a model that answers in its format")


def warm_start(config: Mapping[str, Any], twin_config: Path, out: Path, pm: PluginManager) -> Path:
    """Write the SFT warm start of the model of ``config`` (the twin at ``twin_config``, validated)
    under ``out``: its data and config; the config, whose run exports the model to :func:`exported`."""
    from nrl_core.algorithms.setup import load_tokenizer
    from nrl_core.data.processors import prepare_data

    form = answer_format(config)
    data = prepare_data(config["data"], load_tokenizer(config), pm)
    if any("ground_truth" not in datum.metadata for datum in data.train):
        raise ConfigError("data.processor", f"'{config['data']['processor']}' gives its prompts no ground_truth, which "
                                            "the warm start answers; pass --model DIR, a model that answers its prompts")
    rows = [{"input": datum.prompt_text, "output": form.format(answer=datum.metadata["ground_truth"])}
            for datum in data.train]
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    policy = config["policy"]
    sft = {
        "sft": {"max_num_epochs": 1000, "max_num_steps": STEPS, "val_period": 0, "val_at_start": False, "seed": 0},
        "policy": {"model_name": policy["model_name"], "tokenizer": {"name": policy["tokenizer"]["name"]},
                   "train_global_batch_size": BATCH, "train_micro_batch_size": BATCH, "logprob_batch_size": BATCH,
                   "max_total_sequence_length": policy["max_total_sequence_length"], "precision": "float32",
                   "max_grad_norm": 1.0, "dtensor_config": {"enabled": True}, "generation": None,
                   "optimizer": {"name": "torch.optim.AdamW",
                                 "kwargs": {"lr": LEARNING_RATE, "weight_decay": 0.0, "betas": [0.9, 0.98]}}},
        "data": {"train_data_path": str(out / "train.jsonl"), "input_key": "input", "output_key": "output",
                 "use_chat_template": False, "shuffle": True},
        "checkpointing": {"enabled": True, "checkpoint_dir": str(out / "checkpoints"), "metric_name": None,
                          "keep_top_k": 1, "save_period": STEPS, "export_hf": True},
        "logger": {"log_dir": str(out / "logs")},
        "cluster": {"gpus_per_node": 1, "num_nodes": 1},
    }
    path = out / "sft.yaml"
    path.write_text(f"# The warm start of {twin_config}: answers in the form {form!r} (nrl_core/twin_warm_start.py)\n"
                    + yaml.safe_dump(sft, sort_keys=False))
    return path


def exported(out: Path) -> Path:
    """Where the warm start written under ``out`` exports its model."""
    from nrl_core.checkpoint.manager import HF_EXPORT

    return out / "checkpoints" / HF_EXPORT
