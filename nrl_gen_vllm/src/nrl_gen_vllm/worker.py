"""``VllmGenerationWorker``: rollouts through ``vllm.LLM`` and verified weight refits.

The engine runs in this process (on CPU ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the only mode that
starts in seconds); a Ray actor hosts the worker when generation is not colocated. Weights arrive
as HF-named buckets (see :mod:`nrl_core.refit`); they are staged and checked against the manifest
*before* the engine is touched, so a bad refit leaves the engine generating with its old weights.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from nrl_core.api import (
    Bucket,
    ConfigError,
    GenerationOutput,
    NrlError,
    RefitError,
    SamplingState,
    SleepState,
    TornRefitError,
    WeightSpec,
    dtype_name,
    has_recurrent_layers,
    local_model_config,
    parse_dtype,
    resolve_precision,
    spec_of,
    verified_stream,
)
from nrl_core.api import environment_variables as environment
from nrl_core.api import timeline_mark as mark
from nrl_core.api import verify_manifest as verify
from nrl_gen_vllm import cpu_shm
from nrl_gen_vllm.checkpoint import check_against_checkpoint, check_reloadable, checkpoint_shapes
from nrl_gen_vllm.checks import check_cpu_engine_kwargs, cpu_model_note, engine_start_error
from nrl_gen_vllm.cpu_sampler import use_eager_rank_count
from nrl_gen_vllm.engine_args import user_engine_kwargs
from nrl_gen_vllm.engines import AsyncEngine, FollowerEngine, SyncEngine
from nrl_gen_vllm.kv_cache import KvCacheSize, kv_cache_space
from nrl_gen_vllm.partial import experts_elsewhere, sliced_wants
from nrl_gen_vllm.placement import compile_caches_per_cpu_pins, engine_placement, without_ahead_of_time_compilation
from nrl_gen_vllm.released import released
from nrl_gen_vllm.sampling import VllmSampling, base_seed
from nrl_gen_vllm.threads import keep_process_threads

logger = logging.getLogger(__name__)

EXTENSION = "nrl_gen_vllm.extension.NrlWorkerExtension"
ADAPTER_NAME, ADAPTER_ID = "nrl-policy", 1  # the one LoRA adapter an adapter-serving engine holds
_FINISH = {"stop": "stop", "length": "length"}


def _configure_environment() -> None:
    """vLLM's in-process engine core: it starts in seconds on CPU, keeps tensors handed to
    ``collective_rpc`` by reference, and is what the ``external_launcher`` executor requires.
    No ahead-of-time compilation, and compile caches of their own under pinned CPU code paths
    (:mod:`~nrl_gen_vllm.placement`)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    compile_caches_per_cpu_pins()
    warning = without_ahead_of_time_compilation()
    if warning:
        logger.warning(warning)


def _distributed_engine(tp: int, rank: int, world_size: int) -> bool:
    """Whether this engine joins the process's torch.distributed world through vLLM's
    ``external_launcher`` executor (see :class:`VllmGenerationWorker`), checking that the world
    is one the engines can tile."""
    import torch.distributed as dist

    joined = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not joined:
        if tp > 1:
            raise NrlError(f"policy.generation.vllm_cfg.tensor_parallel_size: {tp} needs a process group of {tp} ranks "
                           "around the engine; nrl's generation worker groups form one (build engines through them)")
        return False
    if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        raise NrlError(f"vLLM worker built as rank {rank}/{world_size} inside process-group rank "
                       f"{dist.get_rank()}/{dist.get_world_size()}")
    if world_size % tp:
        raise ConfigError("policy.generation.vllm_cfg.tensor_parallel_size",
                          f"{tp} does not divide the {world_size} ranks that host the engines")
    return True


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


