"""Workers written for an older contract, adapted to the one the core calls.

The plugin manager gives a backend spec of an older contract the worker path
``nrl_core.contract_adapters:<role>@<version>@<plugin>@<module:Class>``; wherever the core imports
it (a Ray actor, a conformance rank), :func:`__getattr__` builds a subclass of the plugin's class
that adds what later contracts require: no-op memory hand-off methods (warning once that colocated
generation then shares the device with the whole training state), a bare ``[B, T]`` logprob
tensor wrapped into a :class:`~nrl_core.contracts.BatchShard` from rank 0, default sampling state.
A subclass keeps the plugin's class in the MRO, so its checkpoint hooks still recognise the
worker. What cannot be adapted (a method the plugin's own contract requires) is refused in one
line by :func:`adapted_class`, and earlier by ``nrl config check`` (:func:`check_selected`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nrl_core.contract_versions import (
    ADAPTER_SEPARATOR,
    HOOK_CHECKPOINT_METHODS,
    ROLES,
    VERSIONS_DOCS,
    adapted_methods,
    unwrap_path,
    worker_gaps,
)
from nrl_core.contracts import CONTRACT_VERSION, import_object
from nrl_core.errors import PluginError

if TYPE_CHECKING:
    from nrl_core.plugins import PluginManager

logger = logging.getLogger(__name__)

_warned: set[str] = set()


def __getattr__(name: str) -> type:
    if name.startswith("__") or name.count(ADAPTER_SEPARATOR) < 3:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    role, version, plugin, worker = name.split(ADAPTER_SEPARATOR, 3)
    return adapted_class(import_object(worker), role, int(version), plugin)


@functools.cache
def adapted_class(cls: type, role: str, version: int, plugin: str) -> type:
    """``cls`` with what contracts after ``version`` added filled in; a one-line
    :class:`PluginError` when it lacks what its own contract requires."""
    gaps = worker_gaps(cls, role, version, plugin)
    if gaps:
        more = f" (and {len(gaps) - 1} more)" if len(gaps) > 1 else ""
        raise PluginError(gaps[0] + more)
    namespace: dict[str, Any] = {}
    for method in ROLES[role][1]:
        if method.since > version and method.adaptable and (method.name in HOOK_CHECKPOINT_METHODS or
                                                              not hasattr(cls, method.name)):
            namespace[method.name] = _DEFAULTS[method.name](plugin, version)
    if role == "training" and version < 2:
        for name in ("get_logprobs", "get_reference_logprobs"):
            namespace[name] = _as_shard(getattr(cls, name))
    if not namespace:
        return cls
    namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__, __doc__=cls.__doc__,
                     nrl_contract=version)
    return type(cls.__name__, (cls,), namespace)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning("%s", message)


def _no_memory_handoff(method: str, result: Any = None) -> Callable[[str, int], Callable[..., Any]]:
    def make(plugin: str, version: int) -> Callable[..., Any]:
        def default(self: Any, *args: Any, **kwargs: Any) -> Any:
            _warn_once(f"{plugin}.{method}", f"plugin '{plugin}' is written for contract {version}, which has no "
                       f"{method}: colocated generation shares the device with everything the worker holds (memory "
                       f"is not handed back); implement it and set NRL_CONTRACT = {CONTRACT_VERSION} ({VERSIONS_DOCS})")
            return result

        default.__name__ = method
        return default

    return make


def _no_op(method: str, result: Any = None) -> Callable[[str, int], Callable[..., Any]]:
    def make(plugin: str, version: int) -> Callable[..., Any]:
        def default(self: Any, *args: Any, **kwargs: Any) -> Any:
            return result() if callable(result) else result

        default.__name__ = method
        return default

    return make


def _through_hook(method: str, hook: str) -> Callable[[str, int], Callable[..., Any]]:
    """Contracts 1-3 saved and loaded through the checkpoint hooks the plugin answers; the adapted
    worker keeps doing so, warning once per worker class that the hooks are deprecated. A hook
    that forwards to the worker's own method of the same name (``worker_checkpoint_hooks`` does)
    reaches that method, not this one again."""

    def make(plugin: str, version: int) -> Callable[..., Any]:
        def default(self: Any, path: str, options: Any = None) -> Any:
            from nrl_core.contracts import CheckpointOptions

            options = options or CheckpointOptions()
            if getattr(self, "_nrl_in_checkpoint_hook", False):
                own = next((vars(c)[method] for c in type(self).__mro__[1:] if method in vars(c)), None)
                if own is None:
                    raise PluginError(f"plugin '{plugin}': its checkpoint hook calls {method} on a worker that has "
                                      f"none ({VERSIONS_DOCS})")
                return own(self, path, options)
            _warn_once(f"{plugin}.{type(self).__qualname__}.checkpoint",
                       f"plugin '{plugin}' checkpoints {type(self).__qualname__} through the deprecated "
                       f"nrl_checkpoint_save/nrl_checkpoint_load hooks; give the worker save_checkpoint(path, options) "
                       f"and load_checkpoint(path, options) methods and set NRL_CONTRACT = {CONTRACT_VERSION} "
                       f"({VERSIONS_DOCS})")
            self._nrl_in_checkpoint_hook = True
            try:
                # the deprecated hooks are a dispatch over every plugin of the process: the one
                # reach for its manager below the algorithms (tests/core/test_runtime.py names it)
                from nrl_core.plugins import get_plugin_manager

                getattr(get_plugin_manager(), hook)(self, path, options)
            finally:
                self._nrl_in_checkpoint_hook = False

        default.__name__ = method
        return default

    return make


_DEFAULTS: dict[str, Callable[[str, int], Callable[..., Any]]] = {
    "offload_before_refit": _no_memory_handoff("offload_before_refit"),
    "offload_after_refit": _no_op("offload_after_refit"),
    "prepare_for_training": _no_op("prepare_for_training"),
    "prepare_for_generation": _no_op("prepare_for_generation"),
    "finish_generation": _no_memory_handoff("finish_generation", False),
    "sampling_state": _no_op("sampling_state", dict),
    "load_sampling_state": _no_op("load_sampling_state"),
    "shutdown": _no_op("shutdown"),
    "save_checkpoint": _through_hook("save_checkpoint", "checkpoint_save"),
    "load_checkpoint": _through_hook("load_checkpoint", "checkpoint_load"),
}


def _as_shard(method: Callable[..., Any]) -> Callable[..., Any]:
    """Contract 1's logprobs (the whole batch's ``[B, T]`` tensor on every rank) as contract 2's:
    a ``BatchShard`` of every row from rank 0, ``None`` from the others."""

    @functools.wraps(method)
    def wrapper(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        from nrl_core.contracts import BatchShard

        value = method(self, batch, *args, **kwargs)
        if value is None or isinstance(value, BatchShard):
            return value
        return BatchShard(rows=list(range(batch.size)), values=value) if _rank() == 0 else None

    return wrapper


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def check_spec(spec: Any, role: str, pm: PluginManager) -> list[str]:
    """Check the worker class of a backend spec against its plugin's contract: a one-line
    :class:`PluginError` for what cannot be adapted, else notes on what is (for ``nrl config check``)."""
    worker, adapted_role, version, plugin = unwrap_path(spec.worker)
    try:
        cls = import_object(worker)
    except PluginError as exc:  # the run would fail to build it; this check only judges classes it can see
        return [f"{role} backend '{spec.name}': worker not checked against its contract: {exc}"]
    if plugin is None:
        registry = pm.training_backends() if role == "training" else pm.generation_backends()
        plugin = registry.owner(spec.name) if spec.name in registry else spec.distribution
    gaps = worker_gaps(cls, role, version, plugin, capabilities=getattr(spec, "capabilities", frozenset()))
    if gaps:
        raise PluginError("; ".join(gaps))
    notes = adapted_methods(cls, role, version) if adapted_role else []
    return [f"{role} backend '{spec.name}' is written for contract {version} (this core: {CONTRACT_VERSION}); "
            f"adapted: {', '.join(notes)}"] if notes else []


def check_selected(choice: Any, pm: PluginManager, *, colocated: bool) -> list[str]:
    """:func:`check_spec` for the selected training and generation backends of a config (``pm``'s
    registrations); a colocated run whose training worker has no memory hand-off gets a note."""
    notes = check_spec(choice.training, "training", pm)
    if choice.generation is not None:
        notes += check_spec(choice.generation, "generation", pm)
        if colocated and any("no-op offload_before_refit" in n for n in notes):
            notes.append("colocated generation: the training backend does not hand its memory back to the engines")
    return notes
