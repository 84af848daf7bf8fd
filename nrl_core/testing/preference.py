"""Random preference pairs for tests of models that learn from them (DPO, reward models)."""

from __future__ import annotations

import torch

from nrl_core.data import DatumSpec
from nrl_core.data.preference import PreferencePair


def random_pairs(count: int, seed: int = 0, vocab: int = 500) -> list[PreferencePair]:
    """``count`` pairs of random token ids (prompts of 2-5 tokens, responses of 1-5), seeded."""
    g = torch.Generator().manual_seed(seed)

    def ids(low: int, high: int) -> list[int]:
        return torch.randint(4, vocab, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()

    def datum(i: int) -> DatumSpec:
        return DatumSpec(idx=i, prompt_text="", prompt_ids=ids(2, 6), response_ids=ids(1, 6))

    return [PreferencePair(idx=i, chosen=datum(i), rejected=datum(i)) for i in range(count)]
