"""Turning records into tokenized prompts (GRPO) and prompt–response pairs (SFT).

A *processor* maps one record to a :class:`DatumSpec`; processors are chosen by name
(``data.processor``) from a small registry, ``math`` for prompt–answer problems and ``sft`` for
prompt–response pairs. The prompt text is built the same way for both, so a model warm-started
with SFT sees exactly the prompts GRPO will give it:

1. the record's ``input_key`` is put into the prompt template (``data.prompt_file``, a text file
   with one ``{}`` placeholder, NeMo RL's ``cot.txt`` style), or used as it is;
2. an optional system prompt (``data.system_prompt_file``) comes first;
3. with ``data.use_chat_template`` the tokenizer's chat template renders them as a conversation
   with the generation prompt appended; otherwise the text is tokenized as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nrl_core.errors import ConfigError, NrlError
from nrl_core.plugin_faults import PluginOwner, call_plugin, plugin_answer_error

if TYPE_CHECKING:
    from nrl_core.plugins import PluginManager

__all__ = ["DatumSpec", "LengthLimits", "PreparedData", "PromptConfig", "Processor", "build_prompt", "get_processor",
           "math_processor", "prepare_data", "process_records", "response_tokens", "sft_processor"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class DatumSpec:
    """One tokenized example.

    ``prompt_ids`` are what a generation engine is given; ``metadata`` is handed to the
    environment with the response (``{"ground_truth": "19"}`` for math). SFT examples also carry
    ``response_ids`` (ending with the end-of-sequence token when the template emits one);
    ``input_ids`` and ``token_mask`` are then the full sequence and its response-only loss mask.
    """

    idx: int
    prompt_text: str
    prompt_ids: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)
    response_text: str = ""
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] | None = None  # per response token; None: all 1 (0: e.g. a tool's result)

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def token_mask(self) -> list[int]:
        """1 on response tokens the SFT loss counts (all of them, or where ``response_mask``
        says), 0 on prompt tokens."""
        mask = self.response_mask if self.response_mask is not None else [1] * len(self.response_ids)
        if len(mask) != len(self.response_ids):
            raise ValueError(f"datum {self.idx}: response_mask has {len(mask)} entries for "
                             f"{len(self.response_ids)} response tokens")
        return [0] * len(self.prompt_ids) + list(mask)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(frozen=True, kw_only=True)
class PromptConfig:
    """How records become prompts: the ``data`` section's prompt settings, files already read.

    ``template`` and ``system_prompt`` drop the files' trailing newlines; ``*_file_text`` keep the
    files as written, for processors that reproduce another framework's prompts byte for byte.
    ``add_bos``, ``add_eos`` and ``add_generation_prompt`` are NeMo RL's switches of its
    ``sft_processor`` (nrl-data-nemo-rl)."""

    input_key: str = "problem"
    output_key: str = "expected_answer"
    template: str | None = None
    system_prompt: str | None = None
    use_chat_template: bool = True
    max_input_seq_length: int | None = None
    template_file_text: str | None = None
    system_prompt_file_text: str | None = None
    add_bos: bool = True
    add_eos: bool = True
    add_generation_prompt: bool = False

    def __post_init__(self) -> None:
        if self.template is not None and "{}" not in self.template:
            raise ConfigError("data.prompt_file", "the prompt template has no '{}' placeholder for the problem; add one")
        if self.max_input_seq_length is not None and self.max_input_seq_length < 1:
            raise ConfigError("data.max_input_seq_length", f"must be >= 1, got {self.max_input_seq_length}")

    @classmethod
    def from_data_config(cls, data_cfg: Mapping[str, Any]) -> PromptConfig:
        """Build from the validated ``data`` section, reading ``prompt_file`` and ``system_prompt_file``."""
        template = _read_text(data_cfg.get("prompt_file"), "data.prompt_file")
        system_prompt = _read_text(data_cfg.get("system_prompt_file"), "data.system_prompt_file")
        return cls(
            input_key=data_cfg.get("input_key") or "problem",
            output_key=data_cfg.get("output_key") or "expected_answer",
            template=None if template is None else template.rstrip("\n"),
            system_prompt=None if system_prompt is None else system_prompt.rstrip("\n"),
            use_chat_template=bool(data_cfg.get("use_chat_template", True)),
            max_input_seq_length=data_cfg.get("max_input_seq_length"),
            template_file_text=template,
            system_prompt_file_text=system_prompt,
            add_bos=bool(data_cfg.get("add_bos", True)),
            add_eos=bool(data_cfg.get("add_eos", True)),
            add_generation_prompt=bool(data_cfg.get("add_generation_prompt", False)),
        )

    def user_content(self, problem: str) -> str:
        # str.replace, not str.format: templates (and problems) may contain other braces, e.g. LaTeX.
        return self.template.replace("{}", problem, 1) if self.template is not None else problem


def _read_text(path: str | None, key_path: str) -> str | None:
    if not path:
        return None
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(key_path, f"cannot read '{p}' ({exc.strerror}); fix the path or set it to null") from None
    return text


def _messages(problem: str, cfg: PromptConfig) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    return messages + [{"role": "user", "content": cfg.user_content(problem)}]


def _chat_text(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("data.use_chat_template", "the tokenizer has no chat template; set "
                                                    "data.use_chat_template: false or policy.tokenizer.chat_template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def build_prompt(problem: str, tokenizer: Any, cfg: PromptConfig) -> tuple[str, list[int]]:
    """The prompt text and token ids for ``problem`` (steps 1–3 of the module docstring)."""
    if cfg.use_chat_template:
        text = _chat_text(tokenizer, _messages(problem, cfg), add_generation_prompt=True)
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = cfg.user_content(problem)
    if cfg.system_prompt:
        text = f"{cfg.system_prompt}\n{text}"
    return text, list(tokenizer(text, add_special_tokens=True)["input_ids"])


Processor = Callable[[Mapping[str, Any], int, Any, PromptConfig], DatumSpec]
"""``(record, index, tokenizer, prompt_config) -> DatumSpec``."""

def get_processor(name: str, plugins: PluginManager) -> Processor:
    """The processor registered as ``name`` (``nrl_data_processors``; the core's ``math`` and
    ``sft`` among them); a miss lists the installed ones."""
    return _registered_processor(name, plugins)[0]


def _registered_processor(name: str, plugins: PluginManager) -> tuple[Processor, PluginOwner]:
    from nrl_core.contracts import import_object

    registry = plugins.data_processors()
    return import_object(registry.get(name, "data.processor").processor), registry.plugin_owner(name)


def _processed(fn: Processor, owner: PluginOwner, record: Mapping[str, Any], idx: int, tokenizer: Any,
               cfg: PromptConfig, location: str) -> DatumSpec:
    """One record through the processor plugin: what it raises, or a result that is not a
    ``DatumSpec``, is one line naming it and the record (an ``NrlError`` is its own message). The
    run has no log directory yet, so the traceback shows only with ``NRL_DEBUG=1``."""
    name = getattr(fn, "__qualname__", type(fn).__name__)
    datum = call_plugin(owner, f"{name} on {location}", None, fn, record, idx, tokenizer, cfg)
    if not isinstance(datum, DatumSpec):
        raise plugin_answer_error(owner, name, f"returned {type(datum).__name__} for {location}; it must return a "
                                               f"DatumSpec")
    return datum


def math_processor(record: Mapping[str, Any], idx: int, tokenizer: Any, cfg: PromptConfig) -> DatumSpec:
    """A prompt for the math environment: ``metadata["ground_truth"]`` is the ``output_key`` value."""
    text, ids = build_prompt(str(record[cfg.input_key]), tokenizer, cfg)
    return DatumSpec(idx=idx, prompt_text=text, prompt_ids=ids,
                     metadata={"ground_truth": str(record[cfg.output_key])})


def response_tokens(tokenizer: Any, prompt_messages: list[dict[str, str]], prompt_text: str,
                    response_messages: list[dict[str, str]], use_chat_template: bool) -> list[int]:
    """The tokens a model must produce after ``prompt_text`` to give ``response_messages``.

    With a chat template: what the template adds after the generation prompt for those turns, up to
    and including the last end-of-sequence token (what a template writes after the turn ends is
    dropped); without one (or when the template does not extend the prompt): the responses' text
    followed by the end-of-sequence token.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if use_chat_template:
        full = _chat_text(tokenizer, prompt_messages + response_messages, add_generation_prompt=False)
        if full.startswith(prompt_text):
            ids = list(tokenizer(full[len(prompt_text):], add_special_tokens=False)["input_ids"])
            if eos is not None and eos in ids:
                ids = ids[: len(ids) - ids[::-1].index(eos)]
            return ids
    ids = list(tokenizer("".join(m["content"] for m in response_messages), add_special_tokens=False)["input_ids"])
    return ids + ([eos] if eos is not None else [])


