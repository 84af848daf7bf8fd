"""The two vLLM engines a worker can drive, behind one small interface.

* :class:`SyncEngine`: ``vllm.LLM``, the engine core in this process. A batch of requests returns
  when all of them are done. It starts in seconds on CPU and takes refit tensors by reference.
* :class:`AsyncEngine` (``vllm_cfg.async_engine: true``): vLLM's ``AsyncLLM``, its engine core in a
  child process, driven here from synchronous code through an event loop in a daemon thread.
  Requests stream and finish independently, so :meth:`AsyncEngine.stream` hands back each group of
  samples as soon as its last sample is done (async GRPO scores rollouts as they complete). Refit
  tensors are copied to the engine process. A weight load may come from another thread while
  requests are in flight: the engine pauses between two of its steps, loads, labels the weights
  with their version (vLLM records, per request, which label sampled each token) and resumes; the
  requests in flight either keep their KV cache (computed with the old weights) or are recomputed
  with the new ones. At tensor parallel above 1 the engine core runs its workers with vLLM's own
  multiprocessing executor, all started from the engine's first rank.
* :class:`FollowerEngine`: the other ranks of such an engine. They hold its devices in the
  cluster's placement and answer every call with nothing; the first rank's engine does the work.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any


class SyncEngine:
    lora_request: Any = None  # the LoRA adapter every request runs with (adapter-only refit), if any
    use_tqdm = False  # vLLM's progress bar per batch (vllm_cfg.use_tqdm)
    streams_weights = True  # load_weights takes tensors as they arrive (the worker is in this process)

    def __init__(self, **engine_kwargs: Any) -> None:
        from vllm import LLM

        self.llm = LLM(**engine_kwargs)

    def generate(self, requests: Sequence[Any], params: Sequence[Any]) -> list[Any]:
        if not requests:
            return []
        return self.llm.generate(list(requests), list(params), use_tqdm=self.use_tqdm, lora_request=self.lora_request)

    def add_lora(self, request: Any) -> None:
        self.llm.llm_engine.add_lora(request)

    def stream(self, requests: Sequence[Any], params: Sequence[Any], group_size: int) -> Iterator[tuple[int, list[Any]]]:
        """Every group at once, when the whole batch is done (this engine returns batches whole)."""
        outputs = self.generate(requests, params)
        for g in range(0, len(outputs), group_size):
            yield g // group_size, outputs[g:g + group_size]

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return self.llm.collective_rpc(method, args=args)

    def load_weights(self, named: Iterable[tuple[str, Any]], version: int, in_flight: bool = False,
                     recompute_kv_cache: bool = False, part_bytes: int | None = None) -> None:
        """Hand the tensors to the worker extension by reference (same process; nothing is in
        flight between two calls of this engine), then drop the KV cached with the old weights.
        ``named`` may be a stream that is still arriving: the layerwise reload takes it lazily."""
        self.llm.collective_rpc("nrl_load_weights", args=(named,))
        self.llm.reset_prefix_cache()

    def reached(self) -> bool:
        """Whether the last :meth:`load_weights` got as far as the engine's weights: each tensor
        it took went straight to the loaders."""
        return True

    def label(self, version: int) -> None:
        """Every output of this engine is labelled with the version at its call."""

    def token_versions(self, seq: Any, version: int) -> list[int]:
        return [version] * len(seq.token_ids)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)

    def shutdown(self) -> None:
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()


class AsyncEngine:
    lora_request: Any = None
    streams_weights = True  # its workers run in another process: the tensors travel in parts

    def __init__(self, **engine_kwargs: Any) -> None:
        # one worker, on this process's GPU: parts of weights on the GPU stay there (_packed)
        workers = int(engine_kwargs.get("tensor_parallel_size") or 1) * int(engine_kwargs.get("pipeline_parallel_size") or 1)
        self._lends_device_buffers = workers == 1
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nrl-vllm-async", daemon=True)
        self._thread.start()
        self._requests = 0
        try:
            self.engine = self._run(self._build(engine_kwargs))
        except BaseException:
            self._stop_loop()
            raise

    async def _build(self, engine_kwargs: dict[str, Any]) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs))

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _request_ids(self, count: int) -> list[str]:
        start, self._requests = self._requests, self._requests + count
        return [f"nrl-{start + i}" for i in range(count)]

    async def _one(self, request: Any, params: Any, request_id: str) -> Any:
        final = None
        async for output in self.engine.generate(request, params, request_id=request_id,
                                                 lora_request=self.lora_request):
            final = output
        return final

    def generate(self, requests: Sequence[Any], params: Sequence[Any]) -> list[Any]:
        async def all_of() -> list[Any]:
            ids = self._request_ids(len(requests))
            return list(await asyncio.gather(*(self._one(r, p, i) for r, p, i in zip(requests, params, ids))))

        return self._run(all_of()) if requests else []

    def stream(self, requests: Sequence[Any], params: Sequence[Any], group_size: int) -> Iterator[tuple[int, list[Any]]]:
        """``(group index, outputs)`` for each ``group_size`` consecutive requests, in the order the
        groups finish."""
        done: queue.Queue[tuple[int, Any]] = queue.Queue()
        ids = self._request_ids(len(requests))

        async def one(index: int) -> None:
            try:
                done.put((index, await self._one(requests[index], params[index], ids[index])))
            except BaseException as exc:  # handed to the consuming thread, which raises it
                done.put((index, exc))

        for index in range(len(requests)):
            asyncio.run_coroutine_threadsafe(one(index), self._loop)
        pending: dict[int, dict[int, Any]] = {}
        for _ in range(len(requests)):
            index, output = done.get()
            if isinstance(output, BaseException):
                raise output
            group = pending.setdefault(index // group_size, {})
            group[index % group_size] = output
            if len(group) == group_size:
                del pending[index // group_size]
                yield index // group_size, [group[j] for j in range(group_size)]

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return self._run(self.engine.collective_rpc(method, args=args))

    def add_lora(self, request: Any) -> None:
        self._run(self.engine.add_lora(request))

    def load_weights(self, named: Iterable[tuple[str, Any]], version: int, in_flight: bool = False,
                     recompute_kv_cache: bool = False, part_bytes: int | None = None) -> None:
        """The engine runs in another process, and vLLM's RPC encoding does not carry tensors in a
        list of pairs: the tensors go in parts of about ``part_bytes`` (the refit's bucket; kept
        within :data:`PART_BYTES`, and a larger tensor is a part of its own), each packed into one
        ``/dev/shm`` file the engine's workers map and load before the next part is written (one
        layerwise reload spans the parts). A part's space is reserved before its first byte: a
        ``/dev/shm`` too small is one line, not a SIGBUS mid-copy. A part on a GPU, for an engine
        whose one worker runs on that GPU, is packed on the device instead and lent to the worker
        by CUDA IPC handle (``lend_device_buffer``), with no copy through host memory. The weights
        get ``version`` as their label. ``named`` may be a stream that is still arriving.

        ``in_flight``: requests may be running, so the load lands between two engine steps: the
        scheduler pauses keeping its requests, the parts load, and it resumes (as NeMo RL's
        in-flight updates, the pause spans the transfer). A refit that fails after a part loaded
        leaves the scheduler paused, so no request takes a token from torn weights, until a refit
        succeeds and resumes it. ``recompute_kv_cache`` then preempts the requests in flight and
        resets the prefix cache, so their next tokens are computed from a KV cache of the new
        weights; otherwise they keep the KV their earlier tokens left (requests are salted with
        their start version, so no later request reuses those blocks), and the prefix cache is
        reset once no request holds blocks."""
        self.parts_loaded = 0
        low, high = PART_BYTES
        parts = _parts(named, min(max(part_bytes or high, low), high))
        begun = succeeded = False
        try:
            for part in parts:
                with _packed(part, self._lends_device_buffers) as (method, where, layout):
                    if not begun:
                        begun = True
                        self._run(self._begin(in_flight, recompute_kv_cache))
                    self.parts_loaded += 1
                    self._run(self.engine.collective_rpc(method, args=(where, layout)))
            succeeded = True
        finally:
            if begun:
                self._run(self._end(succeeded, version, in_flight, recompute_kv_cache))
        if not begun:  # nothing to load: the weights are still the new version
            self.label(version)

    def reached(self) -> bool:
        """Whether the last :meth:`load_weights` got as far as the engine's weights."""
        return self.parts_loaded > 0

    async def _begin(self, in_flight: bool, recompute_kv_cache: bool) -> None:
        if in_flight:
            try:
                await self.engine.pause_generation(mode="keep", clear_cache=recompute_kv_cache)
            except BaseException:
                await self.engine.resume_generation()  # resuming after a failed pause is harmless
                raise
        await self.engine.collective_rpc("nrl_begin_reload")

    async def _end(self, succeeded: bool, version: int, in_flight: bool, recompute_kv_cache: bool) -> None:
        try:
            await self.engine.collective_rpc("nrl_end_reload", args=(succeeded,))
            if succeeded:
                if not (in_flight and recompute_kv_cache):
                    await self.engine.reset_prefix_cache()  # cached KV was computed with the old weights
                await self.engine.update_weight_version(str(version))
        finally:
            if in_flight and (succeeded or not self.parts_loaded):  # torn: paused until a refit succeeds
                await self.engine.resume_generation()

    def label(self, version: int) -> None:
        """Label the weights the engine holds now (vLLM tags each sampled token with it)."""
        self._run(self.engine.update_weight_version(str(version)))

    @staticmethod
    def token_versions(seq: Any, version: int) -> list[int]:
        """Each token's version from vLLM's spans (set on a request's final output); ``version``
        (the one at the request's start) for all of them when the engine reported none."""
        spans = getattr(seq, "weight_versions", None) or []
        versions = [int(span.version) for span in spans for _ in range(span.start, span.end)]
        # a stop string may have cut tokens off the end after the spans were counted
        n = len(seq.token_ids)
        return versions[:n] if len(versions) >= n else [version] * n

    def reset_prefix_cache(self) -> None:
        self._run(self.engine.reset_prefix_cache())

    def sleep(self, level: int) -> None:
        self._run(self.engine.sleep(level))

    def wake_up(self, tags: list[str]) -> None:
        self._run(self.engine.wake_up(tags))

    def shutdown(self) -> None:
        import gc

        engine, self.engine = self.engine, None
        try:
            engine.shutdown()
        finally:
            del engine
            gc.collect()  # AsyncLLM.__del__ shuts down again; let it run while its modules still exist
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


