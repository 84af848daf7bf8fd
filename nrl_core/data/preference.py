"""Preference pairs for DPO: NeMo RL's record formats, tokenization, the pair batch layout and the
arithmetic generator of the tiny CPU recipe.

Records come in NeMo RL's two shapes (its ``PreferenceDataset`` and ``BinaryPreferenceDataset``)::

    {"context": [{"role": "user", "content": "What is 2+2?"}],
     "completions": [{"rank": 0, "completion": [{"role": "assistant", "content": "4"}]},
                     {"rank": 1, "completion": [{"role": "assistant", "content": "5"}]}]}
    {"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"}

The lower rank is chosen; ties are refused, as in NeMo RL. A bad record is one line naming the
file, the line and the key. The prompt is the context as it is (``data.prompt_file`` and
``data.system_prompt_file`` are for prompt–answer data); with ``data.use_chat_template`` the
tokenizer's chat template renders it, and the completion tokens are what the template adds for the
completion's turns (:func:`~nrl_core.data.processors.response_tokens`, shared with SFT).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nrl_core.contracts import TokenBatch
from nrl_core.data.arithmetic import ArithmeticConfig, generate_arithmetic
from nrl_core.data.collate import sft_batch
from nrl_core.data.datasets import located_records
from nrl_core.data.processors import DatumSpec, _chat_text, response_tokens
from nrl_core.data.splits import load_data_splits
from nrl_core.errors import NrlError

if TYPE_CHECKING:
    from nrl_core.plugins import PluginManager

__all__ = ["PreferencePair", "PreparedPreferences", "arithmetic_preference_splits", "parse_preference",
           "preference_batch", "prepare_preference_data", "tokenize_preference"]

logger = logging.getLogger(__name__)

Messages = list[dict[str, str]]


@dataclass(kw_only=True)
class PreferencePair:
    """One tokenized preference example: the same prompt with the chosen and the rejected response
    (each a :class:`DatumSpec` whose ``token_mask`` covers its response)."""

    idx: int
    chosen: DatumSpec
    rejected: DatumSpec

    @property
    def length(self) -> int:
        return max(self.chosen.length, self.rejected.length)


# --------------------------------------------------------------------------- records


def _messages(value: Any, where: str, key: str) -> Messages:
    """``value`` as a list of chat messages: a string is one message of ``role`` user/assistant."""
    if isinstance(value, str):
        return [{"role": "user" if key in ("context", "prompt") else "assistant", "content": value}]
    if not isinstance(value, list) or not value:
        raise NrlError(f"{where}: '{key}' must be a non-empty list of {{'role', 'content'}} messages or a string, "
                       f"got {type(value).__name__}")
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise NrlError(f"{where}: '{key}[{i}]' must be a message with string 'role' and 'content', got {message!r:.80}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def parse_preference(record: Mapping[str, Any], where: str) -> tuple[Messages, Messages, Messages]:
    """``(context, chosen, rejected)`` messages of a record in either format of the module docstring."""
    if "completions" in record:
        if "context" not in record:
            raise NrlError(f"{where}: record has 'completions' but no 'context' (the prompt messages)")
        context = _messages(record["context"], where, "context")
        completions = record["completions"]
        if not isinstance(completions, list) or len(completions) != 2:
            count = len(completions) if isinstance(completions, list) else type(completions).__name__
            raise NrlError(f"{where}: 'completions' must be a list of exactly two ranked completions, got {count}")
        ranked = []
        for i, c in enumerate(completions):
            if not isinstance(c, dict) or "completion" not in c:
                raise NrlError(f"{where}: 'completions[{i}]' must be an object with 'rank' and 'completion'")
            rank = c.get("rank")
            if isinstance(rank, bool) or not isinstance(rank, (int, float)):
                raise NrlError(f"{where}: 'completions[{i}].rank' must be a number (lower is preferred), got {rank!r}")
            ranked.append((rank, _messages(c["completion"], where, f"completions[{i}].completion")))
        if ranked[0][0] == ranked[1][0]:
            raise NrlError(f"{where}: 'completions' ranks tie ({ranked[0][0]}); DPO needs a preferred completion, "
                           "drop ties from the data")
        (_, chosen), (_, rejected) = sorted(ranked, key=lambda rc: rc[0])
        return context, chosen, rejected
    if "chosen" in record or "rejected" in record:
        for key in ("prompt", "chosen", "rejected"):
            if record.get(key) is None:
                raise NrlError(f"{where}: binary preference record has no '{key}' (keys: {', '.join(sorted(record))})")
        return (_messages(record["prompt"], where, "prompt"), _messages(record["chosen"], where, "chosen"),
                _messages(record["rejected"], where, "rejected"))
    keys = ", ".join(sorted(record)) or "none"
    raise NrlError(f"{where}: not a preference record (keys: {keys}); expected NeMo RL's 'context' and "
                   "'completions', or 'prompt', 'chosen' and 'rejected'")


def tokenize_preference(idx: int, context: Messages, chosen: Messages, rejected: Messages, tokenizer: Any,
                        use_chat_template: bool) -> PreferencePair:
    if use_chat_template:
        prompt_text = _chat_text(tokenizer, context, add_generation_prompt=True)
        prompt_ids = list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
    else:
        prompt_text = "\n".join(m["content"] for m in context)
        prompt_ids = list(tokenizer(prompt_text, add_special_tokens=True)["input_ids"])

    def side(messages: Messages) -> DatumSpec:
        ids = response_tokens(tokenizer, context, prompt_text, messages, use_chat_template)
        return DatumSpec(idx=idx, prompt_text=prompt_text, prompt_ids=prompt_ids, response_ids=ids,
                         response_text="".join(m["content"] for m in messages))

    return PreferencePair(idx=idx, chosen=side(chosen), rejected=side(rejected))


@dataclass(frozen=True)
class PreparedPreferences:
    train: list[PreferencePair]
    val: list[PreferencePair] | None


_SHOWN = 3


def _tokenize_all(records: Sequence[Mapping[str, Any]], where: Sequence[str] | None, source: str, tokenizer: Any,
                  data_cfg: Mapping[str, Any], max_length: int) -> list[PreferencePair]:
    """Pairs whose prompt fits ``data.max_input_seq_length`` and whose longer side fits
    ``max_length``; the others are dropped with one warning (NeMo RL masks them out instead: the
    same training signal, without their compute)."""
    places = list(where) if where is not None else [f"{source} index {i}" for i in range(len(records))]
    max_prompt = data_cfg.get("max_input_seq_length")
    out, dropped = [], []
    for idx, (record, place) in enumerate(zip(records, places)):
        pair = tokenize_preference(idx, *parse_preference(record, place), tokenizer,
                                   bool(data_cfg.get("use_chat_template", True)))
        if pair.length > max_length or (max_prompt is not None and len(pair.chosen.prompt_ids) > max_prompt):
            dropped.append(f"{place} ({pair.length} tokens)")
            continue
        out.append(pair)
    if dropped:
        more = f" and {len(dropped) - _SHOWN} more" if len(dropped) > _SHOWN else ""
        logger.warning("dropped %d of %d preference pairs of %s longer than policy.max_total_sequence_length=%d "
                       "(or a prompt over data.max_input_seq_length): %s%s", len(dropped), len(records), source,
                       max_length, ", ".join(dropped[:_SHOWN]), more)
    if not out:
        raise NrlError(f"all {len(records)} preference pairs of {source} are longer than "
                       f"policy.max_total_sequence_length={max_length}; raise it or shorten the data")
    return out


def prepare_preference_data(data_cfg: Mapping[str, Any], tokenizer: Any, plugins: PluginManager, *,
                            max_length: int) -> PreparedPreferences:
    """Train (and validation) pairs for the validated ``data`` section: local files
    (``train_data_path``, ``val_data_path``) or a generator (``dataset_name``), as for SFT."""
    splits = load_data_splits(data_cfg, plugins, read=lambda path: located_records(path, needs="a preference pair"),
                              kind="preference")
    train = _tokenize_all(splits.train, splits.train_where, splits.source, tokenizer, data_cfg, max_length)
    val = (_tokenize_all(splits.val, splits.val_where, f"{splits.source} (validation)", tokenizer, data_cfg, max_length)
           if splits.val else None)
    return PreparedPreferences(train=train, val=val)


# --------------------------------------------------------------------------- the batch


def preference_batch(pairs: Sequence[PreferencePair], pad_token_id: int, data_parallel_size: int = 1) -> TokenBatch:
    """The pairs as one ``TokenBatch`` of ``2 x len(pairs)`` sequences that every training backend
    splits without separating a pair.

    A backend gives data-parallel rank ``r`` the rows :meth:`TokenBatch.shard_rows` names and cuts
    them into consecutive micro-batches; rows are placed so that each rank's rows read chosen,
    rejected, chosen, rejected..., so any even micro-batch size keeps pairs whole. Per-sequence
    fields: ``chosen`` (1 or 0), ``pair`` (the pair's index in ``pairs``, for the loss's check) and
    ``sample_mask`` (0 on the copies of the first pair that pad the batch to a multiple of
    ``data_parallel_size`` pairs). Per-token: ``token_mask`` on the responses.
    """
    import torch

    pairs = list(pairs)
    real = len(pairs)
    while len(pairs) % data_parallel_size:
        pairs.append(pairs[0])
    size, per_rank = 2 * len(pairs), len(pairs) // data_parallel_size
    layout = TokenBatch(input_ids=torch.zeros((size, 0), dtype=torch.long), input_lengths=torch.zeros(size))
    order: list[tuple[int, bool]] = [(0, True)] * size  # row -> (pair, chosen)
    for rank in range(data_parallel_size):
        rows = layout.shard_rows(rank, data_parallel_size)
        for j in range(per_rank):
            pair = rank * per_rank + j
            order[rows[2 * j]], order[rows[2 * j + 1]] = (pair, True), (pair, False)
    data = [pairs[p].chosen if chosen else pairs[p].rejected for p, chosen in order]
    batch = sft_batch(data, pad_token_id)
    batch.fields["chosen"] = torch.tensor([float(chosen) for _, chosen in order])
    batch.fields["pair"] = torch.tensor([p for p, _ in order], dtype=torch.long)
    batch.fields["sample_mask"] = torch.tensor([float(p < real) for p, _ in order])
    return batch


def pair_order(batch: TokenBatch) -> list[int]:
    """The rows of a :func:`preference_batch` as (chosen, rejected) of pair 0, then pair 1, ...:
    the order a loss computed over the whole batch on the driver reads (the batch itself is laid
    out for its data-parallel shards)."""
    pair, chosen = batch.fields["pair"].tolist(), batch.fields["chosen"].tolist()
    return sorted(range(batch.size), key=lambda row: (pair[row], -chosen[row]))


def check_pairs(batch: TokenBatch, who: str) -> None:
    """Refuse, in one line, a micro-batch whose rows are not (chosen, rejected) pairs of
    :func:`preference_batch`: a backend that reorders or splits rows (dynamic batching, sequence
    packing) would otherwise pair unrelated sequences silently. ``who`` names the loss."""
    from nrl_core.errors import NrlError

    chosen, pair = batch.fields["chosen"], batch.fields["pair"]
    whole = batch.size % 2 == 0 and bool((chosen[0::2] == 1).all()) and bool((chosen[1::2] == 0).all()) \
        and bool((pair[0::2] == pair[1::2]).all())
    if not whole:
        raise NrlError(f"{who} got a micro-batch of {batch.size} sequences that are not (chosen, rejected) pairs "
                       f"(pairs {pair.tolist()[:8]}); the training backend split or reordered them: {who} needs "
                       "fixed micro-batches (policy.dynamic_batching and policy.sequence_packing disabled)")


# --------------------------------------------------------------------------- generator


DISTRACTORS = ("offset", "operand")


def arithmetic_preference_splits(distractor: str = "offset", max_offset: int = 5,
                                 **kwargs: Any) -> tuple[list[dict], list[dict]]:
    """The ``data.dataset_name: arithmetic_preference`` generator: the arithmetic problems of
    ``data.generate`` (:class:`~nrl_core.data.arithmetic.ArithmeticConfig` fields) as NeMo RL
    preference records, the right answer chosen over a wrong one (seeded): ``offset``, off by 1 to
    ``max_offset``; ``operand``, one of the problem's operands, the copying mistake a model that
    cannot do arithmetic yet makes (a randomly initialised model learns to avoid it in a few
    dozen CPU steps, while telling 19 from 21 needs arithmetic first)."""
    from nrl_core.errors import ConfigError

    if distractor not in DISTRACTORS:
        raise ConfigError("data.generate.distractor", f"must be one of {', '.join(DISTRACTORS)}, got {distractor!r}")
    if max_offset < 1:
        raise ConfigError("data.generate.max_offset", f"must be >= 1, got {max_offset}")
    if "ops" in kwargs:
        kwargs["ops"] = tuple(kwargs["ops"])
    cfg = ArithmeticConfig(**kwargs)
    rng = random.Random(cfg.seed + 1)

    def record(problem: dict[str, str]) -> dict[str, Any]:
        answer = int(problem["expected_answer"])
        operands = [int(t) for t in problem["problem"].rstrip("?").split()[2::2]]  # "What is a op b?"
        wrong_operands = [n for n in operands if n != answer]
        if distractor == "operand" and wrong_operands:
            wrong = rng.choice(wrong_operands)
        else:
            wrong = answer + rng.choice([-1, 1]) * rng.randint(1, max_offset)
        return {"context": [{"role": "user", "content": problem["problem"]}],
                "completions": [{"rank": 0, "completion": [{"role": "assistant", "content": str(answer)}]},
                                {"rank": 1, "completion": [{"role": "assistant", "content": str(wrong)}]}]}

    train, val = generate_arithmetic(cfg)
    return [record(p) for p in train], [record(p) for p in val]
