"""NeMo RL's prompt processors, so a recipe's prompts are the token ids NeMo RL would give its engine.

All three fill the prompt file with Python's ``str.format`` (``{}`` takes the problem, ``{{}}`` is a
literal ``{}``), read the files as written, and render with the tokenizer's chat template,
without adding special tokens beyond what the template writes. They differ in the system prompt:
``math_hf_data_processor`` (NeMo RL's default) renders system and user turns in one conversation;
``math_data_processor`` renders the system turn and the user turn each on its own and joins them;
``sft_processor`` tokenizes a whole conversation turn by turn for SFT. The math processors read a
record's ``problem`` (for a chat: its first user turn) and pass ``expected_answer`` on as the
ground truth.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nrl_core.api import ConfigError, DatumSpec, NrlError, PromptConfig


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("data.default.processor", "NeMo RL's math processors render with the tokenizer's chat "
                                                    "template and this tokenizer has none; set "
                                                    "policy.tokenizer.chat_template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _user_text(problem: str, cfg: PromptConfig) -> str:
    template = cfg.template_file_text if cfg.template_file_text is not None else cfg.template
    return template.format(problem) if template is not None else problem


def _system_text(cfg: PromptConfig) -> str | None:
    return cfg.system_prompt_file_text if cfg.system_prompt_file_text is not None else cfg.system_prompt


def _datum(idx: int, record: Mapping[str, Any], cfg: PromptConfig, text: str, ids: list[int]) -> DatumSpec:
    answer = record.get(cfg.output_key)
    return DatumSpec(idx=idx, prompt_text=text, prompt_ids=ids,
                     metadata={"ground_truth": None if answer is None else str(answer)})


def math_hf_data_processor(record: Mapping[str, Any], idx: int, tokenizer: Any, cfg: PromptConfig) -> DatumSpec:
    """The system prompt (when set) and the templated problem as one conversation, with the
    generation prompt."""
    system = _system_text(cfg)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": _user_text(str(record[cfg.input_key]), cfg)}]
    text = _render(tokenizer, messages, add_generation_prompt=True)
    return _datum(idx, record, cfg, text, list(tokenizer(text, add_special_tokens=False)["input_ids"]))


def math_data_processor(record: Mapping[str, Any], idx: int, tokenizer: Any, cfg: PromptConfig) -> DatumSpec:
    """The system turn rendered alone (when set), then the templated problem rendered alone with
    the generation prompt."""
    system = _system_text(cfg)
    parts = [_render(tokenizer, [{"role": "system", "content": system}], add_generation_prompt=False)] if system else []
    parts.append(_render(tokenizer, [{"role": "user", "content": _user_text(str(record[cfg.input_key]), cfg)}],
                         add_generation_prompt=True))
    ids = [i for part in parts for i in tokenizer(part, add_special_tokens=False)["input_ids"]]
    return _datum(idx, record, cfg, "".join(parts), ids)


def _conversation(record: Mapping[str, Any], cfg: PromptConfig) -> list[dict[str, str]]:
    """The record's chat (``messages``), or its prompt and answer as one user and one assistant turn."""
    messages = record.get("messages")
    if messages:
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    return [{"role": "user", "content": str(record[cfg.input_key])},
            {"role": "assistant", "content": str(record[cfg.output_key])}]


def _common_prefix(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def sft_processor(record: Mapping[str, Any], idx: int, tokenizer: Any, cfg: PromptConfig) -> DatumSpec:
    """A conversation to learn its assistant turns, tokenized turn by turn as NeMo RL does.

    The prompt file fills the first user turn (the system prompt file is not used: a system turn
    comes from the data). Turn ``i``'s text is what rendering the first ``i + 1`` turns adds after
    the point where it departs from rendering the first ``i`` (user and tool turns carry the
    generation prompt when ``add_generation_prompt``); the first turn starts with BOS and the last
    ends with EOS when asked and not already there. Everything before the first assistant turn is
    the prompt; after it, assistant turns count in the loss and the others do not.
    """
    turns = _conversation(record, cfg)
    template = cfg.template_file_text if cfg.template_file_text is not None else cfg.template
    if template is not None:
        first_user = next((i for i, t in enumerate(turns) if t["role"] == "user"), None)
        if first_user is not None:
            turns[first_user] = {"role": "user", "content": template.format(turns[first_user]["content"])}
    if not any(t["role"] == "assistant" for t in turns):
        raise NrlError(f"record {idx}: the conversation has no assistant turn for sft_processor to learn; "
                       "give every conversation one, or drop this record")
    chunks: list[tuple[str, str]] = []
    previous = ""
    for i, turn in enumerate(turns):
        rendered = _render(tokenizer, turns[: i + 1],
                           add_generation_prompt=cfg.add_generation_prompt and turn["role"] in ("user", "tool"))
        chunk = rendered[_common_prefix(previous, rendered):]
        previous = rendered
        bos, eos = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "eos_token", None)
        if i == 0 and cfg.add_bos and bos and not chunk.startswith(bos):
            chunk = bos + chunk
        if i == len(turns) - 1 and cfg.add_eos and eos and not chunk.rstrip("\n").endswith(eos):
            chunk += eos
        chunks.append((turn["role"], chunk))
    start = next(i for i, (role, _) in enumerate(chunks) if role == "assistant")
    ids = [list(tokenizer(chunk, add_special_tokens=False)["input_ids"]) for _, chunk in chunks]
    prompt_ids = [t for part in ids[:start] for t in part]
    response_ids = [t for part in ids[start:] for t in part]
    mask = [int(role == "assistant") for (role, _), part in zip(chunks[start:], ids[start:]) for _ in part]
    answer = "".join(t["content"] for t in turns[start:] if t["role"] == "assistant")
    return DatumSpec(idx=idx, prompt_text="".join(c for _, c in chunks[:start]), prompt_ids=prompt_ids,
                     metadata={"ground_truth": answer}, response_text="".join(c for _, c in chunks[start:]),
                     response_ids=response_ids, response_mask=mask)
