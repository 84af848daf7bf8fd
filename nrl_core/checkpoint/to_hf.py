"""Writing a Hugging Face model that is checked before anyone sees it: the output directory is
new or empty, the model is written beside it and appears in one rename (never half-written), and
its logprobs of a few probe texts, from a plain ``transformers`` forward, are compared with the
trained model's first. ``nrl convert checkpoint`` (:mod:`nrl_core.algorithms.checkpoint_to_hf`) and
the backends' converters build on these.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nrl_core.errors import NrlError

if TYPE_CHECKING:
    import torch

    from nrl_core.contracts import TokenBatch

__all__ = ["PROBE_TEXTS", "hf_logprobs", "hf_model", "logprob_tolerance", "max_logprob_error", "new_output_dir",
           "probe_batch", "publish_dir", "staging_dir", "step_directory"]

PROBE_TEXTS = (
    "Q: What is 12 + 7?\nA: 19",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b",
)
"""What both sides score: arithmetic, prose and code, so every embedding row that matters is used."""


def logprob_tolerance(precision: str | None) -> float:
    """The largest difference of a token's logprob the check accepts: the backend computes in the
    run's precision, ``transformers`` in float32."""
    return 1e-3 if precision in (None, "float32") else 5e-2


def step_directory(checkpoint: Path) -> Path:
    """``checkpoint`` when it is a step directory, else the latest complete step of a run's
    checkpoint directory; anything else is one line."""
    from nrl_core.checkpoint.manager import INFO_FILE, STEP_DIR

    if (checkpoint / INFO_FILE).is_file():
        return checkpoint
    if checkpoint.is_dir():  # read only: a CheckpointManager would tidy the directory up
        steps = sorted((int(match.group(1)), path) for path in checkpoint.iterdir()
                       if (match := STEP_DIR.match(path.name)) and (path / INFO_FILE).is_file())
        if steps:
            return steps[-1][1]
    raise NrlError(f"{checkpoint}: not an nrl checkpoint (no {INFO_FILE}, no step_N directories); "
                   "pass a run's checkpoint directory or one of its step directories")


def probe_batch(tokenizer: Any) -> Any:
    """:data:`PROBE_TEXTS` as a right-padded :class:`~nrl_core.contracts.TokenBatch`, every token
    after the first counted."""
    import torch

    from nrl_core.contracts import TokenBatch

    rows = [tokenizer(text, add_special_tokens=True)["input_ids"] for text in PROBE_TEXTS]
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), width), int(pad), dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, 1:len(row)] = 1.0
    return TokenBatch(input_ids=ids, input_lengths=torch.tensor([len(r) for r in rows]), fields={"token_mask": mask})


def hf_logprobs(model: Any, batch: TokenBatch, temperature: float) -> torch.Tensor:
    """``[B, T]`` logprobs of each token under ``softmax(logits / temperature)`` from a plain HF
    forward, aligned as in :class:`~nrl_core.contracts.TokenBatch` (position 0 and padding 0)."""
    import torch

    attention = (torch.arange(batch.input_ids.shape[1])[None] < batch.input_lengths[:, None]).long()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=attention).logits.float()
    lp = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros(lp.shape[0], 1), lp], 1)
    return lp * attention


def hf_model(path: str | os.PathLike[str]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def max_logprob_error(ours: Any, theirs: Any, batch: Any) -> float:
    """The largest difference of two ``[B, T]`` logprob tensors over the tokens ``batch`` counts."""
    mask = batch.fields["token_mask"] > 0
    return float((ours.float() - theirs.float()).abs()[mask].max())


def new_output_dir(output: str) -> Path:
    """``output`` as a path, refused in one line unless it is new or an empty directory."""
    out = Path(output).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise NrlError(f"{out}: exists and is not empty; choose another output directory or remove it")
    return out


def staging_dir(out: Path) -> Path:
    """Where an output is written before :func:`publish_dir` renames it into place: beside it,
    emptied of what an interrupted run left."""
    tmp = out.parent / f".tmp_{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    return tmp


def publish_dir(tmp: Path, out: Path) -> None:
    """The finished output appears at ``out`` in one rename (an empty ``out`` makes way)."""
    if out.exists():
        out.rmdir()
    tmp.rename(out)
