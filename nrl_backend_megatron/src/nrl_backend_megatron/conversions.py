"""HF ↔ Megatron-Core conversions outside a run, each checked before it is published.

Both directions run the backend's own worker in a child process (a world of one), so a conversion
is the code a training run uses: HF → Megatron is the run's one-time conversion (into the same cache),
Megatron → HF loads the checkpoint as ``pretrained_checkpoint`` does (any TP/PP/EP layout, since
dist_checkpointing reshards on load) and writes it with the worker's ``export_hf``. The check, in
this process, compares the logprobs of a few texts under the source and under the converted
model; an output directory appears in one rename, only after its check passed.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nrl_backend_megatron.convert.megatron_checkpoint import TRACKER, architecture_of_hf, locate
from nrl_backend_megatron.convert.sharded import RANK_VARS
from nrl_core.api import (
    NrlError,
    logprob_tolerance,
    max_logprob_error,
    new_output_dir,
    probe_batch,
    publish_dir,
    staging_dir,
)

__all__ = ["ConversionReport", "HF_CONFIG_DIR", "hf_to_megatron", "megatron_to_hf", "megatron_lm_args"]

logger = logging.getLogger(__name__)

HF_CONFIG_DIR = "hf_config"
"""Where a Megatron-LM checkpoint written by ``hf_to_megatron`` keeps the HF config and tokenizer."""


@dataclass(frozen=True)
class ConversionReport:
    source: str
    output: str
    max_logprob_error: float
    tolerance: float

    def summary(self) -> str:
        return (f"wrote {self.output} from {self.source}; its logprobs are within {self.max_logprob_error:.2g} of the "
                f"source's (tolerance {self.tolerance:g})")


def hf_to_megatron(model: str, out: str | None = None, *, force: bool = False) -> ConversionReport:
    """Convert the HF model directory ``model`` into the conversion cache training reads, and,
    with ``out``, also into a Megatron-LM checkpoint there (``release/``, its tracker, and the HF
    config and tokenizer in ``hf_config/``)."""
    source = Path(model).expanduser().resolve()
    if not (source / "config.json").is_file():
        raise NrlError(f"{source} is not a Hugging Face model directory (no config.json)")
    target = new_output_dir(out) if out else None
    tmp = staging_dir(target) if target else None
    try:
        result = _in_child({"op": "hf_to_megatron", "model": str(source), "out": str(tmp) if tmp else None,
                            "force": force})
        batch = _probe_batch(source)
        reference = _hf_logprobs(source, batch)
        error = max(max_logprob_error(lp, reference, batch) for lp in result["logprobs"])
        if error > logprob_tolerance("float32"):
            if result["converted"]:
                shutil.rmtree(result["cache"], ignore_errors=True)
            raise NrlError(f"converting {source} gives logprobs {error:.3g} away from the HF model's; the conversion is "
                           f"wrong: it was removed and nothing was written to {target or result['cache']}")
        if target is None:
            return ConversionReport(str(source), result["cache"], error, logprob_tolerance("float32"))
        publish_dir(tmp, target)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return ConversionReport(str(source), str(target), error, logprob_tolerance("float32"))


def megatron_to_hf(checkpoint: str, out: str, *, hf_config: str | None = None,
                   dtype: str = "float32") -> ConversionReport:
    """Write the Megatron checkpoint ``checkpoint`` (any layout :func:`locate` reads) as a Hugging
    Face model at ``out``, described by the HF directory ``hf_config`` (or the one it carries)."""
    target = new_output_dir(out)
    found = locate(checkpoint)
    described_by = Path(hf_config).expanduser() if hf_config else _carried_hf_config(Path(checkpoint).expanduser(),
                                                                                      found)
    if not (described_by / "config.json").is_file():
        raise NrlError(f"{described_by} has no config.json; --hf-config names the Hugging Face directory that "
                       "describes the checkpoint's model")
    tmp = staging_dir(target)
    try:
        result = _in_child({"op": "megatron_to_hf", "model": str(described_by.resolve()), "checkpoint": str(found.path),
                            "out": str(tmp), "dtype": dtype})
        batch = _probe_batch(described_by)
        error = max_logprob_error(result["logprobs"][0], _hf_logprobs(tmp, batch), batch)
        if error > logprob_tolerance(dtype):
            raise NrlError(f"the exported model's logprobs differ from the checkpoint's by up to {error:.3g} "
                           f"(tolerance {logprob_tolerance(dtype):g}); nothing was written to {target}")
        publish_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ConversionReport(str(found.path), str(target), error, logprob_tolerance(dtype))


def _in_child(request: dict[str, Any]) -> dict[str, Any]:
    """Run one conversion in a child process (a world of one, with Megatron and its CPU shim) and
    return the logprobs it scored; the check against ``transformers`` runs here, apart from it."""
    with tempfile.TemporaryDirectory(prefix="nrl-convert-") as scratch:
        spec, answer = Path(scratch) / "request.json", Path(scratch) / "result.pt"
        spec.write_text(json.dumps({**request, "result": str(answer)}))
        env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        proc = subprocess.run([sys.executable, "-m", __name__, str(spec)], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [line for line in proc.stderr.strip().splitlines() if line.strip()] or [f"exit {proc.returncode}"]
            raise NrlError(lines[-1].removeprefix(_CHILD_ERROR).strip())
        return torch.load(answer, weights_only=True)


_CHILD_ERROR = "nrl-convert-error:"


def _child(request: dict[str, Any]) -> dict[str, Any]:
    if request["op"] == "hf_to_megatron":
        model = request["model"]
        batch = _probe_batch(Path(model))
        worker = _worker(model, precision="float32", force=bool(request["force"]))
        result = {"cache": str(worker.conversion.path), "converted": bool(worker.conversion.converted),
                  "logprobs": [_logprobs(worker, batch)]}
        if request["out"]:
            _save_megatron_lm(worker, Path(request["out"]))
            del worker
            gc.collect()
            check = _worker(model, precision="float32", pretrained=request["out"])
            result["logprobs"].append(_logprobs(check, batch))
        return result
    batch = _probe_batch(Path(request["model"]))
    worker = _worker(request["model"], precision=request["dtype"], pretrained=request["checkpoint"])
    logprobs = _logprobs(worker, batch)
    worker.export_hf(request["out"])
    return {"logprobs": [logprobs]}


def megatron_lm_args(hf_config: Any, dtype: torch.dtype) -> argparse.Namespace:
    """The training arguments Megatron-LM records in ``common.pt`` for this model (its names)."""
    arch = architecture_of_hf(hf_config)
    experts = arch["num_experts"]
    return argparse.Namespace(
        num_layers=arch["num_layers"], hidden_size=arch["hidden_size"], ffn_hidden_size=arch["ffn_hidden_size"],
        num_attention_heads=arch["num_attention_heads"],
        group_query_attention=arch["num_query_groups"] != arch["num_attention_heads"],
        num_query_groups=arch["num_query_groups"], kv_channels=arch["kv_channels"],
        padded_vocab_size=arch["vocab_size"], make_vocab_size_divisible_by=1,
        untie_embeddings_and_output_weights=arch["untie_embeddings_and_output_weights"],
        normalization=arch["normalization"], swiglu=arch["gated_linear_unit"], add_bias_linear=arch["add_bias_linear"],
        add_qkv_bias=arch["add_qkv_bias"], qk_layernorm=arch["qk_layernorm"],
        position_embedding_type=arch["position_embedding_type"], use_rotary_position_embeddings=True,
        rotary_base=int(arch["rotary_base"]), norm_epsilon=arch["norm_epsilon"],
        max_position_embeddings=hf_config.max_position_embeddings, num_experts=experts,
        moe_ffn_hidden_size=arch["moe_ffn_hidden_size"], moe_router_topk=arch["moe_router_topk"],
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, ckpt_format="torch_dist")


def _save_megatron_lm(worker: Any, root: Path) -> None:
    """Megatron-LM's layout, saved by Megatron-Core's dist_checkpointing from the worker's model."""
    from megatron.core import dist_checkpointing

    from nrl_core.api import copy_tokenizer

    release = root / "release"
    release.mkdir(parents=True)
    state = {"model": worker.model.sharded_state_dict(), "iteration": 0, "checkpoint_version": 3.0,
             "args": megatron_lm_args(worker.hf_config, next(worker.model.parameters()).dtype)}
    dist_checkpointing.save(state, str(release))
    (root / TRACKER).write_text("release")
    carried = root / HF_CONFIG_DIR
    carried.mkdir()
    worker.hf_config.save_pretrained(str(carried))
    copy_tokenizer(worker.tokenizer_source(), carried)


