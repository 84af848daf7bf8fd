"""Supervised fine-tuning: negative log-likelihood of the responses, prompts masked out."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from nrl_core.algorithms.base import AlgorithmRun
from nrl_core.algorithms.loss import NLLLoss
from nrl_core.algorithms.runtime import Runtime
from nrl_core.algorithms.setup import PhaseTimer, load_tokenizer
from nrl_core.config.checks import data_parallel_size
from nrl_core.contracts import logprob_temperature
from nrl_core.data import DatumSpec, LengthLimits, prepare_data, sft_batch
from nrl_core.errors import NrlError

logger = logging.getLogger(__name__)


class SFT(AlgorithmRun):
    section = "sft"
    summary_prefixes = ("val/", "train/loss")

    def __init__(self, config: Mapping[str, Any], *, runtime: Runtime | None = None) -> None:
        if logprob_temperature(config) != 1.0:
            logger.warning("policy.generation.temperature is %s: training backends divide the logits by it, as NeMo RL "
                           "does, so SFT fits softmax(logits / T); set policy.generation: null to fit the model itself",
                           config["policy"]["generation"]["temperature"])
        self.tokenizer = load_tokenizer(config)
        runtime = runtime if runtime is not None else Runtime.for_process()
        data = prepare_data(config["data"], self.tokenizer, runtime.plugins, processor=sft_processor_name(config["data"]),
                            limits=LengthLimits(total=config["policy"]["max_total_sequence_length"]))
        if not any(d.response_ids for d in data.train):
            raise NrlError(f"data.processor: '{config['data']['processor']}' gives no responses to learn; use a "
                           "processor that writes them (sft, or a plugin's such as kv_lookup_sft)")
        self.val_data: list[DatumSpec] = data.val or []
        self.loss_fn = NLLLoss()
        super().__init__(config, batch_size=int(config["policy"]["train_global_batch_size"]), train_data=data.train,
                         runtime=runtime)
        self.dp_size = data_parallel_size(config, self.choice.training, self.runtime.plugins)

    def step(self, examples: Sequence[DatumSpec]) -> dict[str, float]:
        timer = PhaseTimer()
        batch = sft_batch(examples, self.tokenizer.pad_token_id)
        with timer("training"):
            metrics = self.policy.train(batch, self.loss_fn)
        return {**{f"train/{k}": v for k, v in metrics.items()}, **timer.metrics()}

    def validate(self, step: int) -> dict[str, float]:
        """Mean response NLL over ``sft.val_batches`` batches of the validation set."""
        if not self.val_data:
            return {}
        size = int(self.cfg["val_global_batch_size"])
        total, tokens = 0.0, 0.0
        for start in range(0, min(len(self.val_data), size * int(self.cfg["val_batches"])), size):
            examples = list(self.val_data[start:start + size])
            # a last (or only) batch that does not divide over the data-parallel ranks gets copies
            # of its first example that count for nothing
            batch = sft_batch(examples + examples[:1] * (-len(examples) % self.dp_size), self.tokenizer.pad_token_id)
            batch.fields["token_mask"][len(examples):] = 0
            logprobs = self.policy.get_logprobs(batch)
            mask = batch.fields["token_mask"]
            total -= float((logprobs * mask).sum())
            tokens += float(mask.sum())
        return {"val/loss": total / max(tokens, 1.0)}


main = SFT.main


def sft_processor_name(data: Mapping[str, Any]) -> str:
    """``data.processor``, except its default (``math``, a prompt without a response): SFT's is ``sft``."""
    name = data.get("processor") or "sft"
    return "sft" if name == "math" else name
