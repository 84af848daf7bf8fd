"""Reading a config: YAML files, ``defaults:`` inheritance, command-line overrides, ``${...}``.

The order matters and is NeMo RL's: a file's ``defaults:`` chain is merged first (the file wins
over what it inherits), then command-line overrides are applied, and only then are ``${...}``
references resolved, so an override of ``policy.model_name`` also changes every key that refers to
it. Everything here works on plain dicts and needs neither network nor plugins.

Override syntax (Hydra's, which NeMo RL users type):

* ``a.b.c=value``: set (the value is parsed as YAML: ``1e-5``, ``true``, ``[1, 2]``, ``null``);
* ``+a.b.c=value``: add a key that must not exist yet; ``++a.b.c=value``: add or replace;
* ``~a.b.c``: delete the key.

Interpolation: ``${a.b.c}`` is the value at that path (type kept when it is the whole string);
``${.key}`` is relative to the mapping that holds the value (a sibling), each further dot one level
up (``${..key}`` is a key of the parent mapping), as OmegaConf resolves them;
``${mul:x,y}``, ``${div:x,y}``, ``${add:x,y}``, ``${max:x,y}``, ``${min:x,y}`` compute on numbers;
``${env:NAME,default}`` (or OmegaConf's ``${oc.env:NAME,default}``) reads the environment.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from nrl_core.errors import ConfigError

DEFAULTS_KEY = "defaults"


# --------------------------------------------------------------------------- files and defaults


def load_config(path: str | os.PathLike[str], overrides: Iterable[str] = ()) -> dict[str, Any]:
    """The raw config at ``path``: ``defaults:`` merged, overrides applied, references resolved."""
    config = load_with_defaults(Path(path))
    apply_overrides(config, overrides)
    return resolve_interpolations(config)


def load_with_defaults(path: Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.expanduser().resolve()
    if path in _chain:
        cycle = " -> ".join(p.name for p in (*_chain, path))
        raise ConfigError(DEFAULTS_KEY, f"inheritance cycle {cycle}; remove one of these defaults entries")
    data = read_yaml_mapping(path)
    parents = data.pop(DEFAULTS_KEY, None)
    if parents is None:
        return data
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"{DEFAULTS_KEY}", f"in {path.name} must be a file name or a list of file names")
    merged: dict[str, Any] = {}
    for parent in parents:
        parent_path = (path.parent / parent)
        if not parent_path.exists():
            raise ConfigError(DEFAULTS_KEY, f"'{parent}' (from {path.name}) does not exist at {parent_path}; fix the path, which is relative to {path.name}")
        merged = deep_merge(merged, load_with_defaults(parent_path, (*_chain, path)))
    return deep_merge(merged, data)


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """Parse one YAML file that must hold a mapping; every failure is a one-line ConfigError."""
    name = str(path)
    if not path.exists():
        raise ConfigError(name, "config file does not exist; check the path")
    if path.is_dir():
        raise ConfigError(name, "is a directory, not a config file; pass a .yaml file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(name, f"cannot be read as UTF-8 text ({type(exc).__name__}); pass a YAML file") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(name, f"is not valid YAML{where}: {problem}") from None
    if data is None:
        raise ConfigError(name, "config file is empty; it needs at least a 'policy' section")
    if not isinstance(data, dict):
        raise ConfigError(name, f"must hold a mapping of sections at the top level, not a {type(data).__name__}")
    return data


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-5`` as a float (YAML 1.1 wants ``1.0e-5``; every ML config
    writes the short form)."""


