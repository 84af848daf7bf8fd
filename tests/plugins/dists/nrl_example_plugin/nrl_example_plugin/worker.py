"""``ExampleWorker``: the smallest complete nrl training backend, one process, plain PyTorch.

It writes the two engine primitives of :class:`nrl_core.api.TrainingEngine`: building the model and
its optimizer, and a forward over one micro-batch that returns logprobs under the sampling
temperature. The engine brings the rest of the contract: micro-batches, the loss with its global
normalisers, metrics, the non-finite guard, AdamW's step with gradient clipping, the reference
policy (``ReferenceWeights``, the initial weights in host memory), the colocated hand-off and the
HF-named weight stream and export. ``StateFileCheckpoints`` saves model, optimizer, step and RNG in
one file. It declares no capabilities, so validation refuses configs that need data parallelism,
sequence packing or dynamic batching with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nrl_core.api import (
    CheckpointOptions,
    ConfigError,
    ForwardRequest,
    MicroBatch,
    ReferenceWeights,
    StateFileCheckpoints,
    TrainingEngine,
    logprob_temperature,
    parse_dtype,
    training_precision,
)


class ExampleWorker(TrainingEngine):
    backend_name = "example"

    def __init__(self, config: Mapping[str, Any], rank: int = 0, world_size: int = 1) -> None:
        from transformers import AutoModelForCausalLM

        if world_size != 1:
            raise ConfigError("cluster", f"the example backend trains on one rank, got a world of {world_size}")
        self.rank, self.device, self.policy = rank, torch.device("cpu"), config["policy"]
        if self.policy.get("scheduler"):
            raise ConfigError("policy.scheduler", "the example backend has no LR schedulers; remove policy.scheduler")
        optimizer = self.policy.get("optimizer") or {}
        if optimizer.get("name", "torch.optim.AdamW") not in ("torch.optim.AdamW", "AdamW"):
            raise ConfigError("policy.optimizer.name", "the example backend supports torch.optim.AdamW only")
        self.temperature = logprob_temperature(config)
        torch.manual_seed(int(self.policy["seed"]))  # validation resolves a null seed to the algorithm's
        self.model = AutoModelForCausalLM.from_pretrained(
            self.policy["model_name"], dtype=parse_dtype(training_precision(self.policy, self.device)),
            trust_remote_code=bool(self.policy.get("trust_remote_code")))
        for key, value in (self.policy.get("hf_config_overrides") or {}).items():
            setattr(self.model.config, key, value)
        self.hf_config = self.model.config
        self.reference = ReferenceWeights(self.model.parameters())  # the initial weights, for the KL penalty
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **(optimizer.get("kwargs") or {}))
        self.checkpoints, self.section = StateFileCheckpoints(self, "example_state.pt"), self.policy["example_cfg"]

    def forward(self, mb: MicroBatch, request: ForwardRequest) -> tuple[torch.Tensor, ...]:
        """``[n, T]`` log p(token_t | tokens_<t) under softmax(logits / T); 0 at position 0 and padding."""
        ids, lengths = mb.batch.input_ids, mb.batch.input_lengths
        attention = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
        logits = self.model(input_ids=ids, attention_mask=attention).logits.float()
        lp = torch.log_softmax(logits[:, :-1] / self.temperature, -1).gather(-1, ids[:, 1:, None])[..., 0]
        return (torch.cat([torch.zeros(ids.shape[0], 1), lp], 1) * attention,)

    def save_checkpoint(self, path: str, options: CheckpointOptions | None = None) -> None:
        """One process holds everything, so fully_parallel_save and fully_parallel_load change nothing."""
        self.checkpoints.save(path, options or CheckpointOptions.from_section(self.section))

    def load_checkpoint(self, path: str, options: CheckpointOptions | None = None) -> None:
        self.checkpoints.load(path, options or CheckpointOptions.from_section(self.section))

    def finalize_checkpoint(self) -> None:
        self.checkpoints.finalize()
