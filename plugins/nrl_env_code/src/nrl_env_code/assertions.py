"""Assert tests judged outside the program: the sandbox computes values, the host compares them.

An assert test such as ``assert set(f((3, 4), (5, 4))) == set((4,))`` is split here, on the host,
into the parts that need the program (``set(f((3, 4), (5, 4)))``: a *probe*) and the comparison
around them. Only the probes go into the sandbox; the program runs, each probe is evaluated and
its value printed in a plain encoding (``ENCODER``); the host decodes the values and evaluates the
comparison itself, with the expected side it never sent. A program that does not compute the
right values cannot pass: whatever it reads in its own process (the stack, ``gc``,
``/proc/self/mem``) holds no expected value, and whatever it prints or forges is just a value.

What the host evaluates is what needs no program: expressions whose names are all in
:data:`SAFE_CALLS` (literals, operators, ``sorted``, ``set``, a comprehension over them), and the
comparisons, ``and``/``or``/``not`` and :data:`HOST_PREDICATES` around the probes. Every other
expression that reads a name the program or the setup code defines is a probe, whole: in
``list(f(x)) == [1, 2]`` the sandbox evaluates ``list(f(x))`` (``f`` may return a generator), the
host the comparison and ``[1, 2]``. A test that is not a sequence of ``assert`` statements (after
imports and setup code) is a :class:`~nrl_env_code.checks.TaskError`: running it beside the
program would put the verdict back in the program's reach.
"""

from __future__ import annotations

import ast
import builtins
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, SimpleNamespace
from typing import Any

__all__ = ["Split", "VALUES_MARK", "decode", "encode_source", "evaluate", "split"]

VALUES_MARK = "\x1enrl-values\x1e"
"""Printed before the probes' values (a forged one only brings values the host then compares)."""

SAFE_CALLS: dict[str, Callable[..., Any]] = {
    name: getattr(builtins, name)
    for name in ("abs", "all", "any", "bool", "bytes", "complex", "dict", "divmod", "float", "frozenset", "int",
                 "isinstance", "len", "list", "max", "min", "pow", "range", "repr", "reversed", "round", "set",
                 "sorted", "str", "sum", "tuple", "type", "zip", "enumerate")
}
SAFE_CALLS.update({f"math.{name}": getattr(math, name)
                   for name in ("isclose", "fabs", "sqrt", "floor", "ceil", "isnan", "isinf", "pi", "e", "inf")})
SAFE_NAMES = {"True": True, "False": False, "None": None}
HOST_PREDICATES = {"math.isclose", "isinstance"}


class NotAssertions(ValueError):
    """The test is not a sequence of assert statements (the message says what it holds)."""


@dataclass(frozen=True)
class Split:
    """One test, split: ``probes`` (expression sources the sandbox evaluates, in order), ``setup``
    (the statements before them: imports and the task's setup code), and ``checks`` (each assert's
    test, compiled, with ``_v[i]`` where probe ``i`` was), evaluated on the host."""

    setup: str
    probes: tuple[str, ...]
    checks: tuple[CodeType, ...]


