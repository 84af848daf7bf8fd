"""One function per NeMo RL dataset: a source row (the hub dataset's columns) to nrl's record.

Prompt records carry ``problem`` (the user's text, before the prompt template) and
``expected_answer`` (what NeMo RL's processors pass on as ``ground_truth``), and chats also
``messages`` (what NeMo RL's ``sft_processor`` tokenizes); preference records
are NeMo RL's ``{"context", "completions"}`` pairs. Which columns each dataset reads is NeMo RL's
choice at commit 7ea279a (``nemo_rl/data/datasets/response_datasets/`` and
``preference_datasets/``), restated here from its behaviour; docs/data.md has the table.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

Row = Mapping[str, Any]
Record = dict[str, Any]
Messages = list[dict[str, str]]


def _prompt(problem: Any, answer: Any) -> Record:
    """A prompt record; an answer the source lacks stays None, as NeMo RL passes it on."""
    return {"problem": str(problem), "expected_answer": None if answer is None else str(answer)}


def open_math_instruct_2(row: Row, entry: Row) -> Record:
    """The problem; the answer is the ``output_key`` column (``expected_answer``; SFT recipes
    name ``generated_solution``)."""
    return _prompt(row["problem"], row[entry.get("output_key") or "expected_answer"])


def dapo_math(row: Row, entry: Row) -> Record:
    """DAPO's prompt is a chat whose first message already holds the instructions; the answer is
    the reward model's ground truth."""
    return _prompt(row["prompt"][0]["content"], row["reward_model"]["ground_truth"])


def aime(row: Row, entry: Row) -> Record:
    """AIME 2024 and 2026 name the problem ``problem``, 2025 ``question``; answers can be integers."""
    return _prompt(row["problem"] if "problem" in row else row["question"], row["answer"])


def gsm8k(row: Row, entry: Row) -> Record:
    """The question; the answer is the number after ``####`` (``extract_answer``, the default) or
    the whole solution. A solution without ``####`` has no answer, as in NeMo RL."""
    answer = row["answer"]
    if entry.get("extract_answer") is not False:
        answer = answer.split("####", 1)[1].strip() if "####" in answer else None
    return _prompt(row["question"], answer)


def problem_and_answer(row: Row, entry: Row) -> Record:
    """Columns ``problem`` and ``answer`` (DeepScaleR, OpenR1-Math-220k)."""
    return _prompt(row["problem"], row["answer"])


def response_dataset(row: Row, entry: Row) -> Record:
    """A chat (``messages``: the first message is the prompt, the second the answer), or the
    ``input_key`` and ``output_key`` columns (NeMo RL's defaults: ``input`` and ``output``)."""
    messages = row.get("messages")
    if messages:
        chat = [{"role": m["role"], "content": m["content"]} for m in messages]
        return {**_prompt(chat[0]["content"], chat[1]["content"] if len(chat) > 1 else None), "messages": chat}
    return _prompt(row[entry.get("input_key") or "input"], row[entry.get("output_key") or "output"])


def _chat(messages: Messages) -> Record:
    """A conversation, with its first user turn and its last turn as the prompt and the answer."""
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("the conversation does not end with the assistant's turn")
    problem = next((m["content"] for m in messages if m["role"] == "user"), "")
    return {**_prompt(problem, messages[-1]["content"]), "messages": messages}


def squad(row: Row, entry: Row) -> Record:
    """The passage as the system turn, the question as the user's, the first answer as the assistant's."""
    return _chat([{"role": "system", "content": row["context"]}, {"role": "user", "content": row["question"]},
                  {"role": "assistant", "content": row["answers"]["text"][0]}])


def tulu3_sft(row: Row, entry: Row) -> Record:
    """The ``messages`` conversation as it is (Tulu 3's SFT mixture, Nemotron-Cascade 2's)."""
    return _chat([{"role": m["role"], "content": m["content"]} for m in row["messages"]])


def _as_messages(value: Any, role: str) -> Messages:
    return [dict(m) for m in value] if isinstance(value, list) else [{"role": role, "content": str(value)}]


def _pair(context: Messages, chosen: str, rejected: str) -> Record:
    """NeMo RL's pair form: the lower rank is the chosen completion."""
    return {"context": context,
            "completions": [{"rank": 0, "completion": [{"role": "assistant", "content": chosen}]},
                            {"rank": 1, "completion": [{"role": "assistant", "content": rejected}]}]}


def helpsteer3(row: Row, entry: Row) -> Record:
    """``overall_preference`` below 0 prefers ``response1``, above 0 ``response2``; at 0 NeMo RL
    keeps the row with ``response1`` on both sides (and warns), and so does this."""
    preference = row["overall_preference"]
    first, second = row["response1"], row["response2"]
    if preference == 0:
        logger.warning("HelpSteer3: a row without preference keeps response1 as both chosen and rejected, "
                       "as in NeMo RL")
        chosen, rejected = first, first
    else:
        chosen, rejected = (first, second) if preference < 0 else (second, first)
    return _pair(_as_messages(row["context"], "user"), chosen, rejected)


def tulu3_preference(row: Row, entry: Row) -> Record:
    """Both conversations share every turn but the last, the assistant's: that turn is the choice."""
    chosen, rejected = list(row["chosen"]), list(row["rejected"])
    if [dict(m) for m in chosen[:-1]] != [dict(m) for m in rejected[:-1]]:
        raise ValueError("the chosen and rejected conversations differ before their last turn")
    if chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant":
        raise ValueError("the last turn of a conversation is not the assistant's")
    return _pair([dict(m) for m in chosen[:-1]], chosen[-1]["content"], rejected[-1]["content"])


def preference_dataset(row: Row, entry: Row) -> Record:
    """Rows already in NeMo RL's pair form (``context`` and ranked ``completions``)."""
    return {"context": row["context"], "completions": row["completions"]}


def binary_preference(row: Row, entry: Row) -> Record:
    """A prompt (text or chat) with a chosen and a rejected answer, under configurable column names."""
    prompt = row[entry.get("prompt_key") or "prompt"]
    return _pair(_as_messages(prompt, "user"), str(row[entry.get("chosen_key") or "chosen"]),
                 str(row[entry.get("rejected_key") or "rejected"]))
