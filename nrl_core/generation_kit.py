"""What every generation backend reads and tracks the same way: a kit for backend authors.

A generation worker (``docs/plugins.md``) samples from the core's ``policy.generation`` keys,
derives a seed for each request so its samples are reproducible, and sleeps and wakes with the
colocated memory hand-off. These are parts of the contract, not of any engine: two backends that
read ``top_k: 0`` differently, or wake on different tag names, would make the same config sample or
hand off memory differently. The first-party backends (``nrl_gen_vllm``, ``nrl_gen_hf``) build on
this module; a third-party backend should too.

Only the standard library is imported here: the core imports without torch or any engine, and a
plugin's config check can use the kit before its engine is importable.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nrl_core.errors import NrlError

__all__ = ["SLEEP_TAGS", "SamplingSettings", "SamplingState", "SleepState", "derive_seed"]

DEFAULT_MAX_NEW_TOKENS = 512
"""``max_new_tokens`` when a bare config (tests, notebooks) leaves it unset or null."""


@dataclass(frozen=True)
class SamplingSettings:
    """The ``policy.generation`` keys that shape every request, normalised once for every engine.

    ``top_k`` is ``None`` when off (``null``, ``0`` or ``-1`` in the config: vLLM's spellings of
    "off", which its ``SamplingParams`` takes as ``top_k=0``), ``top_p`` is ``1.0`` when ``null``,
    so an engine tests ``top_k is None`` / ``top_p < 1`` instead of re-deciding what off means.
    Engines add their own translation as methods of a subclass (``from_generation`` builds the
    subclass it is called on).
    """

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int | None
    stop_token_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]

    @classmethod
    def from_generation(cls, generation: Mapping[str, Any]) -> SamplingSettings:
        """Read ``policy.generation`` (validated, or a bare mapping with defaults filled in)."""
        top_p = generation.get("top_p")
        top_k = generation.get("top_k")
        return cls(max_new_tokens=int(generation.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS),
                   temperature=float(generation.get("temperature", 1.0)),
                   top_p=1.0 if top_p is None else float(top_p),
                   top_k=int(top_k) if top_k is not None and int(top_k) > 0 else None,
                   stop_token_ids=tuple(int(t) for t in generation.get("stop_token_ids") or ()),
                   stop_strings=tuple(generation.get("stop_strings") or ()))

    def samples(self, greedy: bool) -> bool:
        """Whether a call draws tokens: not when asked for greedy, nor at temperature 0 (vLLM's
        convention, which every engine follows so the same config decodes the same way)."""
        return not greedy and self.temperature > 0


def derive_seed(base: int, engine: int, call: int, index: int) -> int:
    """A well-mixed 63-bit seed for one unit of sampling: request ``index`` (or batch, for an
    engine that seeds per batch) of generate call ``call`` on engine ``engine``.

    Seeding each unit from these four numbers, instead of drawing from one running generator,
    makes samples independent of scheduling and of the process: two workers built from the same
    config sample the same tokens, and a run that restores ``call`` (``sampling_state``) repeats
    its rollouts. A hash keeps neighbouring inputs from giving correlated seeds.
    """
    digest = hashlib.blake2b(f"{base}:{engine}:{call}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass
class SamplingState:
    """What, with the weights, determines an engine's next samples, and the version label its next
    refit continues from: a worker's ``sampling_state()`` is :meth:`as_dict`, saved with a
    checkpoint, and ``load_sampling_state`` is :meth:`load`, so a resumed run repeats its rollouts.

    Because every unit's seed is :func:`derive_seed` of (``seed``, engine, call, index), the base
    seed and the call count are the whole random state; nothing else needs saving.
    """

    seed: int
    weight_version: int = 0
    """0 for the checkpoint's weights, +1 per successful refit, -1 while only placeholders are held."""
    calls: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"calls": self.calls, "seed": self.seed, "weight_version": self.weight_version}

    def load(self, state: Mapping[str, int]) -> None:
        """Restore :meth:`as_dict`; ``seed`` and ``weight_version`` are optional (older states)."""
        self.calls = int(state["calls"])
        self.seed = int(state.get("seed", self.seed))
        self.weight_version = int(state.get("weight_version", self.weight_version))

    def next_call(self) -> int:
        """Count a generate call; returns its number (part of each of its seeds)."""
        call, self.calls = self.calls, self.calls + 1
        return call

    def seed_for(self, engine: int, call: int, index: int) -> int:
        """:func:`derive_seed` from this state's base seed."""
        return derive_seed(self.seed, engine, call, index)


