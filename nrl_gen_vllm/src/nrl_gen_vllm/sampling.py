"""Sampling settings from ``policy.generation`` and reproducible per-request seeds.

Every request gets its own seed, derived from (base seed, worker rank, call counter, position in
the batch). A vLLM engine's sampling is then independent of how requests were scheduled or
batched, so two workers built from the same config produce identical samples call after call,
and a resumed run that restores the counter reproduces its rollouts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping


def request_seed(base: int, rank: int, call: int, index: int) -> int:
    """A well-mixed 63-bit seed for one request (hash, so neighbouring inputs do not correlate)."""
    digest = hashlib.blake2b(f"{base}:{rank}:{call}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def base_seed(config: Mapping[str, Any]) -> int:
    """``vllm_cfg.seed``, else ``policy.seed`` (which validation resolves from the algorithm's seed)."""
    policy = config["policy"]
    seed = (policy["generation"].get("vllm_cfg") or {}).get("seed")
    return int(policy["seed"] if seed is None else seed)


@dataclass(frozen=True)
class SamplingSettings:
    """The ``policy.generation`` keys that shape every request."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int | None
    stop_token_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]

    @classmethod
    def from_config(cls, generation: Mapping[str, Any]) -> "SamplingSettings":
        return cls(
            max_new_tokens=int(generation.get("max_new_tokens") or 512),
            temperature=float(generation["temperature"]),
            top_p=float(generation.get("top_p") if generation.get("top_p") is not None else 1.0),
            top_k=generation.get("top_k"),
            stop_token_ids=tuple(generation.get("stop_token_ids") or ()),
            stop_strings=tuple(generation.get("stop_strings") or ()),
        )

    def params(self, *, max_tokens: int, seed: int, greedy: bool) -> Any:
        """vLLM ``SamplingParams`` for one request; ``logprobs=0`` returns the sampled token's
        logprob under the distribution it was sampled from (the engine runs with
        ``logprobs_mode="processed_logprobs"``: after temperature, top-k and top-p; greedy
        requests report the unscaled distribution)."""
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            temperature=0.0 if greedy else self.temperature,
            top_p=1.0 if greedy else self.top_p,
            top_k=0 if greedy or not self.top_k or self.top_k < 0 else int(self.top_k),
            max_tokens=max_tokens,
            stop_token_ids=list(self.stop_token_ids) or None,
            stop=list(self.stop_strings) or None,
            include_stop_str_in_output=True,
            logprobs=0,
            seed=seed,
            detokenize=bool(self.stop_strings),
        )
