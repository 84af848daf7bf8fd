"""A small declarative schema for nrl's YAML configuration.

Why not pydantic or dataclasses: the schema is assembled at run time from the core's sections and
the sections that installed plugins contribute (``policy.megatron_cfg`` exists only when the
Megatron plugin is installed), every error must name the full dotted key path in one line, unknown
keys need a did-you-mean, and NeMo RL's spellings must be accepted as aliases. Two small frozen
types, :class:`Field` and :class:`Section`, do all of that in one place.

Validation returns a new plain ``dict`` with defaults filled in; the input is never modified.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from nrl_core.errors import ConfigError

logger = logging.getLogger(__name__)


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
"""Default of a field that has none: the user must set it."""

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "a list", dict: "a mapping", type(None): "null"}


def _type_name(types: tuple[type, ...]) -> str:
    return " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)


@dataclass(frozen=True, kw_only=True)
class Field:
    """One leaf value.

    ``type`` is what YAML must produce (``float`` also accepts an integer, never a boolean);
    ``item_type`` checks list items; ``nullable`` admits ``null``; ``choices`` limits the values;
    ``minimum`` is the smallest number accepted (``1`` for counts, ``0`` for periods where 0 means
    never), so a ``-5`` is refused here rather than silently doing nothing at train time;
    ``inert`` marks a NeMo RL key that nrl accepts so copied configs validate, but that has no
    effect here (a warning says so when the user sets it to a non-default value); ``dropped`` keeps
    a key out of the validated config (checked, then left out, and not filled in when absent): NeMo
    RL keys no component reads, so a plugin that validates its own section again never meets them.
    """

    type: type | tuple[type, ...]
    default: Any = REQUIRED
    doc: str = ""
    nullable: bool = False
    choices: tuple[Any, ...] | None = None
    item_type: type | tuple[type, ...] | None = None
    minimum: float | None = None
    inert: bool = False
    dropped: bool = False

    @property
    def types(self) -> tuple[type, ...]:
        return self.type if isinstance(self.type, tuple) else (self.type,)

    def validate(self, value: Any, path: str) -> Any:
        if value is None:
            if self.nullable or self.default is None:  # a field whose default is null takes null
                return None
            raise ConfigError(path, f"must be {_type_name(self.types)}, got null; set a value or remove the key")
        if not _matches(value, self.types):
            raise ConfigError(path, f"must be {_type_name(self.types)}, got {_describe(value)}")
        if float in self.types and isinstance(value, int) and not isinstance(value, bool) and int not in self.types:
            value = float(value)
        if self.item_type is not None and isinstance(value, list):
            item_types = self.item_type if isinstance(self.item_type, tuple) else (self.item_type,)
            for i, item in enumerate(value):
                if not _matches(item, item_types):
                    raise ConfigError(f"{path}[{i}]", f"must be {_type_name(item_types)}, got {_describe(item)}")
        if self.choices is not None and value not in self.choices:
            options = ", ".join(repr(c) for c in self.choices)
            raise ConfigError(path, f"must be one of {options}, got {value!r}")
        if self.minimum is not None and isinstance(value, (int, float)) and value < self.minimum:
            raise ConfigError(path, f"must be {_at_least(self.minimum)}, got {value!r}")
        if self.inert and value != self.default:
            note_inert(path, value)
        return value


def note_inert(path: str, value: Any = None) -> None:
    """Name ``path`` (set to ``value``) as set but without effect: in the one warning of
    :func:`warn_inert_keys_once` when one is gathering, else in a warning of its own. Checks use it
    for keys that are inert only in some configurations (``colocated.resources`` while generation
    is colocated)."""
    collector = _inert_keys.get()
    if collector is None:
        logger.warning("%s is accepted for NeMo RL compatibility but has no effect in nrl", path)
    else:
        collector.append((path, value))


_inert_keys: contextvars.ContextVar[list[tuple[str, Any]] | None] = contextvars.ContextVar("nrl_inert_keys",
                                                                                          default=None)


@contextlib.contextmanager
def warn_inert_keys_once(judge: Callable[[list[tuple[str, Any]]], list[str]] | None = None) -> Iterator[None]:
    """Gather the inert keys a validation meets into one warning instead of one per key; ``judge``
    (the gathered (path, value) pairs -> the keys to name) may drop some or refuse one."""
    token = _inert_keys.set([])
    try:
        yield
        noted = _inert_keys.get() or []
        keys = judge(noted) if judge is not None else [path for path, _ in noted]
        if keys:
            logger.warning("accepted for NeMo RL compatibility, no effect in nrl: %s", ", ".join(keys))
    finally:
        _inert_keys.reset(token)


def _matches(value: Any, types: tuple[type, ...]) -> bool:
    for t in types:
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if t not in (int, float) and isinstance(value, t):
            return True
    return False


def _at_least(minimum: float) -> str:
    if minimum == 0:
        return "non-negative (0 or more)"
    if minimum == 1 and float(minimum).is_integer():
        return "positive (1 or more)"
    return f"at least {minimum:g}"


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{_TYPE_NAMES.get(type(value), type(value).__name__)} {text}"


@dataclass(frozen=True, kw_only=True)
class Section:
    """A mapping of named fields and subsections.

    ``open`` sections accept any extra key unchecked (free-form ``kwargs``); ``nullable`` ones
    accept ``null`` in place of the mapping; ``aliases`` maps an accepted old or NeMo RL spelling
    to ours (``{"dtensor_cfg": "dtensor_config"}``); ``required`` sections must be present; an
    absent section takes its defaults, also a ``nullable`` one (only an explicit ``null`` is None);
    ``preprocess`` rewrites the raw mapping first (e.g. NeMo RL's nested
    ``checkpoint: {async_save: ...}`` into the flat keys) and gets the section's key path;
    ``dropped`` as for :class:`Field`.
    """

    fields: Mapping[str, Field | Section] = field(default_factory=dict)
    doc: str = ""
    required: bool = False
    nullable: bool = False
    open: bool = False
    aliases: Mapping[str, str] = field(default_factory=dict)
    preprocess: Callable[[dict[str, Any], str], dict[str, Any]] | None = None
    dropped: bool = False

    def with_fields(self, **extra: Field | Section) -> Section:
        """A copy with fields added or replaced: how plugin sections are attached to the core's."""
        return replace(self, fields={**self.fields, **extra})

    def validate(self, value: Any, path: str = "") -> dict[str, Any] | None:
        if value is None:
            if self.nullable:
                return None
            value = {}
        if not isinstance(value, Mapping):
            raise ConfigError(path or "<root>", f"must be a mapping of keys to values, got {_describe(value)}")
        if self.preprocess is not None:
            value = self.preprocess(dict(value), path)
        value = self._resolve_aliases(value, path)
        out: dict[str, Any] = {}
        disabled = self._disabled(value)
        for key, item in value.items():
            key_path = _join(path, key)
            if not isinstance(key, str):
                raise ConfigError(key_path, "keys must be strings; quote the key in YAML")
            spec = self.fields.get(key)
            if spec is None:
                if self.open:
                    out[key] = item
                    continue
                raise ConfigError(key_path, self._unknown_key_message(key, item))
            try:
                checked = spec.validate(item, key_path)
            except ConfigError as exc:
                if not disabled or key == "enabled" or not isinstance(spec, Field) or spec.default is REQUIRED:
                    raise
                # A switched-off section's values do nothing, so a bad one is named, not fatal.
                logger.warning("%s (ignored: %s is disabled)", exc, path)
                checked = _copy_default(spec.default)
            if not spec.dropped:
                out[key] = checked
        for key, spec in self.fields.items():
            if key in out or spec.dropped:
                continue
            key_path = _join(path, key)
            if isinstance(spec, Section):
                if spec.required:
                    raise ConfigError(key_path, "required section is missing; add it to the config")
                out[key] = spec.validate({}, key_path)  # absent: defaults (only an explicit null is None)
            elif spec.default is REQUIRED:
                raise ConfigError(key_path, "required key is missing; add it to the config")
            else:
                out[key] = _copy_default(spec.default)
        return out

    def _disabled(self, value: Mapping[str, Any]) -> bool:
        """Whether ``value`` switches this section off (an ``enabled`` key that is false)."""
        switch = self.fields.get("enabled")
        return isinstance(switch, Field) and value.get("enabled", switch.default) is False

    def _resolve_aliases(self, value: Mapping[str, Any], path: str) -> dict[str, Any]:
        resolved = dict(value)
        for old, new in self.aliases.items():
            if old not in resolved:
                continue
            if new in resolved:
                raise ConfigError(_join(path, old), f"is an alias of {_join(path, new)}, which is also set; keep only one")
            resolved[new] = resolved.pop(old)
        return resolved

    def _unknown_key_message(self, key: str, value: Any = None) -> str:
        known = list(self.fields) + list(self.aliases)
        if self.fields.get("enabled") is None and isinstance(value, Mapping) and value.get("enabled") is True \
                and key.endswith(("_cfg", "_config")):
            return ("is enabled but no installed plugin provides this section; install the plugin that does "
                    "(`nrl plugins` lists what is installed)")
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        if close:
            return f"unknown key; did you mean '{close[0]}'?"
        if not known:
            return "unknown key; this section takes no keys"
        return f"unknown key; valid keys are: {', '.join(sorted(self.fields))}"

    def subsection(self, dotted: str) -> Section:
        """The subsection at ``dotted`` (``policy.generation``), for attaching plugin schemas."""
        node: Section = self
        for part in dotted.split("."):
            child = node.fields.get(part)
            if not isinstance(child, Section):
                raise KeyError(dotted)
            node = child
        return node

    def attach(self, dotted: str, name: str, section: Field | Section, *,
               aliases: Mapping[str, str] | None = None) -> Section:
        """A copy with ``section`` (or a field) attached as ``name`` under the subsection ``dotted``
        ("" is the root)."""
        if not dotted:
            updated = self.with_fields(**{name: section})
            return replace(updated, aliases={**updated.aliases, **(aliases or {})})
        head, _, rest = dotted.partition(".")
        child = self.fields[head]
        assert isinstance(child, Section), head
        return self.with_fields(**{head: child.attach(rest, name, section, aliases=aliases)})


@dataclass(frozen=True, kw_only=True)
class SectionList(Field):
    """One mapping or a list of them, each checked by ``section``; validated as a list (None when
    null). NeMo RL's ``data.train`` is either one dataset or several."""

    section: Section = field(default_factory=Section)

    def validate(self, value: Any, path: str) -> Any:
        if value is None:
            return super().validate(value, path)
        if isinstance(value, Mapping):
            return [self.section.validate(value, path)]
        if not isinstance(value, list) or not value:
            raise ConfigError(path, f"must be a mapping or a non-empty list of mappings, got {_describe(value)}")
        return [self.section.validate(item, f"{path}[{i}]") for i, item in enumerate(value)]


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _copy_default(default: Any) -> Any:
    if isinstance(default, (list, dict)):
        import copy

        return copy.deepcopy(default)
    return default