def _qualified(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _qualified(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _needs_program(node: ast.AST) -> bool:
    """Whether ``node`` reads a name that is neither safe nor bound inside it (a comprehension's
    or a lambda's variable), or a private attribute: then only the sandbox can evaluate it."""
    bound: set[str] = set()
    safe_heads: set[int] = set()  # the names heading a chain SAFE_CALLS names (``math`` in ``math.isclose``)
    for sub in ast.walk(node):
        if isinstance(sub, ast.comprehension):
            bound |= {n.id for n in ast.walk(sub.target) if isinstance(n, ast.Name)}
        elif isinstance(sub, ast.Lambda):
            bound |= {a.arg for a in sub.args.args + sub.args.kwonlyargs + sub.args.posonlyargs}
        elif isinstance(sub, ast.Attribute):
            if sub.attr.startswith("_"):
                return True
            if isinstance(sub.value, ast.Name) and _qualified(sub) in SAFE_CALLS:
                safe_heads.add(id(sub.value))
    return any(isinstance(sub, ast.Name) and sub.id not in SAFE_NAMES and sub.id not in SAFE_CALLS
               and sub.id not in bound and id(sub) not in safe_heads for sub in ast.walk(node))


def _is_predicate(node: ast.AST) -> bool:
    """The shape the host keeps around probes: comparisons, ``and``/``or``/``not`` and the
    predicates in :data:`HOST_PREDICATES`."""
    return (isinstance(node, (ast.Compare, ast.BoolOp)) or (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not))
            or (isinstance(node, ast.Call) and _qualified(node.func) in HOST_PREDICATES))


class _Splitter(ast.NodeTransformer):
    def __init__(self, source: str) -> None:
        self.source = source
        self.probes: list[str] = []

    def _probe(self, node: ast.expr) -> ast.expr:
        self.probes.append(ast.get_source_segment(self.source, node) or ast.unparse(node))
        index = ast.Constant(len(self.probes) - 1)
        return ast.copy_location(ast.Subscript(ast.Name("_v", ast.Load()), index, ast.Load()), node)

    def visit(self, node: ast.AST) -> ast.AST:
        """Top-down: what needs no program stays here whole (the expected side); a comparison or
        predicate is kept and its parts visited; anything else that needs the program is a probe,
        whole (``list(f(x))`` is evaluated in the sandbox, where ``f`` may return a generator)."""
        if not isinstance(node, ast.expr) or not _needs_program(node):
            return node if isinstance(node, ast.expr) else self.generic_visit(node)
        if _is_predicate(node):
            return self.generic_visit(node)
        return self._probe(node)


@functools.lru_cache(maxsize=4096)
def split(code: str) -> Split:
    """Split a test's code (imports, then asserts; setup code may come before it) into the probes
    the sandbox evaluates and the checks the host evaluates. Cached: a batch checks each test's
    shape when it reads the task, then runs it against every response."""
    try:
        module = ast.parse(code)
    except SyntaxError as exc:
        raise NotAssertions(f"it does not parse ({exc.msg}, line {exc.lineno})") from None
    asserts = [i for i, statement in enumerate(module.body) if isinstance(statement, ast.Assert)]
    if not asserts:
        raise NotAssertions("it has no assert statement")
    first = asserts[0]
    if asserts != list(range(first, len(module.body))):
        other = module.body[next(i for i in range(first, len(module.body)) if i not in asserts)]
        raise NotAssertions(f"line {other.lineno} ({type(other).__name__}) follows an assert; only assert statements "
                            "may follow the first one")
    splitter = _Splitter(code)
    checks = tuple(compile(ast.fix_missing_locations(ast.Expression(splitter.visit(module.body[i].test))), "<check>",
                           "eval") for i in asserts)
    setup = "\n".join(ast.get_source_segment(code, s) or ast.unparse(s) for s in module.body[:first])
    return Split(setup=setup, probes=tuple(splitter.probes), checks=checks)


def _host_scope() -> dict[str, Any]:
    """What the host's checks see: the safe names, and ``math`` holding its safe functions only."""
    scope: dict[str, Any] = {"__builtins__": {}, **SAFE_NAMES}
    for name, function in SAFE_CALLS.items():
        head, _, attr = name.partition(".")
        if attr:
            setattr(scope.setdefault(head, SimpleNamespace()), attr, function)
        else:
            scope[name] = function
    return scope


_HOST_SCOPE = _host_scope()


def evaluate(check: CodeType, values: list[Any]) -> bool:
    """One assert's test, with the probes' ``values``, on the host: only safe names are in scope."""
    try:
        return bool(eval(check, {**_HOST_SCOPE, "_v": values}))  # noqa: S307 - safe names and values only
    except Exception:  # noqa: BLE001 - a value of the wrong shape fails the test, as in the sandbox
        return False


class Unequal:
    """What a probe gave that is no value: an object the encoding has no form for, or the name of
    the exception it raised. Equal to nothing, so a comparison with it fails."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<{self.what}>"


def decode(text: str) -> Any:
    """One value from its encoding (a Python literal of lists, strings, numbers and one-key tag
    dicts, read with ``ast.literal_eval``); never runs code."""
    return _decode(ast.literal_eval(text))


def _decode(item: Any) -> Any:
    if isinstance(item, list):
        return [_decode(x) for x in item]
    if not isinstance(item, dict):
        return item
    (tag, body), = item.items()
    if tag == "t":
        return tuple(_decode(x) for x in body)
    if tag == "s":
        return {_decode(x) for x in body}
    if tag == "f":
        return frozenset(_decode(x) for x in body)
    if tag == "d":
        return {_decode(k): _decode(v) for k, v in body}
    if tag == "b":
        return bytes.fromhex(body)
    if tag == "c":
        return complex(*(_decode(part) for part in body))
    if tag == "n":
        return float(body)
    if tag == "e":
        return Unequal(f"raised {body}")
    return Unequal(f"unrepresentable {body}")


def encode_source() -> str:
    """The encoder, as source for the sandbox's harness (the program could change it there; the
    host's decoder trusts nothing of it)."""
    return ENCODER


ENCODER = r'''
def _encode(value, depth=0):
    if depth > 64:
        return {"x": "nested too deep"}
    kind = type(value)
    if kind is float and (value != value or value in (float("inf"), float("-inf"))):
        return {"n": repr(value)}
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [_encode(v, depth + 1) for v in value]
    if kind is tuple:
        return {"t": [_encode(v, depth + 1) for v in value]}
    if kind in (set, frozenset):
        return {"s" if kind is set else "f": [_encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"d": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in value.items()]}
    if kind in (bytes, bytearray):
        return {"b": bytes(value).hex()}
    if kind is complex:
        return {"c": [_encode(value.real), _encode(value.imag)]}
    return {"x": kind.__name__}
'''
