"""vLLM ``SamplingParams`` from the core's sampling settings, and the engine's base seed.

Every request gets its own seed, derived from (base seed, engine, call counter, position in the
batch) by :func:`nrl_core.generation_kit.derive_seed`. A vLLM engine's sampling is then independent
of how requests were scheduled or batched, so two workers built from the same config produce
identical samples call after call, and a resumed run that restores the counter reproduces its
rollouts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nrl_core.api import SamplingSettings
from nrl_core.api import derive_seed as request_seed

__all__ = ["VllmSampling", "base_seed", "request_seed"]


def base_seed(config: Mapping[str, Any]) -> int:
    """``vllm_cfg.seed``, else ``policy.seed`` (which validation resolves from the algorithm's seed)."""
    policy = config["policy"]
    seed = (policy["generation"].get("vllm_cfg") or {}).get("seed")
    return int(policy["seed"] if seed is None else seed)


class VllmSampling(SamplingSettings):
    """The core's :class:`~nrl_core.generation_kit.SamplingSettings`, translated for vLLM."""

    def params(self, *, max_tokens: int, seed: int, greedy: bool) -> Any:
        """vLLM ``SamplingParams`` for one request; ``logprobs=0`` returns the sampled token's
        logprob under the distribution it was sampled from (the engine runs with
        ``logprobs_mode="processed_logprobs"``: after temperature, top-k and top-p; greedy
        requests report the unscaled distribution). vLLM spells "no top-k" ``top_k=0``."""
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            temperature=0.0 if greedy else self.temperature,
            top_p=1.0 if greedy else self.top_p,
            top_k=0 if greedy or self.top_k is None else self.top_k,
            max_tokens=max_tokens,
            stop_token_ids=list(self.stop_token_ids) or None,
            stop=list(self.stop_strings) or None,
            include_stop_str_in_output=True,
            logprobs=0,
            seed=seed,
            detokenize=bool(self.stop_strings),
        )
