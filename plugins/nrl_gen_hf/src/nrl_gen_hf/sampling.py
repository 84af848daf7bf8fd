"""What one ``generate`` call samples from, and the logprobs it reports.

Rollout logprobs must be those of the distribution each token was drawn from (vLLM's
``processed_logprobs``): the loss's importance weights divide the policy's probabilities by them.
transformers applies its sampling warpers after any user processor and hands none of the final
scores back without keeping every step's full vocabulary row (gigabytes for long rollouts), so this
module turns the generation config's own warpers off and passes the same transformers warpers as
the call's processor list, ending in :class:`LogprobRecorder`, which sees the final scores of each
step and keeps one row per sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from nrl_core.api import SamplingSettings

if TYPE_CHECKING:
    import torch


class HFSampling(SamplingSettings):
    """The core's :class:`~nrl_core.generation_kit.SamplingSettings`, as transformers' warpers."""

    def warpers(self, greedy: bool) -> list[Any]:
        """transformers' warpers in the order its sampling applies them; none for greedy, whose
        reported logprobs are then the model's unscaled ones (as vLLM reports them)."""
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        if not self.samples(greedy):
            return []
        warpers: list[Any] = []
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k is not None:
            warpers.append(TopKLogitsWarper(top_k=self.top_k))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=self.top_p))
        return warpers


class LogprobRecorder:
    """A logits processor that changes nothing and records the logprob of each sampled token under
    the scores it was sampled from.

    Called at step ``t`` with the tokens so far and the step's final scores, it first resolves the
    previous step's pending row with the token that step produced (now ``input_ids[:, -1]``), then
    keeps this step's log-softmax as the new pending row. The last token is resolved by
    :meth:`finish` once ``generate`` returns; steps transformers computed and then undid (its
    deferred stop check) are cut by the caller, which keeps only as many as tokens came back.
    """

    def __init__(self) -> None:
        self._pending: torch.Tensor | None = None
        self._resolved: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import torch

        if self._pending is not None:
            self._resolve(input_ids[:, -1])
        self._pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def _resolve(self, tokens: torch.Tensor) -> None:
        assert self._pending is not None
        self._resolved.append(self._pending.gather(1, tokens.view(-1, 1).to(self._pending.device)).squeeze(1))
        self._pending = None

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """``[rows, steps]`` float32 logprobs of ``new_tokens`` (the generated ``[rows, steps]`` ids)."""
        import torch

        steps = new_tokens.shape[1]
        if len(self._resolved) < steps and self._pending is not None:
            self._resolve(new_tokens[:, len(self._resolved)])
        if not self._resolved:
            return torch.zeros(new_tokens.shape, dtype=torch.float32)
        return torch.stack(self._resolved[:steps], dim=1).cpu()


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run with torch's generator for ``device`` seeded by ``seed``, restoring it on exit: the
    sampler draws from the global generator, and a colocated training worker's random state (saved
    in checkpoints) must not move because the engine sampled."""
    import torch

    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed(seed)
        yield
