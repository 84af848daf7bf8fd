"""``nrl convert hf-to-megatron`` and ``nrl convert megatron-to-hf``, added through ``nrl_commands``.

Only argparse here: ``nrl`` imports this module whenever it builds its parser. The conversions
themselves are :mod:`nrl_backend_megatron.conversions`, imported when a command runs.
"""

from __future__ import annotations

import argparse

from nrl_core.api import CommandSpec

DTYPES = ("float32", "bfloat16", "float16")


def specs(distribution: str) -> list[CommandSpec]:
    here = __name__
    return [
        CommandSpec(name="hf-to-megatron", group="convert", distribution=distribution,
                    arguments=f"{here}:hf_to_megatron_arguments", entry=f"{here}:run_hf_to_megatron",
                    help="a Hugging Face model to Megatron-Core: the cache training reads, or a Megatron-LM "
                         "checkpoint (--out); checked against the HF model's logprobs"),
        CommandSpec(name="megatron-to-hf", group="convert", distribution=distribution,
                    arguments=f"{here}:megatron_to_hf_arguments", entry=f"{here}:run_megatron_to_hf",
                    help="a Megatron-LM, Megatron-Bridge or dist_checkpointing checkpoint (any TP/PP/EP "
                         "layout, MoE included) to a Hugging Face model; checked against its logprobs"),
    ]


def hf_to_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a Hugging Face model directory (safetensors)")
    parser.add_argument("--out", default=None,
                        help="write a Megatron-LM checkpoint here (new or empty: release/ and its tracker, with "
                             "the HF config in hf_config/); without it, convert into the cache training reads "
                             "(NRL_MEGATRON_CHECKPOINT_DIR, else $HF_HOME/nemo_rl)")
    parser.add_argument("--force", action="store_true", help="convert again although the cache holds a conversion")


def megatron_to_hf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a Megatron-LM or Megatron-Bridge checkpoint directory (its latest "
                                           "iteration), one iteration, or a dist_checkpointing directory")
    parser.add_argument("--out", required=True, help="the Hugging Face model directory to write (new or empty)")
    parser.add_argument("--hf-config", default=None,
                        help="a Hugging Face directory whose config.json describes the model (and whose tokenizer "
                             "is copied); needed unless the checkpoint carries one (hf_config/, as --out of "
                             "hf-to-megatron writes, or Megatron-Bridge's model.hf_model_id)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="the exported weights' dtype")


def run_hf_to_megatron(args: argparse.Namespace) -> int:
    from nrl_backend_megatron.conversions import hf_to_megatron

    report = hf_to_megatron(args.model, args.out, force=args.force)
    print(report.summary())
    return 0


def run_megatron_to_hf(args: argparse.Namespace) -> int:
    from nrl_backend_megatron.conversions import megatron_to_hf

    report = megatron_to_hf(args.checkpoint, args.out, hf_config=args.hf_config, dtype=args.dtype)
    print(report.summary())
    return 0
