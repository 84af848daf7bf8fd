"""``HFGenerationWorker``: rollouts through transformers' ``generate`` and verified weight refits.

One rank is one engine (no tensor parallelism): colocated, every training rank holds an engine
beside its policy; not colocated, every generation rank is an independent engine. The model is the
policy's own transformers class, on the rank's GPU when there is one, else the CPU.
"""

from __future__ import annotations

import gc
import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from nrl_core.api import (
    Bucket,
    GenerationOutput,
    NrlError,
    RefitError,
    SamplingState,
    SleepState,
    WeightSpec,
    parse_dtype,
    spec_of,
)
from nrl_core.api import verify_manifest as verify
from nrl_gen_hf import memory
from nrl_gen_hf.config import EngineSettings
from nrl_gen_hf.layout import RefitLayout
from nrl_gen_hf.sampling import HFSampling, LogprobRecorder, seeded
from nrl_gen_hf.stops import cut, stop_token_ids

logger = logging.getLogger(__name__)


def _device() -> Any:
    """The actor's GPU (Ray made it the current device) when there is one, else the CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _load_model(settings: EngineSettings, device: Any) -> Any:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from nrl_core.api import read_model_config

    hf_config = read_model_config(settings.model_dir, trust_remote_code=settings.trust_remote_code,
                                  overrides=settings.hf_config_overrides)
    kwargs: dict[str, Any] = {"dtype": parse_dtype(settings.precision), "trust_remote_code": settings.trust_remote_code}
    if settings.attn_implementation:
        kwargs["attn_implementation"] = settings.attn_implementation
    if settings.load_format == "dummy":
        model = AutoModelForCausalLM.from_config(hf_config, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(settings.model_dir, config=hf_config, **kwargs)
    model.to(device)  # transformers places models itself only through accelerate, absent on a bare machine
    model.eval().requires_grad_(False)
    # Only the special tokens of the checkpoint's generation config: its sampling defaults
    # (top_k, repetition_penalty...) would change what the configured distribution samples.
    saved = model.generation_config
    model.generation_config = GenerationConfig(bos_token_id=saved.bos_token_id, eos_token_id=saved.eos_token_id,
                                               pad_token_id=saved.pad_token_id)
    return model


class HFGenerationWorker:
    """One engine: an HF causal LM built from ``policy.model_name``.

    ``config`` is the whole validated nrl config as a plain dict; sampling comes from
    ``policy.generation``, engine options from ``policy.generation.hf_cfg``.
    """

    lazy_imports = ("transformers.modeling_utils", "transformers.generation.utils")

    def __init__(self, config: Mapping[str, Any], rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size
        self.settings = EngineSettings.from_config(config)
        self.sampling = HFSampling.from_generation(config["policy"].get("generation") or {})
        self.device = _device()
        self.model = _load_model(self.settings, self.device)
        self.layout = RefitLayout(self.model)
        self._stop_ids = stop_token_ids(self.model.generation_config, self.sampling.stop_token_ids)
        pad = self.model.generation_config.pad_token_id
        # rows that finished early are filled with it, then cut at their stop
        self._pad_id = int(pad) if pad is not None else (self._stop_ids[0] if self._stop_ids else 0)
        self.tokenizer = self._load_tokenizer() if self.sampling.stop_strings else None  # stop strings need text
        self._state = SamplingState(seed=self.settings.seed,
                                    weight_version=-1 if self.settings.load_format == "dummy" else 0)
        self._sleep = SleepState(f"hf engine {rank}")
        logger.info("hf engine %d (rank %d of %d): %s in %s on %s", rank, rank, world_size, self.settings.model_dir,
                    self.settings.precision, self.device)

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.settings.tokenizer_dir,
                                             trust_remote_code=self.settings.trust_remote_code)

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    # ------------------------------------------------------------------ generation

    @property
    def weight_version(self) -> int:
        """0 for the checkpoint's weights, +1 for every successful :meth:`import_weights`; -1 while
        an engine built with ``load_format: dummy`` holds random weights."""
        return self._state.weight_version

    def sampling_state(self) -> dict[str, int]:
        """What, with the weights, determines the next samples: every batch's generator is seeded
        from (seed, rank, call, batch), so the seed and the call count are the whole state."""
        return self._state.as_dict()

    def load_sampling_state(self, state: Mapping[str, int]) -> None:
        self._state.load(state)

    def generate(self, prompts: list[list[int]], *, greedy: bool = False) -> GenerationOutput:
        """Complete each prompt (token ids). Prompts of one length decode together, in batches of
        at most ``hf_cfg.batch_size``; outputs come back in input order."""
        self._sleep.require_awake("generate")
        if self._state.weight_version < 0:
            raise NrlError(f"hf engine {self.rank}: generate before any weights were loaded (hf_cfg.load_format: "
                           "dummy starts with random weights); import_weights first, or set load_format: auto")
        for i, prompt in enumerate(prompts):
            if len(prompt) >= self.settings.max_total_length:
                raise NrlError(f"prompt {i} has {len(prompt)} tokens, no room to generate within "
                               f"policy.max_total_sequence_length={self.settings.max_total_length}; raise it or "
                               "shorten prompts")
        call = self._state.next_call()
        results: list[tuple[list[int], list[float], str]] = [([], [], "length")] * len(prompts)
        for batch, rows in enumerate(self._batches(prompts)):
            seed = self._state.seed_for(self.rank, call, batch)
            for row, result in zip(rows, self._generate_batch([prompts[r] for r in rows], greedy, seed)):
                results[row] = result
        return GenerationOutput(token_ids=[r[0] for r in results], logprobs=[r[1] for r in results],
                                finish_reasons=[r[2] for r in results], weight_version=self._state.weight_version)

    def _batches(self, prompts: list[list[int]]) -> list[list[int]]:
        """Row indices grouped by prompt length (in order of first appearance), then cut to size."""
        by_length: dict[int, list[int]] = defaultdict(list)
        for row, prompt in enumerate(prompts):
            by_length[len(prompt)].append(row)
        size = self.settings.batch_size
        return [rows[i:i + size] for rows in by_length.values() for i in range(0, len(rows), size)]

    def _generate_batch(self, prompts: list[list[int]], greedy: bool,
                        seed: int) -> list[tuple[list[int], list[float], str]]:
        import torch
        from transformers import GenerationConfig, LogitsProcessorList

        budget = min(self.sampling.max_new_tokens, self.settings.max_total_length - len(prompts[0]))
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        recorder = LogprobRecorder()
        sample = self.sampling.samples(greedy)
        # the warpers run as processors below, so the recorder sees their output; left unset,
        # transformers would fill its own (top_k 50) in
        warpers_off = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {}
        config = GenerationConfig(
            do_sample=sample, max_new_tokens=budget, repetition_penalty=1.0, num_beams=1, **warpers_off,
            eos_token_id=self._stop_ids or None, pad_token_id=self._pad_id,
            stop_strings=list(self.sampling.stop_strings) or None)
        extra = {"tokenizer": self.tokenizer} if self.tokenizer is not None else {}
        with torch.no_grad(), seeded(seed, self.device):
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                      logits_processor=LogitsProcessorList([*self.sampling.warpers(greedy), recorder]),
                                      **extra)
        new = out[:, ids.shape[1]:]
        logprobs = recorder.finish(new)
        rows = []
        for tokens, row_logprobs in zip(new.tolist(), logprobs.tolist()):
            kept, reason = cut(tokens, frozenset(self._stop_ids), self.sampling.stop_strings,
                               self._decode if self.tokenizer is not None else None, budget)
            rows.append((kept, row_logprobs[:len(kept)], reason))
        return rows

    # ------------------------------------------------------------------ refit

    def import_weights(self, buckets: Iterable[Bucket], manifest: list[WeightSpec]) -> int:
        """Stage every bucket, prove it matches ``manifest`` and this model's checkpoint layout,
        then copy it into the model. Returns the new weight version.

        On any mismatch raises :class:`~nrl_core.refit.manifest.RefitError` naming the keys, and
        the model keeps its previous weights (nothing was copied yet). Colocated, the buckets hold
        the policy's tensors by reference: they are copied, never kept.
        """
        self._sleep.require_awake("import_weights", ("weights",))
        staged = [item for bucket in buckets for item in bucket]
        verify([spec_of(name, tensor) for name, tensor in staged], manifest)
        self.layout.check(manifest)
        self.layout.load(staged)
        del staged
        self._state.weight_version += 1
        return self._state.weight_version

    # ------------------------------------------------------------------ memory hand-off (colocated)

    def finish_generation(self) -> bool:
        """Park the weights in host memory until :meth:`prepare_for_generation` (on a GPU; on the
        CPU only the state changes). Always False: the weights are kept, never dropped."""
        if "weights" in self._sleep.awake and self.device.type == "cuda":
            memory.park(self.model)
        self._sleep.sleep()
        return False

    def prepare_for_generation(self, tags: list[str] | None = None) -> None:
        """Wake what ``tags`` name (``"weights"``, ``"kv_cache"``; all when None). ``generate``
        allocates its KV cache per call, so waking it only marks the engine ready."""
        if "weights" in self._sleep.to_wake(tags):
            memory.restore(self.model, self.device)
        self._sleep.wake(tags)

    def shutdown(self) -> None:
        """Drop the model and free its memory (safe to call twice)."""
        if getattr(self, "model", None) is None:
            return
        self.model = None
        self.layout = None  # type: ignore[assignment]
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


__all__ = ["HFGenerationWorker", "RefitError"]