def sft_processor(record: Mapping[str, Any], idx: int, tokenizer: Any, cfg: PromptConfig) -> DatumSpec:
    """A prompt and the response to learn (``output_key``), masked so only the response counts
    (its tokens: :func:`response_tokens`)."""
    problem, response = str(record[cfg.input_key]), str(record[cfg.output_key])
    prompt_text, prompt_ids = build_prompt(problem, tokenizer, cfg)
    response_ids = response_tokens(tokenizer, _messages(problem, cfg), prompt_text,
                                   [{"role": "assistant", "content": response}], cfg.use_chat_template)
    return DatumSpec(idx=idx, prompt_text=prompt_text, prompt_ids=prompt_ids,
                     metadata={"ground_truth": response},
                     response_text=response, response_ids=response_ids)


@dataclass(frozen=True)
class LengthLimits:
    """Token limits an example must fit, each with the config key that sets it (for messages).

    ``prompt``: the longest prompt kept (GRPO: one less than the sequence limit, so the engine has
    room to generate at least one token); ``total``: prompt plus response (SFT), longer responses
    are cut, an example whose prompt alone reaches it is dropped.
    """

    prompt: int | None = None
    prompt_key: str = "policy.max_total_sequence_length"
    total: int | None = None
    total_key: str = "policy.max_total_sequence_length"