class FollowerEngine:
    lora_request: Any = None
    streams_weights = False

    def generate(self, requests: Sequence[Any], params: Sequence[Any]) -> list[Any]:
        return []

    def stream(self, requests: Sequence[Any], params: Sequence[Any], group_size: int) -> Iterator[tuple[int, list[Any]]]:
        return iter(())

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return []

    def load_weights(self, named: Iterable[tuple[str, Any]], version: int, in_flight: bool = False,
                     recompute_kv_cache: bool = False, part_bytes: int | None = None) -> None:
        """The first rank's engine loads them into every worker."""

    def label(self, version: int) -> None: ...

    def reached(self) -> bool:
        return False

    def token_versions(self, seq: Any, version: int) -> list[int]:
        return []

    def add_lora(self, request: Any) -> None:
        """Likewise."""

    def reset_prefix_cache(self) -> None: ...

    def sleep(self, level: int) -> None: ...

    def wake_up(self, tags: list[str]) -> None: ...

    def shutdown(self) -> None: ...


PART_BYTES = (16 * 2**20, 256 * 2**20)
"""The least and the most the async engine loads at a time: each RPC and file costs a few
milliseconds, and a part is whole tensors, so one larger tensor is a part of its own."""


def _parts(named: Iterable[tuple[str, Any]], part_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """``named`` in parts of at most ``part_bytes`` that end where a layer ends when the next would
    not fit (``iter_buckets``): a layer split over two parts makes the engine copy out its first
    half before the second part's file is mapped."""
    from nrl_core.api import iter_buckets

    return iter_buckets(named, part_bytes)


@contextlib.contextmanager
def _packed(part: list[tuple[str, Any]], lend_device: bool) -> Iterator[tuple[str, Any, list[list[Any]]]]:
    """``part`` packed where its reader takes it: the worker's method that loads it, the buffer's
    handle or file, and the layout. On the GPU when every tensor is there and the engine's one
    worker shares the GPU (``lend_device``), else in a ``/dev/shm`` file."""
    if lend_device and part and all(getattr(tensor, "is_cuda", False) for _, tensor in part):
        with _packed_on_device(part) as (handle, layout):
            yield "nrl_load_part_from_device", handle, layout
    else:
        with _packed_file(part) as (path, layout):
            yield "nrl_load_part_from_file", path, layout


@contextlib.contextmanager
def _packed_file(part: list[tuple[str, Any]]) -> Iterator[tuple[str, list[list[Any]]]]:
    """``part`` packed into a fresh ``/dev/shm`` file (its space reserved first), removed on exit;
    the file's path and each tensor's ``[name, dtype, shape, offset, nbytes]``."""
    import torch

    from nrl_core.api import shared_file
    from nrl_gen_vllm.part_layout import layout_of, pack

    layout, total = layout_of(part)
    with shared_file(total, "nrl-async-refit-", "the async engine's refit") as path:
        data = torch.from_file(path, shared=True, size=max(total, 1), dtype=torch.uint8)
        pack(data, part, layout)
        del data
        yield path, layout


@contextlib.contextmanager
def _packed_on_device(part: list[tuple[str, Any]]) -> Iterator[tuple[list[Any], list[list[Any]]]]:
    """``part`` packed into one buffer on its GPU, lent by CUDA IPC handle until the worker has
    loaded it; the handle and the layout."""
    import torch

    from nrl_core.api import collect_lent_buffers, lend_device_buffer
    from nrl_gen_vllm.part_layout import layout_of, pack

    layout, total = layout_of(part)
    data = torch.empty(max(total, 1), dtype=torch.uint8, device=part[0][1].device)
    pack(data, part, layout)
    torch.cuda.current_stream(data.device).synchronize()  # every byte written before the worker reads
    try:
        yield lend_device_buffer(data), layout
    finally:
        del data
        collect_lent_buffers()