def _carried_hf_config(given: Path, found: Any) -> Path:
    for place in (given, given.parent, found.path.parent):
        if (place / HF_CONFIG_DIR / "config.json").is_file():
            return place / HF_CONFIG_DIR
    hf_model_id = _bridge_hf_model_id(found.path)
    if hf_model_id and Path(hf_model_id).expanduser().is_dir():
        return Path(hf_model_id).expanduser()
    raise NrlError(f"{given} carries no Hugging Face config ({HF_CONFIG_DIR}/ or a local model.hf_model_id); pass "
                   "--hf-config DIR, the Hugging Face model it was trained from")


def _bridge_hf_model_id(iteration: Path) -> str | None:
    import yaml

    path = iteration / "run_config.yaml"
    if not path.is_file():
        return None
    model = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
    return str(model["hf_model_id"]) if model.get("hf_model_id") else None


def _worker(model: str, *, precision: str, pretrained: str | None = None, force: bool = False) -> Any:
    """The Megatron worker of a world of one (started here if no process group exists)."""
    from nrl_backend_megatron.schema import MEGATRON_CFG_SCHEMA
    from nrl_backend_megatron.worker import MegatronPolicyWorker

    section = MEGATRON_CFG_SCHEMA.validate({"enabled": True, "pretrained_checkpoint": pretrained,
                                            "force_reconvert_from_hf": force, "logging_level": "WARNING"},
                                           "policy.megatron_cfg")
    policy = {"model_name": model, "precision": precision, "train_global_batch_size": 1, "train_micro_batch_size": 1,
              "logprob_batch_size": 4, "max_total_sequence_length": 64, "max_grad_norm": None, "optimizer": None,
              "hf_config_overrides": {}, "sequence_packing": {"enabled": False}, "seed": 0, "megatron_cfg": section}
    return MegatronPolicyWorker({"policy": policy}, 0, 1)


def _probe_batch(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return probe_batch(AutoTokenizer.from_pretrained(str(model_dir)))


def _logprobs(worker: Any, batch: Any) -> torch.Tensor:
    from nrl_core.api import BatchShard

    return BatchShard.assemble([worker.get_logprobs(batch)], batch.size, int(batch.input_ids.shape[1])).float()


def _hf_logprobs(model_dir: Path, batch: Any) -> torch.Tensor:
    from nrl_core.api import hf_logprobs, hf_model

    return hf_logprobs(hf_model(model_dir), batch, 1.0)


def _main(argv: list[str]) -> int:
    request = json.loads(Path(argv[0]).read_text())
    try:
        result = _child(request)
    except NrlError as exc:
        print(f"{_CHILD_ERROR} {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    torch.save(result, request["result"])
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