class VllmGenerationWorker:
    """One rank of a vLLM engine built from ``policy.model_name`` (a local HF checkpoint directory).

    ``config`` is the whole validated nrl config as a plain dict; generation settings come from
    ``policy.generation`` and engine settings from ``policy.generation.vllm_cfg``.

    Alone in its process (``world_size`` 1) the engine is vLLM's single-process one. Inside a
    process that belongs to a ``torch.distributed`` world (colocated in training actors, or a
    generation group of several ranks) it joins that world through vLLM's ``external_launcher``
    executor: every ``tensor_parallel_size`` consecutive ranks form one engine, and the engines are
    independent ("external data parallel"), each serving its own prompts. Every rank of a world
    must construct its engine at the same time (vLLM creates its groups collectively), and every
    rank of one engine must get the same prompts.
    """

    lazy_imports = ("vllm.entrypoints.llm",)  # vllm.LLM, imported when the engine starts

    def __init__(self, config: Mapping[str, Any], rank: int = 0, world_size: int = 1) -> None:
        policy = config["policy"]
        generation = policy.get("generation") or {}
        vcfg = generation.get("vllm_cfg") or {}
        self.rank = rank
        self.world_size = world_size
        self.tp = int(vcfg.get("tensor_parallel_size") or 1)
        if int(vcfg.get("pipeline_parallel_size") or 1) != 1:
            raise ConfigError("policy.generation.vllm_cfg.pipeline_parallel_size",
                              "nrl-gen-vllm runs engines without pipeline parallelism; use tensor_parallel_size")
        self.engine_index = rank // self.tp
        self._sampling = VllmSampling.from_generation(generation)
        # a validated run config says "dummy" (the core then refits before the first generation);
        # a worker built from a bare config reads the checkpoint, as the contract's default
        self.load_format = str(vcfg.get("load_format") or "auto")
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError("policy.generation.vllm_cfg.load_format",
                              f"must be 'dummy' or 'auto', got {self.load_format!r}")
        # adapter-only refit: the engine reads the base model itself and applies the adapters it gets
        self.serves_adapters = bool((policy.get("refit") or {}).get("adapters"))
        self.max_lora_rank = int(vcfg.get("max_lora_rank") or 64)
        self._adapter_dir: str | None = None
        if self.serves_adapters:
            self.load_format = "auto"
        self._state = SamplingState(seed=base_seed(config), weight_version=-1 if self.load_format == "dummy" else 0)
        self._torn: str | None = None  # why the weights are a mix of versions (a pipelined refit failed part-way)
        self._sleep = SleepState(f"vLLM engine {self.engine_index}")
        self.model_dir = str(policy["model_name"])
        precision = vcfg.get("precision") or resolve_precision(policy.get("precision"))
        self.dtype = "auto" if precision == "auto" else dtype_name(parse_dtype(precision))
        self.max_model_len = int(vcfg.get("max_model_len") or policy.get("max_total_sequence_length") or 512)
        self.sleep_level = int(vcfg.get("sleep_level") or 1)
        self._checkpoint = checkpoint_shapes(self.model_dir)
        self._served: dict[str, Any] | None = None  # what vLLM built, asked at the first refit (_check_layout)

        self.async_engine = bool(vcfg.get("async_engine"))
        if self.async_engine:
            # its child process loads refits from /dev/shm parts, so weights received onto a GPU
            # here would only be a second copy there: the refit rule keeps to host memory
            self.refit_device = "cpu"
        self.kv_cache: KvCacheSize | None = None  # on CPU, unless VLLM_CPU_KVCACHE_SPACE sets it
        _configure_environment()
        from vllm.platforms import current_platform

        engine_kwargs: dict[str, Any] = {}
        cache_dtype = str(vcfg.get("kv_cache_dtype") or "auto")
        if _is_cpu():
            use_eager_rank_count()
            # A prompt prefilled in chunks has its sampled token discarded and its seeded generator
            # rewound, which CPU generators cannot do: whole prompts only (vLLM does the same for MLA).
            engine_kwargs["enable_chunked_prefill"] = False
            engine_kwargs["max_num_batched_tokens"] = max(self.max_model_len, 8192)
            check_cpu_engine_kwargs(generation.get("vllm_kwargs"))
            hf_config = local_model_config(config)
            if hf_config is not None:
                if (note := cpu_model_note(hf_config)) is not None:
                    logger.warning(note)
                if has_recurrent_layers(hf_config):  # vLLM caches their prefixes only in chunked prefill's steps
                    engine_kwargs["enable_prefix_caching"] = False
        if _is_cpu() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            self.kv_cache = kv_cache_space(config, max_model_len=self.max_model_len, tensor_parallel_size=self.tp,
                                           engines=max(1, world_size // self.tp), dtype=self.dtype,
                                           cache_dtype=cache_dtype)
            logger.info("vLLM engine %d: KV cache %s", self.engine_index, self.kv_cache.describe())
            engine_kwargs["kv_cache_memory_bytes"] = self.kv_cache.nbytes
        colocated = bool((generation.get("colocated") or {}).get("enabled"))
        self.follower = spawns_workers = external_launcher = False
        if self.async_engine and self.tp > 1:
            # vLLM's own executor starts the engine's tp workers from its first rank, on the devices
            # of the engine's ranks (colocated: the training ranks'); the other ranks hold their
            # place and follow
            engine_kwargs["distributed_executor_backend"] = "mp"
            spawns_workers, self.follower = True, rank % self.tp != 0
        elif _distributed_engine(self.tp, rank, world_size):
            engine_kwargs["distributed_executor_backend"] = "external_launcher"
            external_launcher = True
            if _is_cpu():
                cpu_shm.use_unique_names()
        if int(vcfg.get("expert_parallel_size") or 1) > 1:  # the engine's ranks split the experts
            engine_kwargs["enable_expert_parallel"] = True
        if self.serves_adapters:
            engine_kwargs.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=1)
        engine_kwargs.update(user_engine_kwargs(config, engine_kwargs))
        # Sleep mode frees the engine's memory for training between generations (colocated only);
        # vLLM offers it on GPUs, where it also needs its own allocator.
        self.sleep_mode = colocated and current_platform.is_sleep_mode_available()
        placement = engine_placement(rank, self.tp, spawns_workers=spawns_workers, external_launcher=external_launcher,
                                     sleep_mode=self.sleep_mode)
        engine_kwargs = {**placement.engine_kwargs, **engine_kwargs}  # what the recipe sets wins
        for warning in placement.warnings:
            logger.warning("vLLM engine %d: %s", self.engine_index, warning)
        placement.apply_allocator_settings()
        tokenizer = (policy.get("tokenizer") or {}).get("name") or self.model_dir
        start = time.perf_counter()
        mark("vllm_engine_start", rank=rank)
        try:
            with keep_process_threads(), environment(placement.env):
                self._engine = FollowerEngine() if self.follower else (AsyncEngine if self.async_engine else SyncEngine)(
                    model=self.model_dir,
                    tokenizer=tokenizer,
                    dtype=self.dtype,
                    seed=self._state.seed,
                    max_model_len=self.max_model_len,
                    tensor_parallel_size=self.tp,
                    gpu_memory_utilization=float(vcfg.get("gpu_memory_utilization") or 0.6),
                    enforce_eager=bool(vcfg.get("enforce_eager")),
                    trust_remote_code=bool(policy.get("trust_remote_code")),
                    worker_extension_cls=EXTENSION,
                    enable_sleep_mode=self.sleep_mode,
                    # the sampled token's logprob after temperature (and top-k/top-p), i.e. under the
                    # distribution it was drawn from, which the policy's logprobs reproduce (temperature)
                    logprobs_mode="processed_logprobs",
                    load_format=self.load_format,
                    kv_cache_dtype=cache_dtype,
                    **engine_kwargs,
                )
        except Exception as exc:  # vLLM refuses some config values only when the engine starts
            refused = engine_start_error(exc, config, cpu=_is_cpu())
            if refused is None:
                raise
            raise refused from None
        self._engine.label(self._state.weight_version)
        self._engine.use_tqdm = bool(vcfg.get("use_tqdm"))
        self._elsewhere = self._experts_elsewhere(engine_kwargs.get("enable_expert_parallel", False))
        # a rank of a tensor-parallel engine learns its blocks from its first refit (partial.py)
        self._learns_blocks = self.tp > 1 and not self.async_engine and not self.follower
        self._blocks: dict[str, Any] | None = None
        if self._learns_blocks:
            self._engine.collective_rpc("nrl_learn_refit_regions", args=(True,))
        self.in_flight = self.recompute_kv_cache = False  # configure_in_flight sets them
        mark("vllm_engine_ready", rank=rank, tensor_parallel=self.tp, follower=self.follower)
        if self.follower:
            logger.info("vLLM async engine %d: rank %d holds its place (the engine's first rank runs its %d workers)",
                        self.engine_index, rank, self.tp)
        else:
            logger.info("vLLM %sengine %d (rank %d of %d, tensor parallel %d) for %s ready in %.1f s",
                        "async " if self.async_engine else "", self.engine_index, rank, world_size, self.tp,
                        self.model_dir, time.perf_counter() - start)

    # ------------------------------------------------------------------ generation

    @property
    def llm(self) -> Any:
        """The ``vllm.LLM`` behind a synchronous engine (benchmarks and tests reach vLLM through it)."""
        return self._engine.llm

    @property
    def weight_version(self) -> int:
        """0 for the checkpoint's weights, +1 for every successful :meth:`import_weights`; -1 while
        an engine built with ``load_format: dummy`` holds only placeholder weights."""
        return self._state.weight_version

    @property
    def calls(self) -> int:
        """How many :meth:`generate` calls this worker served (part of every request's seed)."""
        return self._state.calls

    def sampling_state(self) -> dict[str, int]:
        """What, with the weights, determines the next samples (and the version label the next refit
        continues from): save it with a checkpoint."""
        return self._state.as_dict()

    def load_sampling_state(self, state: Mapping[str, int]) -> None:
        """Restore :meth:`sampling_state` so the next calls repeat the saved run's samples."""
        self._state.load(state)
        self._engine.label(self._state.weight_version)  # the version the engine reports per token

    def generate(self, prompts: list[list[int]], *, greedy: bool = False) -> GenerationOutput:
        """Complete each prompt (token ids); per-request seeds make the samples reproducible."""
        requests, params = self._requests(prompts, greedy)
        version = self._state.weight_version
        return self._output(self._engine.generate(requests, params), version)

    def generate_groups(self, prompts: list[list[int]], group_size: int, *,
                        greedy: bool = False) -> Iterator[tuple[int, GenerationOutput]]:
        """``group_size`` samples of each prompt, yielded as ``(prompt index, output)`` when the
        group's last sample is done (the async engine finishes groups independently; the sync one
        returns them together). Sample ``j`` of prompt ``i`` gets the seed that position
        ``i * group_size + j`` gets from :meth:`generate` over the repeated prompts, so both sample
        the same tokens."""
        repeated = [prompt for prompt in prompts for _ in range(group_size)]
        requests, params = self._requests(repeated, greedy)
        version = self._state.weight_version
        for index, outputs in self._engine.stream(requests, params, group_size):
            yield index, self._output(outputs, version)

    def configure_in_flight(self, recompute_kv_cache: bool) -> None:
        """In-flight weight updates (capability ``in_flight_updates``): :meth:`import_weights` may
        now come from another thread while :meth:`generate_groups` streams. The load pauses the
        async engine between two steps; ``recompute_kv_cache`` says whether the requests in flight
        then recompute their KV cache with the new weights (NeMo RL's
        ``recompute_kv_cache_after_weight_updates``) or keep the one the old weights left."""
        if not self.async_engine:
            raise ConfigError("policy.generation.vllm_cfg.async_engine",
                              "must be true for in-flight weight updates: vLLM's synchronous engine returns a batch "
                              "whole, so a refit can only land between batches")
        self.in_flight, self.recompute_kv_cache = True, bool(recompute_kv_cache)

    def _requests(self, prompts: list[list[int]], greedy: bool) -> tuple[list[Any], list[Any]]:
        from vllm.inputs import TokensPrompt

        self._sleep.require_awake("generate")
        if self._torn is not None:
            raise TornRefitError(f"vLLM engine {self.engine_index}: generate with torn weights: {self._torn}; "
                                 "the next refit that succeeds restores them")
        if self._state.weight_version < 0:
            raise NrlError(f"vLLM engine {self.engine_index}: generate before any weights were loaded "
                           "(vllm_cfg.load_format: dummy starts with placeholders); import_weights first, "
                           "or set load_format: auto to read the checkpoint")
        call = self._state.next_call()
        requests, params = [], []
        for i, prompt in enumerate(prompts):
            room = self.max_model_len - len(prompt)
            if room <= 0:
                raise NrlError(f"prompt {i} has {len(prompt)} tokens, no room to generate within max_model_len "
                               f"{self.max_model_len}; raise policy.max_total_sequence_length or shorten prompts")
            request = TokensPrompt(prompt_token_ids=list(prompt))
            if self.in_flight:  # a prefix cached under older weights never serves a later request
                request["cache_salt"] = f"nrl-v{self._state.weight_version}"
            requests.append(request)
            params.append(self._sampling.params(max_tokens=min(self._sampling.max_new_tokens, room),
                                                seed=self._state.seed_for(self.engine_index, call, i),
                                                greedy=greedy))
        return requests, params

    def _output(self, outputs: list[Any], start: int) -> GenerationOutput:
        """``start``: the weights' version when the requests started; each token's own version
        comes from the engine, so a response a refit reached mid-generation names both."""
        token_ids, logprobs, reasons, versions = [], [], [], []
        for out in outputs:
            seq = out.outputs[0]
            ids = list(seq.token_ids)
            token_ids.append(ids)
            logprobs.append([float(seq.logprobs[t][tok].logprob) for t, tok in enumerate(ids)] if seq.logprobs else [])
            reasons.append(_FINISH.get(seq.finish_reason or "", "stop"))
            versions.append(self._engine.token_versions(seq, start))
        oldest = min((v for per_token in versions for v in per_token), default=start)
        return GenerationOutput(token_ids=token_ids, logprobs=logprobs, finish_reasons=reasons,
                                weight_version=min(oldest, start), token_weight_versions=versions)

    # ------------------------------------------------------------------ refit

    def _experts_elsewhere(self, expert_parallel: bool) -> frozenset[str]:
        """The checkpoint's tensors of experts other ranks hold: what this rank never loads. The
        async engine's first rank loads for every worker of its engine, so nothing is elsewhere."""
        if not expert_parallel or self.async_engine or self.follower:
            return frozenset()
        (held,) = self._engine.collective_rpc("nrl_experts_held")
        return experts_elsewhere(self._checkpoint, held)

    def refit_wants(self, manifest: list[WeightSpec]) -> list[str]:
        """What this rank loads of a refit (contract 14, ``partial_import``): under expert
        parallelism all but the other ranks' experts; nothing on an async engine's other ranks,
        whose first rank loads for the whole engine. The manifest is checked against the engine's
        checkpoint first, so a wrong one is refused before anything is sent."""
        check_against_checkpoint(manifest, self._checkpoint, self.model_dir)
        if self.follower:
            return []
        wanted = [spec.name for spec in manifest if spec.name not in self._elsewhere]
        return sliced_wants(manifest, wanted, self._learned_blocks()) if self._learns_blocks else wanted

    def _learned_blocks(self) -> dict[str, Any]:
        """The blocks this rank's loaders read at its first refit (empty before it); learning stops
        once they are known."""
        if self._blocks is None:
            (learned,) = self._engine.collective_rpc("nrl_refit_regions")
            if learned:
                self._blocks = learned
                self._engine.collective_rpc("nrl_learn_refit_regions", args=(False,))
        return self._blocks or {}

    def _forget_blocks(self) -> None:
        """After a failed refit (one whose loaders read outside a block, among others): the next
        refit comes whole, and the blocks are learned again from it."""
        if self._learns_blocks and self._blocks is not None:
            self._blocks = None
            self._engine.collective_rpc("nrl_learn_refit_regions", args=(True,))

    def _check_layout(self, manifest: list[WeightSpec]) -> None:
        """:func:`check_against_checkpoint` against what this rank loads when ``manifest`` is its
        part (:meth:`refit_wants`), else against the whole checkpoint."""
        if self._served is None:
            served = self._engine.collective_rpc("nrl_served_model")
            self._served = served[0] if served else {}  # a follower's engine answers nothing: its first rank's checks
        check_reloadable(self._served)
        names = {spec.name for spec in manifest}
        if self.follower and not names:
            return
        part = self._checkpoint
        if self._elsewhere and not names & self._elsewhere:
            part = {name: shape for name, shape in self._checkpoint.items() if name not in self._elsewhere}
        check_against_checkpoint(manifest, part, self.model_dir)

    def import_weights(self, buckets: Iterable[Bucket], manifest: list[WeightSpec]) -> int:
        """Stage every bucket, prove it matches ``manifest`` (and this engine's checkpoint layout),
        then load it through vLLM's layerwise reload. Returns the new weight version.

        On any mismatch raises :class:`~nrl_core.refit.manifest.RefitError` naming the keys, and
        the engine keeps its previous weights (nothing was loaded yet).
        """
        self._sleep.require_awake("import_weights", ("weights",))
        self._check_layout(manifest)  # before any bucket is taken
        staged: list[tuple[str, Any]] = [item for bucket in buckets for item in bucket]
        verify([spec_of(name, tensor) for name, tensor in staged], manifest)
        version = self._state.weight_version + 1
        try:  # the engine drops the KV cached with the old weights (in flight: as configure_in_flight says)
            self._engine.load_weights(staged, version, self.in_flight, self.recompute_kv_cache)
        except Exception as exc:
            self._forget_blocks()
            if not self._engine.reached():  # refused before loading (the async engine's /dev/shm space)
                raise
            # checked before loading, so a loader failed part-way: the weights are a mix
            self._torn = f"the refit to version {version} failed while loading ({exc})"
            raise TornRefitError(f"vLLM engine {self.engine_index}: {self._torn}") from exc
        del staged
        self._torn = None
        self._state.weight_version = version
        return version

    def import_weights_pipelined(self, buckets: Iterable[Bucket], manifest: list[WeightSpec]) -> int:
        """Load each tensor as it arrives (contract 13, ``pipelined_import``), so the engine loads
        bucket k while the training side exports bucket k+1. ``manifest`` is checked against this
        engine's checkpoint layout before anything loads, each tensor against ``manifest`` before
        it loads. A failure after the first tensor reached the engine leaves it torn: it raises
        :class:`TornRefitError` here and at every generate until a refit succeeds (each rank of a
        tensor-parallel engine keeps its own state: a torn refit ends the run). The async
        engine, whose workers live in another process, takes the stream in parts the size of its
        first bucket (within ``engines.PART_BYTES``). In flight, the engine pauses its requests
        for the whole import; one that fails part-way leaves them paused, so no token comes from
        torn weights, until a refit succeeds."""
        if not self._engine.streams_weights:
            return self.import_weights(buckets, manifest)
        self._sleep.require_awake("import_weights", ("weights",))
        self._check_layout(manifest)
        version = self._state.weight_version + 1
        handed = 0

        def counted(stream: Iterable[Bucket]) -> Iterator[tuple[str, Any]]:
            nonlocal handed
            for item in verified_stream(stream, manifest):
                handed += 1
                yield item
                del item  # kept past the yield, it would keep its bucket's buffer while the next arrives

        try:
            stream = released(buckets)
            first = next(stream, [])  # the async engine loads in parts of about a bucket
            part_bytes = sum(tensor.numel() * tensor.element_size() for _, tensor in first)
            stream = itertools.chain([first], stream)
            del first
            self._engine.load_weights(counted(stream), version, self.in_flight, self.recompute_kv_cache,
                                      part_bytes=part_bytes)
        except BaseException as exc:
            self._forget_blocks()
            if handed == 0 or not self._engine.reached():  # nothing reached the engine: it holds what it held
                if isinstance(exc, Exception) and (not isinstance(exc, RefitError) or isinstance(exc, TornRefitError)):
                    raise RefitError(f"vLLM engine {self.engine_index}: refit rejected, weights unchanged; {exc}") from exc
                raise
            self._torn = (f"the pipelined refit to version {version} failed after {handed} of {len(manifest)} "
                          f"tensors reached the engine ({exc})")
            if isinstance(exc, TornRefitError) or not isinstance(exc, Exception):
                raise
            raise TornRefitError(f"vLLM engine {self.engine_index}: {self._torn}") from exc
        self._torn = None
        self._state.weight_version = version
        return version

    def import_adapter(self, buckets: Iterable[Bucket], manifest: list[WeightSpec],
                       adapter_config: Mapping[str, Any]) -> int:
        """Adapter-only refit (contract 9): stage the LoRA tensors, prove they match ``manifest``,
        write them as a PEFT adapter directory and load it in place of the previous one
        (``LoRARequest(load_inplace=True)``); every later request runs with it. The engine's base
        weights stay as read from ``policy.model_name``. Returns the new weight version."""
        import json
        import shutil
        import tempfile

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if not self.serves_adapters:
            raise RefitError(f"vLLM engine {self.engine_index}: import_adapter on an engine built without LoRA; "
                             "set policy.refit.adapters: true")
        self._sleep.require_awake("import_adapter", ("weights",))
        rank = int(adapter_config.get("r") or 0)
        if rank > self.max_lora_rank:
            raise RefitError(f"vLLM engine {self.engine_index}: the adapter's rank {rank} exceeds "
                             f"policy.generation.vllm_cfg.max_lora_rank={self.max_lora_rank}; raise it")
        staged: list[tuple[str, Any]] = [item for bucket in buckets for item in bucket]
        verify([spec_of(name, tensor) for name, tensor in staged], manifest)
        if self.follower:  # the engine's first rank loads it into every worker
            self._state.weight_version += 1
            return self._state.weight_version
        directory = tempfile.mkdtemp(prefix="nrl-lora-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            save_file({name: tensor.detach().contiguous().cpu() for name, tensor in staged},
                      os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})
            with open(os.path.join(directory, "adapter_config.json"), "w") as f:
                json.dump(dict(adapter_config), f)
            self._engine.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, directory, load_inplace=True))
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        del staged
        self._engine.lora_request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, directory)
        previous, self._adapter_dir = self._adapter_dir, directory
        if previous:
            shutil.rmtree(previous, ignore_errors=True)
        self._engine.reset_prefix_cache()  # cached KV was computed with the old adapter
        self._state.weight_version += 1
        self._engine.label(self._state.weight_version)
        return self._state.weight_version

    # ------------------------------------------------------------------ memory hand-off (colocated)

    def finish_generation(self) -> bool:
        """Sleep until the next :meth:`prepare_for_generation`: free the KV cache and park the
        weights (level 1) or drop them (level 2), so training gets the device's memory back; True
        when the weights were dropped (the next refit must reload them). Without sleep mode (CPU)
        the engine keeps its memory; the state is still tracked, so a call out of order fails the
        same way everywhere."""
        dropped = False
        if self.sleep_mode and self._sleep.awake:
            self._engine.reset_prefix_cache()
            self._engine.sleep(self.sleep_level)
            dropped = self.sleep_level == 2
        self._sleep.sleep()
        return dropped

    def prepare_for_generation(self, tags: list[str] | None = None) -> None:
        """Wake what ``tags`` name (``"weights"``, ``"kv_cache"``; all when None): weights before a
        refit, the KV cache once training's memory is out of the way."""
        missing = self._sleep.to_wake(tags)
        if self.sleep_mode and missing:
            self._engine.wake_up(sorted(missing))
        self._sleep.wake(tags)

    def shutdown(self) -> None:
        """Stop the engine and free its memory (safe to call twice)."""
        engine = getattr(self, "_engine", None)
        if engine is None:
            return
        if getattr(self, "_adapter_dir", None):
            import shutil

            shutil.rmtree(self._adapter_dir, ignore_errors=True)
            self._adapter_dir = None
        self._engine = None
        try:
            engine.shutdown()
        finally:
            del engine
            gc.collect()
            cpu_shm.remove_segments()


__all__ = ["VllmGenerationWorker", "RefitError"]
