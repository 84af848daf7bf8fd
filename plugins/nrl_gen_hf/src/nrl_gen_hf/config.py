"""Schema of ``policy.generation.hf_cfg`` and the engine settings a worker reads from a config.

Sampling itself (temperature, top-p, top-k, stops, ``max_new_tokens``) is the core's
``policy.generation`` keys, shared by every backend; this section holds only what is particular to
running transformers' ``generate``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nrl_core.api import Field, Section, resolve_precision

KEY = "policy.generation.hf_cfg"
PRECISIONS = ("float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")

HF_CFG = Section(doc="transformers generate options (the hf generation backend).", fields={
    "precision": Field(type=str, default=None, nullable=True, choices=PRECISIONS,
                       doc="dtype of the engine's weights; null: policy.precision"),
    "batch_size": Field(type=int, default=64, minimum=1,
                        doc="most prompts one generate call decodes together; prompts batch only with prompts "
                            "of the same length, so nothing is padded and a sample never depends on its neighbours"),
    "attn_implementation": Field(type=str, default=None, nullable=True,
                                 doc="transformers' attention kernel (sdpa, eager, flash_attention_2...); "
                                     "null: transformers' default"),
    "load_format": Field(type=str, default="auto", choices=LOAD_FORMATS,
                         doc="auto: read policy.model_name; dummy: start from random weights of the same shapes "
                             "(no checkpoint read) and let the core's first refit load the policy's"),
    "seed": Field(type=int, default=None, nullable=True,
                  doc="base sampling seed; null: policy.seed"),
})


@dataclass(frozen=True)
class EngineSettings:
    """The resolved engine options of one worker."""

    model_dir: str
    tokenizer_dir: str
    precision: str
    batch_size: int
    attn_implementation: str | None
    load_format: str
    seed: int
    max_total_length: int
    trust_remote_code: bool
    hf_config_overrides: Mapping[str, Any]

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> EngineSettings:
        """Read a validated config; a bare one (tests, notebooks) gets the schema's defaults."""
        policy = config["policy"]
        section = HF_CFG.validate(dict((policy.get("generation") or {}).get("hf_cfg") or {}), KEY)
        model_dir = str(policy["model_name"])
        seed = section["seed"] if section["seed"] is not None else policy.get("seed")
        return cls(
            model_dir=model_dir,
            tokenizer_dir=str((policy.get("tokenizer") or {}).get("name") or model_dir),
            precision=section["precision"] or resolve_precision(policy.get("precision")),
            batch_size=int(section["batch_size"]),
            attn_implementation=section["attn_implementation"],
            load_format=section["load_format"],
            seed=int(seed if seed is not None else 0),
            max_total_length=int(policy.get("max_total_sequence_length") or 512),
            trust_remote_code=bool(policy.get("trust_remote_code")),
            hf_config_overrides=dict(policy.get("hf_config_overrides") or {}),
        )