_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)
_YamlLoader.yaml_implicit_resolvers = {k: [r for r in v if r[0] != "tag:yaml.org,2002:float"]
                                       for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def parse_yaml_value(text: str) -> Any:
    """One YAML scalar or flow collection, as the config files read it."""
    return yaml.load(text, Loader=_YamlLoader)


class _UniqueKeyLoader(_YamlLoader):
    """Also rejects a key given twice in one mapping (YAML silently keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        # Merge keys (``<<: *anchor``) are not keys: SafeConstructor flattens them (explicit keys
        # win over merged ones), so only the explicit keys are checked for repeats.
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}'", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``update`` over ``base``: mappings merge key by key, anything else is replaced."""
    out = copy.deepcopy(dict(base))
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def value_at(config: Mapping[str, Any], dotted: str) -> Any:
    """The value at ``dotted`` (``policy.generation.backend``) in a plain nested mapping; None where
    a key on the way is missing or not a mapping."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


# --------------------------------------------------------------------------- overrides

_KEY_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z_][A-Za-z0-9_\-]*)*$")


def apply_overrides(config: dict[str, Any], overrides: Iterable[str]) -> None:
    """Apply command-line overrides in order, in place."""
    for text in overrides:
        _apply_override(config, text)


def _apply_override(config: dict[str, Any], text: str) -> None:
    if text.startswith("~"):
        key = text[1:].split("=", 1)[0]
        _check_key_path(key, text)
        parent, leaf = _parent(config, key, text, create=False)
        if parent is None or leaf not in parent:
            raise ConfigError(key, f"cannot delete (override '{text}'): no such key")
        del parent[leaf]
        return
    if "=" not in text:
        raise ConfigError("overrides", f"'{text}' is not an override; write key.path=value, +key.path=value or ~key.path")
    key, raw_value = text.split("=", 1)
    mode = "set"
    if key.startswith("++"):
        mode, key = "force_add", key[2:]
    elif key.startswith("+"):
        mode, key = "add", key[1:]
    _check_key_path(key, text)
    try:
        value = parse_yaml_value(raw_value) if raw_value.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(key, f"value in override '{text}' is not valid YAML; quote it") from None
    parent, leaf = _parent(config, key, text, create=True)
    assert parent is not None
    if mode == "add" and leaf in parent:
        raise ConfigError(key, f"already exists, so '+{key}=...' cannot add it; use {key}=... to change it")
    parent[leaf] = value


def _check_key_path(key: str, text: str) -> None:
    if not _KEY_PATH.match(key):
        raise ConfigError("overrides", f"'{text}' has an invalid key path '{key}'; use dotted names like policy.precision")


def _parent(config: dict[str, Any], key: str, text: str, *, create: bool) -> tuple[dict[str, Any] | None, str]:
    *heads, leaf = key.split(".")
    node: Any = config
    walked = []
    for head in heads:
        walked.append(head)
        child = node.get(head)
        if child is None:
            if not create:
                return None, leaf
            child = node[head] = {}
        if not isinstance(child, dict):
            raise ConfigError(".".join(walked), f"is not a section, so override '{text}' cannot set a key inside it")
        node = child
    return node, leaf


# --------------------------------------------------------------------------- interpolation

_RESOLVERS: dict[str, Callable[..., Any]] = {
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a // b if isinstance(a, int) and isinstance(b, int) else a / b,
    "add": lambda *xs: sum(xs),
    "max": lambda *xs: max(xs),
    "min": lambda *xs: min(xs),
    "env": lambda name, default=None: os.environ.get(str(name), default),
}
_RESOLVERS["oc.env"] = _RESOLVERS["env"]  # OmegaConf's spelling, which NeMo RL's configs use


def resolve_interpolations(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` with every ``${...}`` replaced; references see overridden values."""
    return _Resolver(config).resolve_tree()


class _Resolver:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.resolving: list[str] = []
        self.cache: dict[str, Any] = {}

    def resolve_tree(self) -> dict[str, Any]:
        return self._walk(self.config, "")

    def _walk(self, node: Any, path: str) -> Any:
        if isinstance(node, dict):
            return {k: self._walk(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
        if isinstance(node, list):
            return [self._walk(v, f"{path}[{i}]") for i, v in enumerate(node)]
        if isinstance(node, str) and "${" in node:
            return self._resolve_string(node, path)
        return node

    def _lookup(self, ref: str, at: str) -> Any:
        if ref in self.cache:
            return self.cache[ref]
        if ref in self.resolving:
            cycle = " -> ".join([*self.resolving[self.resolving.index(ref):], ref])
            raise ConfigError(at, f"interpolation cycle {cycle}; make one of these a plain value")
        node: Any = self.config
        for part in ref.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(at, f"refers to '${{{ref}}}', which does not exist; fix the reference or add the key")
            node = node[part]
        self.resolving.append(ref)
        try:
            value = self._walk(node, ref)
        finally:
            self.resolving.pop()
        self.cache[ref] = value
        return value

    def _resolve_string(self, text: str, path: str) -> Any:
        pieces = _split_interpolations(text, path)
        if len(pieces) == 1 and isinstance(pieces[0], tuple):
            return self._evaluate(pieces[0][1], path)
        out = []
        for piece in pieces:
            if isinstance(piece, tuple):
                value = self._evaluate(piece[1], path)
                if isinstance(value, (dict, list)):
                    raise ConfigError(path, f"embeds '${{{piece[1]}}}', a {type(value).__name__}, inside a string")
                out.append("null" if value is None else str(value))
            else:
                out.append(piece)
        return "".join(out)

    def _evaluate(self, expr: str, path: str) -> Any:
        expr = expr.strip()
        name, sep, args = expr.partition(":")
        if sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", name) and ("." not in name or name in _RESOLVERS):
            resolver = _RESOLVERS.get(name)
            if resolver is None:
                raise ConfigError(path, f"unknown interpolation function '{name}'; available: {', '.join(sorted(_RESOLVERS))}")
            values = [self._argument(a, path) for a in _split_args(args)]
            try:
                return resolver(*values)
            except TypeError as exc:
                raise ConfigError(path, f"'${{{expr}}}' cannot be computed: {exc}") from None
        if expr.startswith("."):
            return self._lookup(_absolute(expr, path), path)
        if not _KEY_PATH.match(expr):
            raise ConfigError(path, f"'${{{expr}}}' is not a key path or a function call")
        return self._lookup(expr, path)

    def _argument(self, text: str, path: str) -> Any:
        text = text.strip()
        if "${" in text:
            return self._resolve_string(text, path)
        try:
            return parse_yaml_value(text) if text else None
        except yaml.YAMLError:
            return text


def _absolute(expr: str, path: str) -> str:
    """``.key`` / ``..key`` written at ``path`` (the value's own key path) as an absolute key path:
    one dot is the mapping holding the value, each further dot its parent."""
    dots = len(expr) - len(expr.lstrip("."))
    rest = expr[dots:]
    holder = path.split(".")[:-1]
    if "[" in path:
        raise ConfigError(path, f"'${{{expr}}}' is relative, which nrl resolves only in mappings, not inside lists; "
                                "write the absolute key path")
    if dots - 1 > len(holder):
        raise ConfigError(path, f"'${{{expr}}}' goes {dots - 1} levels up from a key {len(holder)} levels deep; "
                                "remove dots or write the absolute key path")
    target = ".".join([*holder[:len(holder) - (dots - 1)], *([rest] if rest else [])])
    if not rest or not _KEY_PATH.match(target):
        raise ConfigError(path, f"'${{{expr}}}' is not a relative key path; write ${{.key}} or ${{..key}}")
    return target


def _split_interpolations(text: str, path: str) -> list[Any]:
    """``"a${x}b"`` -> ``["a", ("ref", "x"), "b"]`` with nested ``${...}`` kept inside the ref."""
    pieces: list[Any] = []
    i = 0
    literal_start = 0
    while i < len(text):
        if text.startswith("${", i):
            if i > literal_start:
                pieces.append(text[literal_start:i])
            depth, j = 1, i + 2
            while j < len(text) and depth:
                if text.startswith("${", j):
                    depth += 1
                    j += 2
                    continue
                if text[j] == "}":
                    depth -= 1
                j += 1
            if depth:
                raise ConfigError(path, f"has an unclosed '${{' in {text!r}; add the closing brace")
            pieces.append(("ref", text[i + 2:j - 1]))
            i = literal_start = j
        else:
            i += 1
    if literal_start < len(text):
        pieces.append(text[literal_start:])
    return pieces


def _split_args(args: str) -> list[str]:
    """Split resolver arguments on top-level commas (commas inside nested ``${}`` stay)."""
    parts, depth, current = [], 0, []
    i = 0
    while i < len(args):
        if args.startswith("${", i):
            depth += 1
            current.append("${")
            i += 2
            continue
        ch = args[i]
        if ch == "}" and depth:
            depth -= 1
        if ch == "," and not depth:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
        i += 1
    parts.append("".join(current))
    return parts
