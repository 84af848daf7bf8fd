"""``VllmGenerationWorker``: rollouts through ``vllm.LLM`` and verified weight refits.

The engine runs in this process (on CPU ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the only mode that
starts in seconds); a Ray actor hosts the worker when generation is not colocated. Weights arrive
as HF-named buckets (see :mod:`nrl_core.refit`); they are staged and checked against the manifest
*before* the engine is touched, so a bad refit leaves the engine generating with its old weights.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any, Iterable, Mapping

from nrl_core.contracts import GenerationOutput, WeightSpec
from nrl_core.errors import NrlError
from nrl_core.refit.buckets import Bucket, dtype_name, parse_dtype, spec_of
from nrl_core.refit.manifest import RefitError, verify

from nrl_gen_vllm.checkpoint import check_against_checkpoint, checkpoint_shapes
from nrl_gen_vllm.sampling import SamplingSettings, base_seed, request_seed

logger = logging.getLogger(__name__)

EXTENSION = "nrl_gen_vllm.extension.NrlWorkerExtension"
_GIB = 2**30
_FINISH = {"stop": "stop", "length": "length"}


def _configure_environment(vcfg: Mapping[str, Any]) -> None:
    """Environment vLLM reads at engine start: in-process engine for a single-rank engine (starts
    in seconds on CPU and keeps tensors handed to ``collective_rpc`` by reference)."""
    if int(vcfg.get("tensor_parallel_size") or 1) * int(vcfg.get("pipeline_parallel_size") or 1) == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


class VllmGenerationWorker:
    """One vLLM engine built from ``policy.model_name`` (a local HF checkpoint directory).

    ``config`` is the whole validated nrl config as a plain dict; generation settings come from
    ``policy.generation`` and engine settings from ``policy.generation.vllm_cfg``.
    """

    def __init__(self, config: Mapping[str, Any], rank: int = 0, world_size: int = 1) -> None:
        policy = config["policy"]
        generation = policy.get("generation") or {}
        vcfg = generation.get("vllm_cfg") or {}
        self.rank = rank
        self.world_size = world_size
        self._sampling = SamplingSettings.from_config(generation)
        self._seed = base_seed(config)
        self._calls = 0
        self._version = 0
        self.model_dir = str(policy["model_name"])
        precision = vcfg.get("precision") or policy.get("precision") or "float32"
        self.dtype = "auto" if precision == "auto" else dtype_name(parse_dtype(precision))
        self.max_model_len = int(vcfg.get("max_model_len") or policy.get("max_total_sequence_length") or 512)
        self._checkpoint = checkpoint_shapes(self.model_dir)

        _configure_environment(vcfg)
        from vllm import LLM

        engine_kwargs: dict[str, Any] = {}
        if _is_cpu() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            engine_kwargs["kv_cache_memory_bytes"] = int(float(vcfg.get("kv_cache_space_gb") or 1.0) * _GIB)
        tokenizer = (policy.get("tokenizer") or {}).get("name") or self.model_dir
        start = time.perf_counter()
        self.llm = LLM(
            model=self.model_dir,
            tokenizer=tokenizer,
            dtype=self.dtype,
            seed=self._seed,
            max_model_len=self.max_model_len,
            tensor_parallel_size=int(vcfg.get("tensor_parallel_size") or 1),
            pipeline_parallel_size=int(vcfg.get("pipeline_parallel_size") or 1),
            gpu_memory_utilization=float(vcfg.get("gpu_memory_utilization") or 0.6),
            enforce_eager=bool(vcfg.get("enforce_eager")),
            trust_remote_code=bool(policy.get("trust_remote_code")),
            worker_extension_cls=EXTENSION,
            # the sampled token's logprob after temperature (and top-k/top-p), i.e. under the
            # distribution it was drawn from, which the policy's logprobs reproduce (temperature)
            logprobs_mode="processed_logprobs",
            **engine_kwargs,
        )
        logger.info("vLLM engine for %s ready in %.1f s", self.model_dir, time.perf_counter() - start)

    # ------------------------------------------------------------------ generation

    @property
    def weight_version(self) -> int:
        """0 for the checkpoint's weights, +1 for every successful :meth:`import_weights`."""
        return self._version

    @property
    def calls(self) -> int:
        """How many :meth:`generate` calls this worker served (part of every request's seed)."""
        return self._calls

    def sampling_state(self) -> dict[str, int]:
        """What, with the weights, determines the next samples (and the version label the next refit
        continues from): save it with a checkpoint."""
        return {"calls": self._calls, "seed": self._seed, "weight_version": self._version}

    def load_sampling_state(self, state: Mapping[str, int]) -> None:
        """Restore :meth:`sampling_state` so the next calls repeat the saved run's samples."""
        self._calls = int(state["calls"])
        self._seed = int(state.get("seed", self._seed))
        self._version = int(state.get("weight_version", self._version))

    def generate(self, prompts: list[list[int]], *, greedy: bool = False) -> GenerationOutput:
        """Complete each prompt (token ids); per-request seeds make the samples reproducible."""
        from vllm.inputs import TokensPrompt

        call = self._calls
        self._calls += 1
        requests, params = [], []
        for i, prompt in enumerate(prompts):
            room = self.max_model_len - len(prompt)
            if room <= 0:
                raise NrlError(f"prompt {i} has {len(prompt)} tokens, no room to generate within max_model_len "
                               f"{self.max_model_len}; raise policy.max_total_sequence_length or shorten prompts")
            requests.append(TokensPrompt(prompt_token_ids=list(prompt)))
            params.append(self._sampling.params(max_tokens=min(self._sampling.max_new_tokens, room),
                                                seed=request_seed(self._seed, self.rank, call, i), greedy=greedy))
        outputs = self.llm.generate(requests, params, use_tqdm=False) if requests else []
        token_ids, logprobs, reasons = [], [], []
        for out in outputs:
            seq = out.outputs[0]
            ids = list(seq.token_ids)
            token_ids.append(ids)
            logprobs.append([float(seq.logprobs[t][tok].logprob) for t, tok in enumerate(ids)] if seq.logprobs else [])
            reasons.append(_FINISH.get(seq.finish_reason or "", "stop"))
        return GenerationOutput(token_ids=token_ids, logprobs=logprobs, finish_reasons=reasons,
                                weight_version=self._version)

    # ------------------------------------------------------------------ refit

    def import_weights(self, buckets: Iterable[Bucket], manifest: list[WeightSpec]) -> int:
        """Stage every bucket, prove it matches ``manifest`` (and this engine's checkpoint layout),
        then load it through vLLM's layerwise reload. Returns the new weight version.

        On any mismatch raises :class:`~nrl_core.refit.manifest.RefitError` naming the keys, and
        the engine keeps its previous weights (nothing was loaded yet).
        """
        staged: list[tuple[str, Any]] = [item for bucket in buckets for item in bucket]
        verify([spec_of(name, tensor) for name, tensor in staged], manifest)
        check_against_checkpoint(manifest, self._checkpoint, self.model_dir)
        self.llm.collective_rpc("nrl_load_weights", args=(staged,))
        del staged
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self._version += 1
        return self._version

    def shutdown(self) -> None:
        """Stop the engine and free its memory (safe to call twice)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        try:
            engine_core = getattr(llm.llm_engine, "engine_core", None)
            if engine_core is not None and hasattr(engine_core, "shutdown"):
                engine_core.shutdown()
        finally:
            del llm
            gc.collect()


__all__ = ["VllmGenerationWorker", "RefitError"]