_SHOWN = 3  # dropped examples named in a warning


def process_records(records: Sequence[Mapping[str, Any]], tokenizer: Any, cfg: PromptConfig,
                    processor: str = "math", *, plugins: PluginManager, max_length: int | None = None,
                    limits: LengthLimits | None = None, where: Sequence[str] | None = None,
                    source: str = "the data") -> list[DatumSpec]:
    """Every record through the named processor (of ``plugins``), keeping only what fits.

    A prompt longer than ``cfg.max_input_seq_length`` or ``limits.prompt`` is dropped (a truncated
    problem is a different problem); an SFT example longer than ``limits.total`` (or
    ``max_length``, its short form) has its response truncated, or is dropped when its prompt alone
    does not fit. Drops are one warning per limit: the count, the config key, and where the first
    ones are (``where[i]`` for record ``i``, e.g. ``file:line``; else their index). Dropping
    everything is an error.
    """
    limits = limits or LengthLimits(total=max_length)
    fn, owner = _registered_processor(processor, plugins)
    out: list[DatumSpec] = []
    dropped: dict[str, list[str]] = {}  # "<key>=<limit>" -> where each dropped example is
    for idx, record in enumerate(records):
        location = where[idx] if where is not None else f"{source} index {idx}"
        datum = _processed(fn, owner, record, idx, tokenizer, cfg, location)
        reason = _too_long(datum, cfg, limits)
        if reason is not None:
            dropped.setdefault(reason, []).append(f"{location} ({len(datum.prompt_ids)} prompt tokens)")
            continue
        if limits.total is not None and datum.length > limits.total:
            keep = limits.total - len(datum.prompt_ids)
            datum.response_ids = datum.response_ids[:keep]
            if datum.response_mask is not None:
                datum.response_mask = datum.response_mask[:keep]
        out.append(datum)
    for reason, places in dropped.items():
        more = f" and {len(places) - _SHOWN} more" if len(places) > _SHOWN else ""
        logger.warning("dropped %d of %d examples of %s whose prompt is too long for %s: %s%s",
                       len(places), len(records), source, reason, ", ".join(places[:_SHOWN]), more)
    if not out:
        reasons = " or ".join(dropped)
        raise NrlError(f"all {len(records)} examples of {source} have prompts too long for {reasons}; "
                       f"raise the limit or shorten the prompts (or the prompt template)")
    return out


def _too_long(datum: DatumSpec, cfg: PromptConfig, limits: LengthLimits) -> str | None:
    """The limit (``key=value``) the example's prompt exceeds, or None when it fits."""
    n = len(datum.prompt_ids)
    if cfg.max_input_seq_length is not None and n > cfg.max_input_seq_length:
        return f"data.max_input_seq_length={cfg.max_input_seq_length}"
    if limits.prompt is not None and n > limits.prompt:
        return f"{limits.prompt_key}={limits.prompt + 1} (no room to generate)"
    if limits.total is not None and n >= limits.total:
        return f"{limits.total_key}={limits.total}"
    return None


@dataclass(frozen=True)
class PreparedData:
    """Tokenized train (and validation) examples for a run, from :func:`prepare_data`."""

    train: list[DatumSpec]
    val: list[DatumSpec] | None
    prompt_config: PromptConfig


def prepare_data(data_cfg: Mapping[str, Any], tokenizer: Any, plugins: PluginManager, *, processor: str | None = None,
                 limits: LengthLimits | None = None) -> PreparedData:
    """Everything an algorithm needs from the validated ``data`` section in one call: records
    (:func:`nrl_core.data.splits.load_data_splits`) through the prompt processor
    (``processor`` overrides ``data.processor``; SFT passes ``"sft"``), filtered by ``limits``;
    ``plugins`` supply the datasets, generators and processors the section names."""
    from nrl_core.data.splits import load_data_splits

    splits = load_data_splits(data_cfg, plugins)
    cfg = PromptConfig.from_data_config(data_cfg)
    name = processor or data_cfg.get("processor") or "math"
    train = process_records(splits.train, tokenizer, cfg, name, plugins=plugins, limits=limits,
                            where=splits.train_where, source=splits.source)
    val = process_records(splits.val, tokenizer, cfg, name, plugins=plugins, limits=limits, where=splits.val_where,
                          source=f"{splits.source} (validation)") if splits.val else None
    return PreparedData(train=train, val=val, prompt_config=cfg)
