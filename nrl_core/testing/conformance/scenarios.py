"""What the conformance suites run inside spawned ranks, and the references they compare with.

Each scenario builds real workers from a backend's spec, exactly as the core does
(``Worker(config, rank=, world_size=)`` with a validated config), drives them through the
contract and returns plain measurements; the pytest side (:mod:`.suites`) turns them into one
assertion per check. Scenarios run in spawned processes (``run_distributed``, gloo) so a backend
that keeps process-global state (Megatron's parallel groups) never leaks it into the test session.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nrl_core.checkpoint.to_hf import hf_model

if TYPE_CHECKING:
    import torch

    from nrl_core.contracts import TokenBatch

TEMPERATURE = 0.7
"""Sampling temperature of the conformance configs: not 1, so a backend that ignores
``policy.generation.temperature`` in its logprobs fails the HF reference check."""

GLOBAL_BATCH = 4
BUCKET_BYTES = 16_384
"""Small enough that a tiny model's export needs several buckets."""


# --------------------------------------------------------------------------- inputs


def conformance_batch(rows: int = GLOBAL_BATCH, width: int = 14, vocab: int = 512, seed: int = 0) -> TokenBatch:
    """Right-padded sequences of different lengths (pad id 3), the loss over every token after the
    first: varied lengths are what expose padding, packing and micro-batch mistakes."""
    import torch

    from nrl_core.contracts import TokenBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (rows, width), generator=g)
    lengths = torch.tensor([width - (3 * i) % 7 for i in range(rows)])
    mask = torch.zeros(rows, width)
    for i, n in enumerate(lengths.tolist()):
        ids[i, n:] = 3
        mask[i, 1:n] = 1.0
    return TokenBatch(input_ids=ids, input_lengths=lengths, fields={"token_mask": mask})


def conformance_config(backend: str, model_dir: str, *, world_size: int = 1, overrides: Sequence[str] = (),
                       **policy: Any) -> dict[str, Any]:
    """A config validated by the core (every default filled, the backend's own checks run) that
    selects training backend ``backend``, samples at :data:`TEMPERATURE` and trains
    :data:`GLOBAL_BATCH` sequences per step on ``world_size`` ranks; ``policy`` sets
    ``policy.<key>`` values and ``overrides`` are command-line style ``key.path=value`` strings."""
    from nrl_core.algorithms.installed import validate_config
    from nrl_core.config.loader import apply_overrides
    from nrl_core.plugins import get_plugin_manager

    pm = get_plugin_manager()
    spec = pm.training_backends().get(backend, "policy")
    generators = pm.generation_backends().names()
    raw: dict[str, Any] = {
        "cluster": {"gpus_per_node": world_size, "num_nodes": 1},
        "policy": {
            "model_name": str(model_dir), "precision": "float32", "train_global_batch_size": GLOBAL_BATCH,
            "train_micro_batch_size": 2, "logprob_batch_size": 2, "max_total_sequence_length": 16,
            spec.config_key: {"enabled": True},
            "generation": {"backend": generators[0], "temperature": TEMPERATURE} if generators else None,
            **policy,
        },
    }
    apply_overrides(raw, overrides)
    config = validate_config(raw)
    if config["policy"]["generation"] is None:  # no generation backend installed: keep the temperature
        config["policy"]["generation"] = {"temperature": TEMPERATURE}
    return config


def build_training_worker(config: Mapping[str, Any], rank: int, world_size: int) -> Any:
    """The selected training backend's worker, built as the core builds it."""
    from nrl_core.config.validate import select_training_backend
    from nrl_core.contracts import import_object
    from nrl_core.plugins import get_plugin_manager

    spec = select_training_backend(config, get_plugin_manager())
    return import_object(spec.worker)(dict(config), rank=rank, world_size=world_size)


# --------------------------------------------------------------------------- references


