"""An nrl training checkpoint as a Hugging Face model, checked against the checkpoint's own logits.

The checkpoint's ``training_info.json`` holds the run's config, so the training backend that wrote
it builds its workers again (its layout, its parallelism), loads the policy's state through the
same ``load_checkpoint`` a resume uses, and writes the model with its ``export_hf``. Before the
export is published the backend's logprobs of a few texts are compared with those of the exported
model loaded by ``transformers`` (:mod:`nrl_core.checkpoint.to_hf`): a conversion that does not
reproduce the trained model never reaches the output directory.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nrl_core.checkpoint.to_hf import (
    hf_logprobs,
    hf_model,
    logprob_tolerance,
    max_logprob_error,
    new_output_dir,
    probe_batch,
    publish_dir,
    staging_dir,
    step_directory,
)
from nrl_core.contracts import logprob_temperature
from nrl_core.errors import NrlError

__all__ = ["ConversionReport", "checkpoint_to_hf"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConversionReport:
    source: str
    output: str
    step: int
    max_logprob_error: float
    tolerance: float


def checkpoint_to_hf(checkpoint: str, output: str, overrides: Iterable[str] = ()) -> ConversionReport:
    """Write the policy of ``checkpoint`` (a step directory, or a run's checkpoint directory for its
    latest step) as a Hugging Face model at ``output``; ``overrides`` change the saved config (the
    base model's path when it moved: ``policy.model_name=...``)."""
    from nrl_core.algorithms.installed import choose_backends, validate_config
    from nrl_core.checkpoint.checksums import verify_tree
    from nrl_core.checkpoint.manager import CheckpointManager
    from nrl_core.config.loader import apply_overrides

    out = new_output_dir(output)
    step = step_directory(Path(checkpoint).expanduser())
    info = CheckpointManager.load_info(step)
    if "files" in info:
        verify_tree(step, info["files"], info.get("checksum", "xxh3_64"))
    raw = dict(info["config"])
    apply_overrides(raw, overrides)
    # a saved config holds every installed algorithm's section, defaults filled: check it as the
    # algorithm that wrote it (older checkpoints name none; their configs hold only their own)
    config = validate_config(raw, algorithm=info.get("algorithm"))
    training = choose_backends(config, generation=False).training
    tmp = staging_dir(out)
    try:
        trained, batch = _export_and_score(config, training, step, tmp)
        error = _max_logprob_error(tmp, batch, trained, logprob_temperature(config))
        tolerance = logprob_tolerance(config["policy"].get("precision"))
        if error > tolerance:
            raise NrlError(f"{step}: the exported model's logprobs differ from the checkpoint's by up to {error:.3g} "
                           f"(tolerance {tolerance:g}); the export is wrong, nothing was written to {out}")
        publish_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report = ConversionReport(source=str(step), output=str(out), step=int(info["step"]),
                              max_logprob_error=error, tolerance=tolerance)
    logger.info("converted %s to %s: logprobs within %.2g of the checkpoint's", step, out, error)
    return report


def _export_and_score(config: Mapping[str, Any], training: Any, step: Path, tmp: Path) -> tuple[Any, Any]:
    """Build the training workers, load ``step``'s policy, export it to ``tmp`` and score the probe
    texts with the loaded weights."""
    import ray

    from nrl_core.algorithms.policy import Policy
    from nrl_core.algorithms.setup import load_tokenizer
    from nrl_core.cluster import init_ray, shutdown_ray

    batch = probe_batch(load_tokenizer(config))
    started_ray = not ray.is_initialized()
    init_ray(config["cluster"])
    policy = None
    try:
        policy = Policy(config, training, colocated_generation=False, reference_policy=False)
        policy.load_checkpoint(str(step / "policy"))
        policy.export_hf(str(tmp))
        return policy.get_logprobs(batch), batch
    finally:
        if policy is not None:
            policy.shutdown()
        if started_ray:
            shutdown_ray()


def _max_logprob_error(model_dir: Path, batch: Any, trained: Any, temperature: float) -> float:
    """The largest difference between ``trained`` (the backend's logprobs, which divide the logits
    by the sampling temperature) and the exported model's."""
    return max_logprob_error(hf_logprobs(hf_model(model_dir), batch, temperature), trained, batch)
