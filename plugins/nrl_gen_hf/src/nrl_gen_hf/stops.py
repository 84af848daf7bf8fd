"""Where each generated sequence ends, and why.

``generate`` decodes a batch until every row is done and keeps filling finished rows; the engine
reports a row up to and including its first stop token, or the token that completed a stop string
(vLLM's ``include_stop_str_in_output``), and says ``"stop"``; a row that ran to its token budget
says ``"length"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from nrl_core.api import stop_string_end


def cut(tokens: Sequence[int], stop_ids: frozenset[int], stop_strings: Sequence[str],
        decode: Callable[[list[int]], str] | None, budget: int) -> tuple[list[int], str]:
    """``(tokens kept, finish reason)`` for one row of ``generate``'s output."""
    row = list(tokens[:budget])
    end = next((i + 1 for i, token in enumerate(row) if token in stop_ids), None)
    if stop_strings and decode is not None:
        text_end = stop_string_end(row[:end] if end else row, stop_strings, decode)
        if text_end is not None:
            end = text_end
    if end is not None:
        return row[:end], "stop"
    return row, "length"


def stop_token_ids(generation_config: Any, extra: Sequence[int]) -> list[int]:
    """The model's end-of-sequence ids (its generation config, as HF ``generate`` stops on them)
    followed by ``policy.generation.stop_token_ids``, without repeats."""
    eos = generation_config.eos_token_id
    ids = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
    return list(dict.fromkeys([int(t) for t in ids] + [int(t) for t in extra]))