def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF ``generate`` one prompt at a time (no padding), stopping at EOS as engines do."""
    import torch

    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=3)
        out.append(seq[0, len(prompt):].tolist())
    return out


def safetensors_state(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


# --------------------------------------------------------------------------- helpers run in ranks


class TrainingForwardLogprobs:
    """A loss wrapper that keeps, per row of the global batch, the logprobs the training forward
    handed the loss (detached, on the loss's tokens). GRPO with one optimizer step per batch uses
    exactly these as the previous policy's (``loss_fn.force_on_policy_ratio``) instead of a
    separate ``get_logprobs`` pass, so a backend's must equal that pass's. Needs the batch's
    per-sequence field ``row`` (its index in the global batch)."""

    def __init__(self, loss: Any, batch: TokenBatch) -> None:
        import torch

        self.loss = loss
        self.values = torch.zeros(batch.input_ids.shape, dtype=torch.float32)

    def __call__(self, logprobs: torch.Tensor, batch: TokenBatch, **counts: float) -> Any:
        rows = batch.fields["row"].long()
        width = min(int(logprobs.shape[1]), int(self.values.shape[1]))
        mask = batch.fields["token_mask"][:, :width].float()
        self.values[rows, :width] = logprobs.detach()[:, :width].float().cpu() * mask
        return self.loss(logprobs, batch, **counts)


def result_type_errors(worker: Any, batch: TokenBatch) -> list[str]:
    """One line per logprob method whose result is not a ``BatchShard`` (or ``None``), probed once
    before any check uses it: a worker returning a bare tensor is named, not a crash in assembly."""
    from nrl_core.contract_versions import check_result
    from nrl_core.errors import PluginError

    errors = []
    for method in ("get_logprobs", "get_reference_logprobs"):
        try:
            check_result(method, getattr(worker, method)(batch))
        except PluginError as exc:
            errors.append(str(exc))
    return errors


def _whole(worker_result: Any, batch: TokenBatch) -> torch.Tensor:
    from nrl_core.testing.distributed import gather_shards

    return gather_shards(worker_result, batch)


def _error_of(fn: Any) -> str | None:
    """``"ExcType: message"`` of what ``fn()`` raised, or None when it returned."""
    try:
        fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - the check reports what was raised (DCP raises BaseExceptions)
        from nrl_core.errors import NrlError

        return f"{'NrlError' if isinstance(exc, NrlError) else type(exc).__name__}: {exc}"
    return None


def _truncate_largest_file(src: Path, dst: Path) -> str:
    """Copy checkpoint ``src`` to ``dst`` with its largest file cut to half: a save that died midway."""
    shutil.copytree(src, dst)
    largest = max((p for p in dst.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = largest.read_bytes()
    largest.write_bytes(data[: len(data) // 2])
    return str(largest.relative_to(dst))


def _set_env(env: Mapping[str, str]) -> None:
    for key, value in env.items():
        os.environ[key] = value


# --------------------------------------------------------------------------- scenarios


def training_world1(rank: int, world_size: int, configs: dict[str, dict[str, Any]], root: str,
                    env: Mapping[str, str], capabilities: Collection[str] = ()) -> dict[str, Any]:
    """Every single-rank training check's measurements; ``configs`` maps a role (``base``,
    ``micro1``, one per declared capability) to its validated config; ``capabilities`` are the
    backend's (what only a declaring backend is asked)."""
    import torch

    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.contracts import CheckpointOptions, TrainingWorker

    _set_env(env)
    loss, batch, ckpt = NLLLoss(), conformance_batch(), Path(root)
    out: dict[str, Any] = {}

    w = build_training_worker(configs["base"], rank, world_size)
    out["contract_errors"] = result_type_errors(w, batch)
    if out["contract_errors"]:  # the suite reports them, one line each, instead of failing inside a check
        return out
    out["missing_protocol_methods"] = [n for n in dir(TrainingWorker) if not n.startswith("_")
                                       and callable(getattr(TrainingWorker, n, None)) and not hasattr(w, n)]
    out["is_training_worker"] = isinstance(w, TrainingWorker)
    out["lp0"] = _whole(w.get_logprobs(batch), batch)
    lean = "skip_optimizer_state" in capabilities
    if lean:  # before any step, without optimizer state
        w.save_checkpoint(str(ckpt / "lean"), CheckpointOptions(save_optimizer=False))
    numbered = conformance_batch()
    numbered.fields["row"] = torch.arange(numbered.size, dtype=torch.float32)
    recorder = TrainingForwardLogprobs(loss, numbered)
    out["m1"] = w.train(numbered, recorder)
    out["train_forward_lp0"] = recorder.values
    out["lp1"] = _whole(w.get_logprobs(batch), batch)
    out["ref1"] = _whole(w.get_reference_logprobs(batch), batch)

    w.offload_before_refit()
    w.offload_after_refit()
    w.prepare_for_training()
    out["lp1_after_offload"] = _whole(w.get_logprobs(batch), batch)

    out["manifest"] = [(s.name, tuple(s.shape), s.dtype) for s in w.weight_manifest("float32")]
    out["manifest_bf16"] = [(s.name, tuple(s.shape), s.dtype) for s in w.weight_manifest("bfloat16")]
    buckets = list(w.export_weights(BUCKET_BYTES, "float32"))
    out["bucket_bytes"] = [(len(b), sum(t.numel() * t.element_size() for _, t in b)) for b in buckets]
    out["export"] = [(n, t.detach().clone()) for b in buckets for n, t in b]
    out["export_bf16"] = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                          for b in w.export_weights(BUCKET_BYTES, "bfloat16") for n, t in b]
    w.export_hf(str(ckpt / "hf"))

    w.save_checkpoint(str(ckpt / "sync"), CheckpointOptions(load_rng=True))
    out["rng_draw"] = torch.rand(8)
    out["m2"] = w.train(batch, loss)
    out["lp2"] = _whole(w.get_logprobs(batch), batch)
    w.save_checkpoint(str(ckpt / "async"), CheckpointOptions(async_save=True))
    w.save_checkpoint(str(ckpt / "consolidated"), CheckpointOptions(fully_parallel_save=False))
    w.finalize_checkpoint()

    out["truncated_file"] = _truncate_largest_file(ckpt / "sync", ckpt / "truncated")
    out["bad_loads"] = {
        "missing": _error_of(lambda: w.load_checkpoint(str(ckpt / "missing"), CheckpointOptions())),
        "truncated": _error_of(lambda: w.load_checkpoint(str(ckpt / "truncated"), CheckpointOptions())),
    }
    out["lp2_after_bad_loads"] = _whole(w.get_logprobs(batch), batch)
    out["train_after_bad_loads"] = _error_of(lambda: w.train(batch, loss))
    w = None  # freed before the next worker is built

    fresh = build_training_worker(configs["base"], rank, world_size)
    # A backend that seeds torch when built and draws nothing while training would otherwise
    # pass without restoring the RNG: the fresh worker's state would equal the saved one anyway.
    torch.rand(5)
    fresh.load_checkpoint(str(ckpt / "sync"), CheckpointOptions(load_rng=True))
    out["rng_draw_loaded"] = torch.rand(8)
    out["sync/lp"] = _whole(fresh.get_logprobs(batch), batch)
    out["sync/m2"] = fresh.train(batch, loss)
    for name, options in [("async", CheckpointOptions()), ("consolidated", CheckpointOptions(fully_parallel_load=False))]:
        fresh.load_checkpoint(str(ckpt / name), options)
        out[f"{name}/lp"] = _whole(fresh.get_logprobs(batch), batch)
    # the worker has trained: the checkpoint without optimizer state puts the initial weights back and
    # starts optimizer and schedule fresh, so the first step is taken again exactly
    if lean:
        fresh.load_checkpoint(str(ckpt / "lean"), CheckpointOptions())
        out["lean/lp0"] = _whole(fresh.get_logprobs(batch), batch)
        fresh.train(numbered, TrainingForwardLogprobs(loss, numbered))
        out["lean/lp1"] = _whole(fresh.get_logprobs(batch), batch)
        out["sizes"] = {name: sum(f.stat().st_size for f in (ckpt / name).rglob("*") if f.is_file())
                        for name in ("lean", "sync")}
    fresh = None

    for role, config in configs.items():
        if role == "base":
            continue
        other = build_training_worker(config, rank, world_size)
        out[f"{role}/lp0"] = _whole(other.get_logprobs(batch), batch)
        out[f"{role}/m1"] = other.train(batch, loss)
        out[f"{role}/lp1"] = _whole(other.get_logprobs(batch), batch)
        other = None
    return out