SLEEP_TAGS: tuple[str, ...] = ("weights", "kv_cache")
"""What ``prepare_for_generation(tags)`` may wake: the core wakes the weights before a refit and
the KV cache once training's memory is out of the way (``Generation.prepare``)."""


class SleepState:
    """Which of :data:`SLEEP_TAGS` an engine holds awake, so every backend refuses the same calls
    out of order, with the same message, whether or not its engine really sleeps (on CPU nothing
    does, and the order is still checked).

    It only tracks: the worker frees and restores memory itself, between asking what to do
    (:meth:`to_wake`, :attr:`awake`) and recording that it was done (:meth:`wake`, :meth:`sleep`),
    so a failed wake leaves the state saying asleep. An engine starts awake.
    """

    def __init__(self, engine: str) -> None:
        """``engine`` names the engine in errors, e.g. ``"vLLM engine 0"``."""
        self.engine = engine
        self._awake: set[str] = set(SLEEP_TAGS)

    @property
    def awake(self) -> frozenset[str]:
        return frozenset(self._awake)

    @staticmethod
    def requested(tags: Iterable[str] | None) -> set[str]:
        """The tags ``prepare_for_generation`` was given (all when ``None`` or empty); an unknown
        tag is the caller's bug (the core passes them), hence ``ValueError``."""
        wanted = set(tags or SLEEP_TAGS)
        unknown = wanted - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"unknown sleep tags {sorted(unknown)}; use {list(SLEEP_TAGS)}")
        return wanted

    def to_wake(self, tags: Iterable[str] | None) -> set[str]:
        """Of the requested ``tags``, those asleep: what the engine must restore."""
        return self.requested(tags) - self._awake

    def wake(self, tags: Iterable[str] | None) -> set[str]:
        """Record ``tags`` (all when ``None``) as awake; returns those that were asleep."""
        woken = self.to_wake(tags)
        self._awake |= woken
        return woken

    def sleep(self) -> set[str]:
        """Record everything as asleep (``finish_generation``); returns what was awake."""
        was, self._awake = self._awake, set()
        return was

    def require_awake(self, what: str, tags: Iterable[str] = SLEEP_TAGS) -> None:
        """Refuse ``what`` (``"generate"``, ``"import_weights"``) while any of ``tags`` sleeps."""
        asleep = sorted(set(tags) - self._awake)
        if asleep:
            raise NrlError(f"{self.engine}: {what} while its {', '.join(asleep)} sleep; "
                           "call prepare_for_generation first")


def stop_string_end(tokens: Sequence[int], stop_strings: Sequence[str],
                    decode: Callable[[list[int]], str]) -> int | None:
    """The fewest leading tokens whose text contains a stop string, or None (for engines that check
    stop strings after sampling, and for multi-turn stop strings). Containment only grows
    with the prefix, so a binary search needs a handful of decodes per row."""
    if not stop_strings or not any(s in decode(list(tokens)) for s in stop_strings):
        return None
    low, high = 1, len(tokens)
    while low < high:
        middle = (low + high) // 2
        if any(s in decode(list(tokens[:middle])) for s in stop_strings):
            high = middle
        else:
            low = middle + 1
    return low


def in_flight_section(config: Mapping[str, Any]) -> str | None:
    """The path of the enabled asynchronous section that asks for in-flight weight updates
    (NeMo RL's layout: ``grpo.async_grpo``, ``ppo.async_ppo``, any algorithm's ``<section>.async_*``
    with ``enabled`` and ``in_flight_weight_updates``), or None: what a backend's config check and
    the engines' launch read without knowing the algorithm."""
    for name, section in config.items():
        if not isinstance(section, Mapping):
            continue
        for key, sub in section.items():
            if (key.startswith("async") and isinstance(sub, Mapping) and sub.get("enabled")
                    and sub.get("in_flight_weight_updates")):
                return f"{name}.{key}"
    return None
