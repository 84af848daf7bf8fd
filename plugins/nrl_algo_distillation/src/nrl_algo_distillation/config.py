"""The ``distillation`` section, the ``loss_fn`` keys it reads and the checks that relate them to
the teacher, with NeMo RL's names and defaults (``examples/configs/distillation_math.yaml``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nrl_core.api import ConfigError, Field, Section

KL_TYPES = ("forward", "reverse", "mixed")

DISTILLATION_SCHEMA = Section(doc="On-policy distillation (nrl-algo-distillation).", fields={
    "num_prompts_per_step": Field(type=int, default=128, minimum=1),
    "num_generations_per_prompt": Field(type=int, default=1, minimum=1),
    "max_rollout_turns": Field(type=int, default=1, minimum=1,
                               doc="turns of an episode; nrl distils single responses (1)"),
    "max_num_steps": Field(type=int, default=1000, minimum=1),
    "max_num_epochs": Field(type=int, default=10, minimum=1),
    "val_batch_size": Field(type=int, default=64, minimum=1),
    "val_period": Field(type=int, default=20, doc="validate every N steps; 0 or less never (NeMo RL uses -1)"),
    "val_at_start": Field(type=bool, default=False),
    "val_at_end": Field(type=bool, default=False),
    "max_val_samples": Field(type=int, default=512, nullable=True, minimum=1),
    "topk_logits_k": Field(type=int, default=64, minimum=1,
                           doc="the teacher's likeliest tokens per position the student learns from"),
    "seed": Field(type=int, default=42),
})

SHARED_KEYS: Mapping[str, Section] = {
    "loss_fn": Section(fields={
        "kl_type": Field(type=str, default="mixed", choices=KL_TYPES,
                         doc="distillation: KL(teacher||student) forward, KL(student||teacher) reverse, or both"),
        "mixed_kl_weight": Field(type=(int, float), default=0.5, doc="distillation, mixed: the forward KL's weight"),
        "zero_outside_topk": Field(type=bool, default=False,
                                   doc="distillation: the student's probabilities over the whole vocabulary "
                                       "(not renormalised over the teacher's top-k)"),
    }),
    # NeMo RL's cross-tokenizer recipes name a list of teachers; accepted here only to be refused in one line
    "": Section(fields={"teachers": Field(type=list, default=None, nullable=True,
                                          doc="NeMo RL's cross-tokenizer teachers: not supported")}),
}


def check_distillation(config: Mapping[str, Any]) -> None:
    """What the schema cannot say: a teacher that shares the student's tokenizer, a KL the loss
    implements, backends that compute top-k logprobs."""
    if config.get("teachers"):
        raise ConfigError("teachers", "cross-tokenizer distillation (NeMo RL's xtoken recipes: teachers with their "
                                      "own tokenizers) is not supported; distil from one teacher that shares the "
                                      "student's tokenizer, set in teacher")
    teacher = config.get("teacher")
    if teacher is None:
        raise ConfigError("teacher", "distillation needs a teacher: add a teacher section shaped like policy "
                                     "(teacher.model_name and its backend section)")
    cfg, loss = config["distillation"], config["loss_fn"]
    if int(cfg["max_rollout_turns"]) != 1:
        raise ConfigError("distillation.max_rollout_turns", "nrl distils single responses; set it to 1")
    responses = int(cfg["num_prompts_per_step"]) * int(cfg["num_generations_per_prompt"])
    size = int(config["policy"]["train_global_batch_size"])
    if responses % size:
        raise ConfigError("policy.train_global_batch_size", f"{size} does not divide the {responses} responses of a "
                                                            "step (distillation.num_prompts_per_step x "
                                                            "num_generations_per_prompt); make it a divisor")
    weight = float(loss["mixed_kl_weight"])
    if not 0.0 <= weight <= 1.0:
        raise ConfigError("loss_fn.mixed_kl_weight", f"must be within [0, 1], got {weight}")
    if loss["zero_outside_topk"] and loss["kl_type"] != "forward":
        raise ConfigError("loss_fn.zero_outside_topk", "with a reverse or mixed KL it needs the student's entropy "
                                                      "over the whole vocabulary, which nrl does not compute; set it "
                                                      "to false or use kl_type: forward")
    _check_backends(config)
    _check_same_tokenizer(config)


def _check_backends(config: Mapping[str, Any]) -> None:
    from nrl_core.api import choose_backends, model_config

    for key, model in (("policy", config), ("teacher", model_config(config, "teacher"))):
        spec = choose_backends(model, generation=False, warn=False).training
        if "topk_logprobs" not in spec.capabilities:
            raise ConfigError(key, f"the {spec.name} training backend ({spec.distribution}) does not declare "
                                   "topk_logprobs, which distillation needs; use a backend that does")


def _tokenizer_files(path: str) -> dict[str, Any] | None:
    """The vocabulary a local checkpoint's tokenizer defines, or None where it cannot be read here."""
    root = Path(path)
    tokenizer = root / "tokenizer.json"
    if tokenizer.is_file():
        content = json.loads(tokenizer.read_text())
        model, added = content.get("model") or {}, content.get("added_tokens") or []
        return {"vocab": model.get("vocab"), "added": sorted((t["id"], t["content"]) for t in added)}
    vocab = root / "vocab.json"
    return {"vocab": json.loads(vocab.read_text()), "added": []} if vocab.is_file() else None


def _vocab_size(path: str) -> int | None:
    config = Path(path) / "config.json"
    return json.loads(config.read_text()).get("vocab_size") if config.is_file() else None


def _check_same_tokenizer(config: Mapping[str, Any]) -> None:
    """The teacher's top-k ids index the student's vocabulary, so both must be one tokenizer and one
    vocabulary size (as NeMo RL asserts). Checked where both are local directories; hub names are
    not compared."""
    student, teacher = config["policy"]["tokenizer"]["name"], config["teacher"]["tokenizer"]["name"]
    if student == teacher or not (Path(student).is_dir() and Path(teacher).is_dir()):
        return
    if _tokenizer_files(student) != _tokenizer_files(teacher):
        raise ConfigError("teacher.tokenizer.name", f"'{teacher}' is not the student's tokenizer ('{student}'); "
                                                   "distillation needs one shared tokenizer (cross-tokenizer "
                                                   "distillation is not supported)")
    sizes = _vocab_size(config["policy"]["model_name"]), _vocab_size(config["teacher"]["model_name"])
    if None not in sizes and sizes[0] != sizes[1]:
        raise ConfigError("teacher.model_name", f"has a vocabulary of {sizes[1]} logits, the student {sizes[0]}; "
                                               "teacher and student need the same vocabulary")