def training_world2(rank: int, world_size: int, config: dict[str, Any], root: str,
                    env: Mapping[str, str]) -> dict[str, Any]:
    """Two data-parallel ranks: logprobs, a step, and a sharded checkpoint round trip."""
    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.contracts import CheckpointOptions

    _set_env(env)
    loss, batch = NLLLoss(), conformance_batch()
    w = build_training_worker(config, rank, world_size)
    out: dict[str, Any] = {"lp0": _whole(w.get_logprobs(batch), batch), "m1": w.train(batch, loss)}
    out["lp1"] = _whole(w.get_logprobs(batch), batch)
    w.save_checkpoint(os.path.join(root, "dp2"), CheckpointOptions())
    w.finalize_checkpoint()
    out["m2"] = w.train(batch, loss)
    w.load_checkpoint(os.path.join(root, "dp2"), CheckpointOptions())
    out["loaded/lp"] = _whole(w.get_logprobs(batch), batch)
    return out


def _pipelined_imports(engine: Any, original: Any, trained: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """``import_weights_pipelined`` of the checkpoint's weights, of the trained ones, of a manifest
    the engine's layout refuses, and of a stream that breaks after its first bucket; greedy after each."""
    from nrl_core.contracts import WeightSpec

    dtype = "float32"

    def load(source: Any, manifest: Any = None) -> int:
        return engine.import_weights_pipelined(source.export_weights(BUCKET_BYTES, dtype),
                                               manifest if manifest is not None else source.weight_manifest(dtype))

    def broken() -> Any:
        buckets = trained.export_weights(BUCKET_BYTES, dtype)
        yield next(buckets)
        raise RuntimeError("the transfer broke after its first bucket")

    def greedy() -> Any:
        """The greedy token ids, or the error generate raised (once: every call moves the sampling state)."""
        out: list[Any] = []
        return _error_of(lambda: out.append(engine.generate(prompts, greedy=True).token_ids)) or out[0]

    out: dict[str, Any] = {}
    out["pipelined/version_before"] = engine.weight_version
    out["pipelined/original_version"] = load(original)
    out["pipelined/original"] = greedy()
    load(trained)
    out["pipelined/trained"] = greedy()
    version = engine.weight_version
    reshaped = [WeightSpec(name=s.name, shape=(*s.shape[:-1], s.shape[-1] + 1), dtype=s.dtype) if s.shape else s
                for s in trained.weight_manifest(dtype)]
    out["pipelined/bad_layout"] = _error_of(lambda: load(trained, reshaped))
    out["pipelined/after_bad_layout"] = greedy()
    out["pipelined/version_after_bad_layout"] = engine.weight_version - version
    try:
        engine.import_weights_pipelined(broken(), trained.weight_manifest(dtype))
        out["pipelined/torn"] = None
    except Exception as exc:  # noqa: BLE001 - the check reports what was raised
        out["pipelined/torn"] = f"{type(exc).__name__}: {exc}"
    out["pipelined/after_torn"] = greedy()
    load(trained)
    out["pipelined/restored"] = greedy()
    return out


def _partial_imports(engine: Any, original: Any, trained: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """``refit_wants`` of the trained manifest, then partial refits (only the named tensors, against
    a manifest of only those) of the checkpoint's weights and of the trained ones; greedy after each.
    One rank: a backend that leaves tensors out only at several ranks (expert parallelism) needs its
    own test of that (nrl's vLLM plugin: tests/vllm/test_vllm_expert_parallel.py)."""
    from nrl_core.algorithms.refit_orchestrator import refit
    from nrl_core.refit.plan import RefitPlan

    out: dict[str, Any] = {}
    manifest = trained.weight_manifest("float32")
    names = {spec.name for spec in manifest}
    wants = engine.refit_wants(list(manifest))
    out["partial/wants_type"] = type(wants).__name__
    named = {entry if isinstance(entry, str) else getattr(entry, "name", repr(entry)) for entry in wants}
    out["partial/wants_outside_manifest"] = sorted(named - names)[:8]
    version = engine.weight_version
    out["partial/original_version"] = refit(original, engine, RefitPlan(bucket_bytes=BUCKET_BYTES, delivery="wanted")).version - version
    out["partial/original"] = engine.generate(prompts, greedy=True).token_ids
    refit(trained, engine, RefitPlan(bucket_bytes=BUCKET_BYTES, delivery="wanted"))
    out["partial/trained"] = engine.generate(prompts, greedy=True).token_ids
    return out


def generation_refit(rank: int, world_size: int, config: dict[str, Any], worker_path: str,
                     training_config: dict[str, Any] | None, root: str, prompts: list[list[int]],
                     max_new_tokens: int, env: Mapping[str, str], pipelined: bool = False,
                     partial: bool = False) -> dict[str, Any]:
    """A generation worker against HF: greedy before and after a refit from a training worker that
    took a few steps (or, without a training backend, from a perturbed HF model), a refit that
    breaks the manifest, the sampling state and shutdown; ``pipelined`` (the backend declares
    ``pipelined_import``): the same refits through ``import_weights_pipelined``, and one torn;
    ``partial`` (it declares ``partial_import``): the same refits of only the tensors it names."""
    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.algorithms.refit_orchestrator import refit
    from nrl_core.contracts import GenerationWorker, import_object
    from nrl_core.refit.hf_source import HFWeightSource
    from nrl_core.refit.plan import RefitPlan
    from nrl_core.testing.refit_host import perturb_weights

    _set_env(env)
    out: dict[str, Any] = {}
    engine = import_object(worker_path)(config, rank=rank, world_size=world_size)
    out["missing_protocol_methods"] = [n for n in dir(GenerationWorker) if not n.startswith("_")
                                       and callable(getattr(GenerationWorker, n, None)) and not hasattr(engine, n)]
    out["is_generation_worker"] = isinstance(engine, GenerationWorker)
    out["initial_version"] = engine.weight_version
    if engine.weight_version < 0:  # placeholder weights: the core loads the policy's before generating
        refit(HFWeightSource(config["policy"]["model_name"]), engine, RefitPlan(bucket_bytes=BUCKET_BYTES))
    first = engine.generate(prompts, greedy=True)
    out["before"] = first.token_ids
    out["before/logprob_lengths"] = [len(lp) == len(ids) for lp, ids in zip(first.logprobs, first.token_ids)]
    out["version0"] = engine.weight_version

    if training_config is not None:
        source = build_training_worker(training_config, rank, world_size)
        batch = conformance_batch()
        for _ in range(3):
            source.train(batch, NLLLoss())
        source.export_hf(os.path.join(root, "trained"))
        trained_dir = os.path.join(root, "trained")
    else:
        model = hf_model(config["policy"]["model_name"])
        perturb_weights(model, seed=7)
        model.save_pretrained(os.path.join(root, "trained"))
        source = HFWeightSource(model)
        trained_dir = os.path.join(root, "trained")
    report = refit(source, engine, RefitPlan(bucket_bytes=BUCKET_BYTES))
    out["refit_version"] = report.version
    out["version1"] = engine.weight_version
    out["after"] = engine.generate(prompts, greedy=True).token_ids
    out["trained_dir"] = trained_dir

    class DroppedTensor:
        """The trained source's stream without its last tensor: a broken training backend."""

        def weight_manifest(self, dtype: str) -> Any:
            return source.weight_manifest(dtype)

        def export_weights(self, bucket_bytes: int, dtype: str) -> Any:
            items = [item for bucket in source.export_weights(bucket_bytes, dtype) for item in bucket]
            yield items[:-1]

    out["bad_refit"] = _error_of(lambda: refit(DroppedTensor(), engine, RefitPlan(bucket_bytes=BUCKET_BYTES)))
    out["version_after_bad_refit"] = engine.weight_version
    out["after_bad_refit"] = engine.generate(prompts, greedy=True).token_ids

    if pipelined:
        out.update(_pipelined_imports(engine, HFWeightSource(config["policy"]["model_name"]), source, prompts))
    if partial:
        out.update(_partial_imports(engine, HFWeightSource(config["policy"]["model_name"]), source, prompts))

    state = engine.sampling_state()
    sampled = engine.generate(prompts * 2).token_ids
    engine.load_sampling_state(state)
    out["sampled"], out["resampled"] = sampled, engine.generate(prompts * 2).token_ids
    out["shutdown"] = _error_of(lambda: (engine.shutdown(), engine.shutdown()))
    return out
