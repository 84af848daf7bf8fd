"""Methods added to vLLM's worker (``worker_extension_cls``), reached through ``collective_rpc``.

They run inside vLLM's worker, next to the model. Names carry an ``nrl_`` prefix because vLLM's
worker already defines ``update_weights`` (and may grow more): an extension must not shadow it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from nrl_core.api import open_lent_buffer
from nrl_gen_vllm import direct_loads
from nrl_gen_vllm.cpu_moe import process_experts_on_reload, reloading, run_ungated_experts, translate_expert_ids
from nrl_gen_vllm.cpu_rope import rotate_three_dimensional_inputs_natively
from nrl_gen_vllm.cpu_sampler import use_eager_rank_count
from nrl_gen_vllm.part_layout import size_of, views
from nrl_gen_vllm.refit_reads import RefitReadCounter
from nrl_gen_vllm.released import released


def _prepare_worker_process() -> None:
    """What every process running a vLLM worker needs from nrl. vLLM imports this module in each
    of them, the async engine's core process included, where nrl runs no other code."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        use_eager_rank_count()
        rotate_three_dimensional_inputs_natively()
        run_ungated_experts()  # either order: the translation hands on local ids and no map
        translate_expert_ids()
        process_experts_on_reload()


_prepare_worker_process()

ROTARY_WARNING = "%s: Failed to load weights"


class RotaryCacheFilter(logging.Filter):
    """Drops vLLM's "<RotaryEmbedding>: Failed to load weights" warning, and only that one.

    vLLM's layerwise reload counts every tensor of a layer, buffers included, and when a layer
    receives none of them it warns and puts the layer's own tensors back. A rotary embedding's
    only tensor is ``cos_sin_cache``: a non-persistent buffer computed from the config when the
    engine starts, never in a checkpoint and never trained. So at every refit the warning fires
    (150 times in the demo) while the cache put back is exactly the one in use: nothing is lost.
    The same warning for any other layer still shows, since there it would mean missing weights.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        layer = str(record.args[0]) if isinstance(record.args, tuple) and record.args else ""
        return not (record.msg == ROTARY_WARNING and layer.endswith("RotaryEmbedding"))


def _quiet_rotary_reload_warning() -> None:
    from vllm.model_executor.model_loader.reload import layerwise

    reload_logger = logging.getLogger(layerwise.__name__)
    if not any(isinstance(f, RotaryCacheFilter) for f in reload_logger.filters):
        reload_logger.addFilter(RotaryCacheFilter())


def tied_names(model: torch.nn.Module) -> dict[str, list[str]]:
    """For an output layer tied to the input embedding, each of the two names to the other
    (``model.embed_tokens.weight`` <-> ``lm_head.weight``). Names are vLLM's, which for text models
    are the checkpoint's. Other shared tensors are vLLM's own aliases (a MoE layer's experts hold
    its router), not checkpoint names, and are left out."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return {name: [other for other in group if other != name] for group in groups.values()
            if len(group) > 1 and any(n.endswith("lm_head.weight") for n in group) for name in group}


def _file_part(path: str, layout: list[list[Any]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The tensors packed in ``path`` as one bucket of views of one mapping, yielded from a call so
    that nothing here keeps them."""
    yield _file_views(path, layout)


def _file_views(path: str, layout: list[list[Any]]) -> list[tuple[str, torch.Tensor]]:
    return views(torch.from_file(path, shared=True, size=size_of(layout), dtype=torch.uint8), layout)


def _device_part(handle: list[Any], layout: list[list[Any]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The tensors packed in a GPU buffer lent by CUDA IPC, as one bucket of views (see _file_part)."""
    yield views(open_lent_buffer(handle), layout)


def with_tied_names(named: Iterable[tuple[str, torch.Tensor]], ties: dict[str, list[str]],
                    done: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``named``, each tensor followed by the names tied to it, each name once.

    nrl's training backends send a tied weight once (their refit lists parameters, where a shared
    tensor appears once). The layerwise reload then sees no weights for the tied layer and puts
    its kernel tensors back without processing them; where that processing makes a second copy
    (vLLM's CPU GEMM packs the output layer's weight), the engine kept computing logits from the
    weights of before the refit. Sending the tensor under each of its names lets every layer load
    and process it.
    """
    done = set() if done is None else done  # names already loaded (by earlier parts of the same reload)
    for name, tensor in named:
        if name in done:  # the stream names a tied weight itself: already loaded with its source
            continue
        done.add(name)
        yield name, tensor
        for tied in ties.get(name, ()):
            if tied not in done:
                done.add(tied)
                yield tied, tensor
        del tensor  # not kept while the next arrives (released.py)


class NrlWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``model_runner``, ``vllm_config``)."""

    model_runner: Any
    vllm_config: Any
    model_config: Any

    @torch.no_grad()
    def nrl_load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load already-verified HF-named full tensors through vLLM's layerwise reload.

        The reload restores each layer to its checkpoint layout, buffers incoming weights until a
        layer is complete, runs the layer's post-load processing (fused QKV, quantization...) and
        copies the result into the existing kernel tensors, so CUDA graphs and the KV cache stay
        valid. Returns how many model parameters were loaded.
        """
        self.nrl_begin_reload()
        ok = False
        try:
            loaded = self.nrl_load_part(named)
            ok = True
        finally:  # a stream that failed part-way: the layers it never reached get their kernels back
            self.nrl_end_reload(ok)
        return loaded

    @torch.no_grad()
    def nrl_begin_reload(self) -> None:
        """Start a reload whose tensors come in parts (:meth:`nrl_load_part`, each part's tensors
        whole); :meth:`nrl_end_reload` ends it, also after a failure."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        _quiet_rotary_reload_warning()
        learns = getattr(self, "_nrl_learn_regions", False)
        counter = RefitReadCounter() if getattr(self, "_nrl_count_reads", False) or learns else None
        self._nrl_reload = {"counter": counter, "learns": learns, "done": set(),
                            "ties": tied_names(self.model_runner.model)}
        with set_current_vllm_config(self.vllm_config), reloading():
            initialize_layerwise_reload(self.model_runner.model)

    @torch.no_grad()
    def nrl_load_part(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load one part of the reload :meth:`nrl_begin_reload` started; how many parameters it loaded."""
        from vllm.config import set_current_vllm_config

        state = self._nrl_reload
        counter = state["counter"]
        model = self.model_runner.get_model()  # unwrapped: on a GPU the runner holds it in a CUDA-graph wrapper
        named = with_tied_names(named, state["ties"], state["done"])
        named = counter.track(named) if counter else iter(named)
        if direct_loads.takes_this_route(model):  # after the counter: a view's reads count for its tensor
            named = direct_loads.through_weight_loaders(named, model)
        with set_current_vllm_config(self.vllm_config), reloading(), counter or contextlib.nullcontext():
            loaded = model.load_weights(weights=named)
        return len(loaded) if loaded is not None else -1

    @torch.no_grad()
    def nrl_end_reload(self, succeeded: bool = True) -> None:
        """Finish the reload: the layers no part reached get their kernel tensors back. A reload
        that failed teaches no blocks."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        state = getattr(self, "_nrl_reload", None)
        if state is None:  # no reload began
            return
        self._nrl_reload = None
        counter = state["counter"]
        with set_current_vllm_config(self.vllm_config), reloading(), counter or contextlib.nullcontext():
            finalize_layerwise_reload(self.model_runner.model, self.model_config)
        if counter is not None:
            self._nrl_refit_reads = dict(counter.bytes_read)
            if state["learns"] and succeeded:
                self._nrl_refit_regions = {name: box for name, box in counter.regions.items() if box is not None}

    @torch.no_grad()
    def nrl_load_part_from_file(self, path: str, layout: list[list[Any]]) -> int:
        """:meth:`nrl_load_part` for an engine in another process (vLLM's async engine): the
        tensors lie packed in the file ``path`` (a ``/dev/shm`` file the caller removes), each at
        ``[name, dtype, shape, offset, nbytes]`` of ``layout``, and are read as views of one mapping."""
        # the tensors vLLM keeps past the part (a module it has not all of yet) get copies of their
        # own once it is loaded, so the mapping goes before the next part's (released.py)
        parts = released(_file_part(path, layout), files_end_with_the_bucket=True)
        return self.nrl_load_part(itertools.chain.from_iterable(parts))

    @torch.no_grad()
    def nrl_load_part_from_device(self, handle: list[Any], layout: list[list[Any]]) -> int:
        """:meth:`nrl_load_part_from_file` for a part the caller lent on this worker's GPU
        (``lend_device_buffer``): read as views of the buffer, no copy through host memory. The
        caller frees the buffer once this returns, so the loads finish first."""
        parts = released(_device_part(handle, layout))
        loaded = self.nrl_load_part(itertools.chain.from_iterable(parts))
        torch.cuda.current_stream().synchronize()
        return loaded

    def nrl_served_model(self) -> dict[str, Any]:
        """The model vLLM built, as a refit check needs it: its class, and the quantization method
        vLLM's loader dispatches on (the checkpoint's, after any overrides), or None."""
        model = self.model_runner.get_model()
        quantization = getattr(getattr(model, "config", None), "quantization_config", None) or {}
        method = quantization.get("quant_method") if isinstance(quantization, dict) else \
            getattr(quantization, "quant_method", None)
        return {"architecture": type(model).__name__, "quantization": method}

    def nrl_count_refit_reads(self, enabled: bool = True) -> None:
        """From the next refit on, count the bytes this rank reads of each tensor
        (:class:`~nrl_gen_vllm.refit_reads.RefitReadCounter`); :meth:`nrl_refit_reads` returns them."""
        self._nrl_count_reads = enabled
        self._nrl_refit_reads = {}

    def nrl_learn_refit_regions(self, enabled: bool = True) -> None:
        """From the next refit on, record the block of each tensor this rank's loaders read
        (:attr:`~nrl_gen_vllm.refit_reads.RefitReadCounter.regions`); :meth:`nrl_refit_regions`
        returns those of the last refit that loaded (learning anew forgets those learned before)."""
        self._nrl_learn_regions = enabled
        if enabled:
            self._nrl_refit_regions = {}

    def nrl_refit_regions(self) -> dict[str, list[list[int]]]:
        """``[start, stop]`` per dimension of each tensor read in part (a tensor read whole is left out)."""
        return dict(getattr(self, "_nrl_refit_regions", {}))

    def nrl_refit_reads(self) -> dict[str, int]:
        """Bytes of each tensor of the last counted refit (a failed one too) that this rank copied
        into its model."""
        return dict(getattr(self, "_nrl_refit_reads", {}))

    def nrl_experts_held(self) -> dict[str, list[int]]:
        """The global ids of the experts this worker holds, by MoE layer (vLLM's ``layer_name``,
        the checkpoint prefix of its experts), for the layers that split their experts over the
        ranks. A layer whose map is not by checkpoint expert (vLLM's load balancer places
        redundant copies; other placements route through physical ids) is left out, as if it held
        every expert: its rank then gets them all, as without partial import."""
        held = {}
        for module in self.model_runner.model.modules():
            expert_map = getattr(module, "_expert_map", None)
            name = getattr(module, "layer_name", None)
            parallel = getattr(getattr(module, "moe_config", None), "moe_parallel_config", None)
            if expert_map is None or not isinstance(name, str) or not getattr(module, "use_ep", False) \
                    or getattr(parallel, "enable_eplb", True) \
                    or getattr(module, "expert_global_to_physical", None) is not None \
                    or expert_map.numel() != getattr(module, "global_num_experts", -1):
                continue
            held[name] = [int(e) for e in torch.nonzero(expert_map >= 0).flatten().tolist()]
        return held

    def nrl_parameter_count(self) -> int:
        return sum(1 for _ in self.model_runner.model.parameters())

