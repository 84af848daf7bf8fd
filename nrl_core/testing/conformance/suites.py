"""The pytest side of the conformance kit: classes of checks a backend's own test module adopts.

Each factory returns a test class; assigning it to a ``Test...`` name in a test module is all a
backend needs. The expensive part (building workers) runs once per class in spawned ranks; every
test method then checks one promise of the contract and its failure says what the backend got
wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from nrl_core.checkpoint.to_hf import hf_logprobs, hf_model
from nrl_core.testing.conformance import scenarios

LOGPROB_TOLERANCE = 1e-4
"""Backend vs plain HF forward, float32 on CPU: kernels differ only in reduction order."""
INVARIANCE_TOLERANCE = 1e-5
"""The same backend under another split (micro-batches, ranks, packing): float32 sums reordered."""
DERIVED_TOLERANCE = 1e-6
"""The training forward's logprobs vs ``get_logprobs``'s, same weights and micro-batches."""
GRAD_NORM_TOLERANCE = 1e-4


def _gap(a: Any, b: Any) -> float:
    if tuple(a.shape) != tuple(b.shape):
        return float("inf")
    return float((a - b).abs().max()) if a.numel() else 0.0


def _tmp_env(env: Mapping[str, str], tmp: Path) -> dict[str, str]:
    """``env`` with ``{tmp}`` in its values replaced by a directory private to the run."""
    return {key: value.replace("{tmp}", str(tmp)) for key, value in env.items()}


def _contract_gaps(spec: Any, role: str, registry: Any) -> None:
    """Fail before anything runs, one line per method the worker lacks or cannot be called as the
    core calls it, against the contract its plugin declares and the capabilities its spec declares
    (docs/contract.md, read from the Protocols)."""
    from nrl_core.contract_versions import unwrap_path, worker_gaps
    from nrl_core.contracts import import_object

    worker, _, version, plugin = unwrap_path(spec.worker)
    gaps = worker_gaps(import_object(worker), role, version, plugin or registry.owner(spec.name),
                       capabilities=getattr(spec, "capabilities", frozenset()))
    if gaps:
        pytest.fail("\n".join(gaps), pytrace=False)


def _fail_on_contract_errors(result: Mapping[str, Any]) -> None:
    """A worker result of the wrong type, found by a scenario, as one line per method."""
    if result.get("contract_errors"):
        pytest.fail("\n".join(result["contract_errors"]), pytrace=False)


def _skip_unless_declared(spec: Any, capability: str) -> None:
    if capability not in spec.capabilities:
        pytest.skip(f"backend '{spec.name}' does not declare '{capability}'")


class _TrainingChecks:
    """Checks every training backend must pass (see docs/plugins.md); configured by
    :func:`training_backend_suite`."""

    backend: str = ""
    overrides: tuple[str, ...] = ()
    family: str = "llama"
    size: str = "tiny"
    env: Mapping[str, str] = {}

    # ------------------------------------------------------------------ runs (once per class)

    @pytest.fixture(scope="class")
    def spec(self) -> Any:
        from nrl_core.plugins import get_plugin_manager

        registry = get_plugin_manager().training_backends()
        spec = registry.get(self.backend, "policy")
        _contract_gaps(spec, "training", registry)
        return spec

    @pytest.fixture(scope="class")
    def model_dir(self) -> Path:
        from nrl_core.testing.tiny_models import cached_tiny_model

        return cached_tiny_model(self.family, self.size)

    @pytest.fixture(scope="class")
    def world1(self, spec: Any, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
        from nrl_core.testing.distributed import run_distributed

        root = tmp_path_factory.mktemp(f"conformance-{self.backend}")
        make = lambda **policy: scenarios.conformance_config(self.backend, str(model_dir), overrides=self.overrides,
                                                             **policy)
        configs = {"base": make(), "micro1": make(train_micro_batch_size=1, logprob_batch_size=1)}
        for capability in ("sequence_packing", "dynamic_batching"):
            if capability in spec.capabilities:
                configs[capability] = make(**{capability: {"enabled": True, "train_mb_tokens": 32,
                                                           "logprob_mb_tokens": 48, "sequence_length_round": 4}})
        (result,) = run_distributed(scenarios.training_world1, 1, configs, str(root), _tmp_env(self.env, root),
                                    sorted(spec.capabilities))
        _fail_on_contract_errors(result)
        result["root"] = root
        return result

    @pytest.fixture(scope="class")
    def reference(self, model_dir: Path) -> dict[str, Any]:
        """The plain HF forward the backend must agree with, and the first step's loss under it."""
        model = hf_model(model_dir)
        batch = scenarios.conformance_batch()
        lp = hf_logprobs(model, batch, scenarios.TEMPERATURE)
        mask = batch.fields["token_mask"]
        return {"lp": lp, "loss": float(-(lp * mask).sum() / mask.sum()), "batch": batch}

    # ------------------------------------------------------------------ the contract's shape

    def test_worker_satisfies_the_training_protocol(self, world1: dict[str, Any]) -> None:
        assert not world1["missing_protocol_methods"], (
            f"the worker lacks {world1['missing_protocol_methods']} of nrl_core.contracts.TrainingWorker")
        assert world1["is_training_worker"]

    # ------------------------------------------------------------------ logprobs and the loss

    def test_logprobs_match_hf_forward_at_the_sampling_temperature(self, world1, reference, model_dir) -> None:
        gap = _gap(world1["lp0"], reference["lp"])
        untempered = hf_logprobs(hf_model(model_dir), reference["batch"], 1.0)
        hint = (" (they match T=1: the backend ignores policy.generation.temperature; divide the logits by "
                "nrl_core.contracts.logprob_temperature(config))" if _gap(world1["lp0"], untempered) < LOGPROB_TOLERANCE
                else "")
        assert gap < LOGPROB_TOLERANCE, (
            f"get_logprobs differs from a plain HF forward at temperature {scenarios.TEMPERATURE} by {gap:.2e} "
            f"(tolerance {LOGPROB_TOLERANCE:.0e}; shapes {tuple(world1['lp0'].shape)} vs "
            f"{tuple(reference['lp'].shape)}; position 0 and padding must be 0){hint}")

    def test_train_reports_the_loss_of_the_loss_function(self, world1, reference) -> None:
        metrics = world1["m1"]
        assert "loss" in metrics and "grad_norm" in metrics, f"train() returned {sorted(metrics)}; needs loss and grad_norm"
        assert abs(metrics["loss"] - reference["loss"]) < LOGPROB_TOLERANCE, (
            f"train() reported loss {metrics['loss']:.6f} but NLLLoss over HF logprobs of the global batch is "
            f"{reference['loss']:.6f}: the loss must get global_valid_tokens from TokenBatch.loss_counts() of the "
            "whole batch and logprobs as get_logprobs computes them")
        assert _gap(world1["lp1"], world1["lp0"]) > 1e-4, "train() did not change the logprobs: no optimizer step"

    def test_training_forward_logprobs_equal_get_logprobs(self, world1) -> None:
        mask = scenarios.conformance_batch().fields["token_mask"]
        gap = _gap(world1["train_forward_lp0"], world1["lp0"] * mask)
        assert gap < DERIVED_TOLERANCE, (
            f"the logprobs train() hands the loss differ from get_logprobs at the same weights by {gap:.2e} "
            f"(tolerance {DERIVED_TOLERANCE:.0e}): GRPO takes the previous policy's logprobs from the training "
            "forward when a batch feeds one optimizer step, so both must run the same model the same way "
            "(no dropout, same temperature, same precision)")

    def test_reference_logprobs_stay_the_initial_ones(self, world1) -> None:
        gap = _gap(world1["ref1"], world1["lp0"])
        assert gap < INVARIANCE_TOLERANCE, (
            f"get_reference_logprobs after a step differs from the initial logprobs by {gap:.2e}: the reference "
            "must be the initial weights")

    def test_micro_batch_size_changes_nothing(self, world1) -> None:
        for key, what in (("lp0", "logprobs"), ("lp1", "logprobs after one step")):
            gap = _gap(world1[f"micro1/{key}"], world1[key])
            assert gap < INVARIANCE_TOLERANCE, (
                f"{what} with train_micro_batch_size=logprob_batch_size=1 differ from micro-batches of 2 by {gap:.2e}: "
                "losses must be normalised by global counts, not per micro-batch")
        a, b = world1["micro1/m1"], world1["m1"]
        assert abs(a["loss"] - b["loss"]) < INVARIANCE_TOLERANCE, f"loss {a['loss']} with micro-batches of 1 vs {b['loss']}"
        assert abs(a["grad_norm"] - b["grad_norm"]) < GRAD_NORM_TOLERANCE, (
            f"grad_norm {a['grad_norm']} with micro-batches of 1 vs {b['grad_norm']}: gradients must be summed, not averaged, over micro-batches")

    def test_offload_and_prepare_keep_the_weights(self, world1) -> None:
        gap = _gap(world1["lp1_after_offload"], world1["lp1"])
        assert gap < INVARIANCE_TOLERANCE, (
            f"offload_before_refit/offload_after_refit/prepare_for_training changed the logprobs by {gap:.2e}")

    # ------------------------------------------------------------------ capabilities

    @pytest.mark.parametrize("capability", ["sequence_packing", "dynamic_batching"])
    def test_declared_capability_equals_padded(self, spec, world1, capability: str) -> None:
        _skip_unless_declared(spec, capability)
        for key, what in (("lp0", "logprobs"), ("lp1", "logprobs after one step")):
            gap = _gap(world1[f"{capability}/{key}"], world1[key])
            assert gap < INVARIANCE_TOLERANCE, (
                f"the backend declares '{capability}' but its {what} with policy.{capability}.enabled=true differ "
                f"from padded micro-batches by {gap:.2e}")
        a, b = world1[f"{capability}/m1"], world1["m1"]
        assert abs(a["loss"] - b["loss"]) < INVARIANCE_TOLERANCE, f"{capability}: loss {a['loss']} vs padded {b['loss']}"

    # ------------------------------------------------------------------ weights out

    def test_manifest_matches_the_exported_stream(self, world1) -> None:
        streamed = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in world1["export"]]
        assert streamed == world1["manifest"], (
            "export_weights(float32) yields other names, shapes or dtypes than weight_manifest(float32) lists: "
            f"only in the manifest {sorted(set(world1['manifest']) - set(streamed))[:4]}, "
            f"only in the stream {sorted(set(streamed) - set(world1['manifest']))[:4]}")
        assert world1["export_bf16"] == world1["manifest_bf16"], "export_weights(bfloat16) disagrees with its manifest"
        assert all(dtype == "bfloat16" for _, _, dtype in world1["manifest_bf16"]), "the manifest ignores dtype"
        oversized = [(n, b) for n, b in world1["bucket_bytes"] if b > scenarios.BUCKET_BYTES and n > 1]
        assert not oversized, f"buckets over bucket_bytes={scenarios.BUCKET_BYTES} with several tensors: {oversized}"

    def test_export_equals_the_hf_export(self, world1, reference) -> None:
        hf_dir = world1["root"] / "hf"
        files = scenarios.safetensors_state(hf_dir)
        exported = dict(world1["export"])
        assert exported.keys() == files.keys(), (
            f"export_hf wrote other tensors than export_weights streams: only in export_hf "
            f"{sorted(files.keys() - exported.keys())[:4]}, only streamed {sorted(exported.keys() - files.keys())[:4]}")
        differ = [n for n in files if not files[n].float().equal(exported[n].float())]
        assert not differ, f"export_weights and export_hf disagree on the values of {differ[:4]}"
        lp = hf_logprobs(hf_model(hf_dir), reference["batch"], scenarios.TEMPERATURE)
        gap = _gap(lp, world1["lp1"])
        assert gap < LOGPROB_TOLERANCE, (
            f"the HF export, loaded with transformers, gives logprobs {gap:.2e} away from the worker's: "
            "export_hf must write the trained weights in the HF checkpoint's layout")
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(hf_dir))  # the tokenizer travels with the export

    # ------------------------------------------------------------------ checkpoints

    @pytest.mark.parametrize("kind", ["sync", "async", "consolidated"])
    def test_checkpoint_round_trip(self, world1, kind: str) -> None:
        expected = world1["lp1"] if kind == "sync" else world1["lp2"]
        gap = _gap(world1[f"{kind}/lp"], expected)
        how = {"sync": "CheckpointOptions()", "async": "async_save=True then finalize_checkpoint()",
               "consolidated": "fully_parallel_save=False / fully_parallel_load=False"}[kind]
        assert gap == 0.0, f"a checkpoint saved with {how} loads into a fresh worker with logprobs {gap:.2e} off"

    def test_checkpoint_with_load_rng_resumes_bit_identically(self, world1) -> None:
        import torch

        assert torch.equal(world1["rng_draw_loaded"], world1["rng_draw"]), (
            "after loading with load_rng=True, torch's RNG is not where it was when the checkpoint was saved "
            "(the kit draws from it between building the fresh worker and loading)")
        assert world1["sync/m2"]["loss"] == world1["m2"]["loss"], (
            f"the step after a resume has loss {world1['sync/m2']['loss']!r}, the uninterrupted run "
            f"{world1['m2']['loss']!r}: model, optimizer or scheduler state is not fully restored")

    def test_declared_skip_optimizer_state_saves_weights_only_and_starts_fresh(self, spec, world1) -> None:
        _skip_unless_declared(spec, "skip_optimizer_state")
        lean, full = world1["sizes"]["lean"], world1["sizes"]["sync"]
        assert lean < full, (f"the backend declares 'skip_optimizer_state' but a checkpoint saved with "
                             f"save_optimizer=False has {lean} bytes, one with the optimizer {full}")
        gap = _gap(world1["lean/lp0"], world1["lp0"])
        assert gap == 0.0, f"a checkpoint saved with save_optimizer=False loads with logprobs {gap:.2e} off"
        gap = _gap(world1["lean/lp1"], world1["lp1"])
        assert gap == 0.0, (
            f"after loading a checkpoint saved with save_optimizer=False before the first step, a trained worker's "
            f"next step lands {gap:.2e} off the first step: optimizer or scheduler state did not start fresh")

    def test_bad_checkpoint_is_one_line_and_leaves_the_worker_unchanged(self, world1) -> None:
        for case, error in world1["bad_loads"].items():
            what = "a missing directory" if case == "missing" else f"a checkpoint with {world1['truncated_file']} cut in half"
            assert error is not None, f"loading {what} did not raise"
            assert error.startswith("NrlError: ") and "\n" not in error, (
                f"loading {what} must raise a one-line nrl_core.errors.NrlError, got {error!r}")
        gap = _gap(world1["lp2_after_bad_loads"], world1["lp2"])
        assert gap == 0.0, f"failed loads changed the worker's logprobs by {gap:.2e}"
        assert world1["train_after_bad_loads"] is None, f"the worker cannot train after a failed load: {world1['train_after_bad_loads']}"

    # ------------------------------------------------------------------ data parallel

    @pytest.mark.slow
    def test_two_data_parallel_ranks_equal_one(self, spec, model_dir, world1, tmp_path) -> None:
        _skip_unless_declared(spec, "data_parallel")
        from nrl_core.testing.distributed import run_distributed

        config = scenarios.conformance_config(self.backend, str(model_dir), world_size=2, overrides=self.overrides)
        ranks = run_distributed(scenarios.training_world2, 2, config, str(tmp_path), _tmp_env(self.env, tmp_path))
        for rank, r in enumerate(ranks):
            for key in ("lp0", "lp1"):
                gap = _gap(r[key], world1[key])
                assert gap < INVARIANCE_TOLERANCE, (
                    f"rank {rank} of 2: {key} differ from one rank by {gap:.2e}: each rank must take "
                    "TokenBatch.shard_rows of the global batch and reduce gradients over the data-parallel group")
            assert abs(r["m1"]["loss"] - world1["m1"]["loss"]) < INVARIANCE_TOLERANCE, (
                f"rank {rank} of 2 reports loss {r['m1']['loss']} vs {world1['m1']['loss']} on one rank: metrics "
                "must be reduced over ranks")
            gap = _gap(r["loaded/lp"], r["lp1"])
            assert gap == 0.0, f"rank {rank} of 2: a checkpoint round trip at world size 2 is {gap:.2e} off"


def training_backend_suite(backend: str, *, overrides: Sequence[str] = (), family: str = "llama", size: str = "tiny",
                           env: Mapping[str, str] | None = None, slow: bool = False) -> type:
    """A test class of every training-backend check, for ``backend`` (its registered name).

    ``overrides`` are ``key.path=value`` strings applied before validation (the backend's learning
    rate, parallel sizes); ``family``/``size`` pick the tiny model; ``env`` is set in the spawned
    ranks (``{tmp}`` becomes a directory private to the run); ``slow`` marks every check slow.
    Use it as ``TestConformance = training_backend_suite("mine")`` in a test module.
    """
    attrs = {"backend": backend, "overrides": tuple(overrides), "family": family, "size": size,
             "env": dict(env or {}), "__module__": _caller_module()}
    cls = type(f"TestTrainingConformance_{backend}", (_TrainingChecks,), attrs)
    return pytest.mark.slow(cls) if slow else cls


class _GenerationChecks:
    """Checks every generation backend must pass; configured by :func:`generation_backend_suite`."""

    backend: str = ""
    training_backend: str | None = None
    overrides: tuple[str, ...] = ()
    training_overrides: tuple[str, ...] = ()
    family: str = "llama"
    size: str = "small"
    env: Mapping[str, str] = {}
    max_new_tokens: int = 8

    @pytest.fixture(scope="class")
    def model_dir(self) -> Path:
        from nrl_core.testing.tiny_models import cached_tiny_model

        return cached_tiny_model(self.family, self.size)

    @pytest.fixture(scope="class")
    def prompts(self, model_dir: Path) -> list[list[int]]:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        return [tok(t).input_ids for t in ("Q: What is 3 + 4?\nA:", "Q: What is 40 - 2?\nA:", "Answer with a number.")]

    @pytest.fixture(scope="class")
    def run(self, model_dir: Path, prompts, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
        from nrl_core.plugins import get_plugin_manager
        from nrl_core.testing.distributed import run_distributed

        registry = get_plugin_manager().generation_backends()
        spec = registry.get(self.backend, "policy.generation.backend")
        _contract_gaps(spec, "generation", registry)
        root = tmp_path_factory.mktemp(f"conformance-{self.backend}")
        training = self.training_backend or next(iter(get_plugin_manager().training_backends().names()), None)
        if training is None:
            pytest.skip("no training backend is installed to build a validated config with")
        overrides = [f"policy.generation.backend={self.backend}", f"policy.generation.max_new_tokens={self.max_new_tokens}",
                     "policy.max_total_sequence_length=64",
                     *self.overrides]
        config = scenarios.conformance_config(training, str(model_dir), overrides=overrides)
        training_config = None
        if self.training_backend is not None:
            training_config = scenarios.conformance_config(self.training_backend, str(model_dir),
                                                           overrides=[*overrides, *self.training_overrides])
        (result,) = run_distributed(scenarios.generation_refit, 1, config, spec.worker, training_config, str(root),
                                    prompts, self.max_new_tokens, _tmp_env(self.env, root),
                                    "pipelined_import" in spec.capabilities, "partial_import" in spec.capabilities)
        result["capabilities"] = sorted(spec.capabilities)
        return result

    def test_worker_satisfies_the_generation_protocol(self, run) -> None:
        assert not run["missing_protocol_methods"], (
            f"the worker lacks {run['missing_protocol_methods']} of nrl_core.contracts.GenerationWorker")
        assert run["is_generation_worker"]

    def test_weight_version_starts_at_the_checkpoint(self, run) -> None:
        assert run["initial_version"] in (0, -1), (
            f"a new engine's weight_version is {run['initial_version']}: 0 when it read the checkpoint, "
            "-1 when it holds placeholder weights until the first refit")
        assert run["version0"] == 0, (
            f"weight_version is {run['version0']} once the engine holds the checkpoint's weights; it must be 0 "
            "(the first import into a placeholder engine makes it 0)")

    def test_greedy_equals_hf_greedy(self, run, model_dir, prompts) -> None:
        expected = scenarios.hf_greedy(hf_model(model_dir), prompts, self.max_new_tokens)
        assert run["before"] == expected, (
            f"greedy generation from the checkpoint gave {run['before']}, HF generate {expected}")
        assert all(run["before/logprob_lengths"]), "GenerationOutput.logprobs must have one entry per generated token"

    def test_refit_from_a_training_worker_then_greedy_equals_hf(self, run, prompts) -> None:
        source = f"training backend '{self.training_backend}'" if self.training_backend else "a perturbed HF model"
        expected = scenarios.hf_greedy(hf_model(run["trained_dir"]), prompts, self.max_new_tokens)
        assert run["after"] == expected, (
            f"after a refit from {source}, greedy output is {run['after']} but HF generate with the exported "
            f"weights gives {expected}: import_weights did not load every tensor (or loaded them into the wrong place)")
        assert run["after"] != run["before"], "the refit changed no output: the engine kept its old weights"
        assert run["refit_version"] == run["version1"] == run["version0"] + 1, (
            f"weight_version went {run['version0']} -> {run['version1']} (refit returned {run['refit_version']}); "
            "import_weights must return the new version, one more than before")

    def test_bad_refit_is_refused_and_keeps_the_old_weights(self, run) -> None:
        assert run["bad_refit"] is not None and run["bad_refit"].startswith("NrlError"), (
            f"a refit missing a tensor must raise nrl_core.refit.RefitError, got {run['bad_refit']!r}")
        assert run["version_after_bad_refit"] == run["version1"], "a refused refit still bumped weight_version"
        assert run["after_bad_refit"] == run["after"], "a refused refit changed the engine's output"

    def test_declared_partial_import_names_manifest_entries_and_loads_as_a_whole_refit(self, run) -> None:
        if "partial_import" not in run["capabilities"]:
            pytest.skip(f"backend '{self.backend}' does not declare 'partial_import'")
        assert run["partial/wants_type"] == "list", (
            f"refit_wants must return a list of manifest names, got a {run['partial/wants_type']}")
        assert not run["partial/wants_outside_manifest"], (
            f"refit_wants named tensors the manifest lacks: {run['partial/wants_outside_manifest']}")
        assert run["partial/original_version"] == 1, "a partial refit must return the new version, one more than before"
        assert run["partial/original"] == run["before"] and run["partial/trained"] == run["after"], (
            "after a refit of only the tensors refit_wants named, the engine generates differently from after a "
            "refit of the whole model: it names a tensor it needs as not wanted, or mishandles a partial manifest")

    def test_declared_pipelined_import_loads_as_import_weights_and_tears_visibly(self, run) -> None:
        if "pipelined_import" not in run["capabilities"]:
            pytest.skip(f"backend '{self.backend}' does not declare 'pipelined_import'")
        assert run["pipelined/original_version"] == run["pipelined/version_before"] + 1, (
            "import_weights_pipelined must return the new version, one more than before")
        assert run["pipelined/original"] == run["before"] and run["pipelined/trained"] == run["after"], (
            "import_weights_pipelined loaded weights that generate differently from import_weights' of the same source")
        assert (run["pipelined/bad_layout"] or "").startswith("NrlError"), (
            f"a manifest the engine's layout cannot take must raise RefitError before loading, got "
            f"{run['pipelined/bad_layout']!r}")
        assert run["pipelined/after_bad_layout"] == run["after"] and run["pipelined/version_after_bad_layout"] == 0, (
            "a manifest refused before loading changed the engine's output or version")
        torn = run["pipelined/torn"] or ""
        assert "the transfer broke after its first bucket" in torn, (
            f"a stream that fails part-way must raise (TornRefitError once loading began), got {torn!r}")
        if torn.startswith("TornRefitError"):
            assert str(run["pipelined/after_torn"]).startswith("NrlError"), (
                f"after a torn import the engine must refuse to generate until a refit succeeds; it gave "
                f"{run['pipelined/after_torn']!r}")
        else:  # the engine staged the stream (it cannot load as tensors arrive): nothing changed
            assert run["pipelined/after_torn"] == run["after"], (
                f"an import that raised {torn!r}, not TornRefitError, must leave the engine's weights unchanged")
        assert run["pipelined/restored"] == run["after"], "the import after a torn one did not restore the weights"

    def test_sampling_state_round_trip_reproduces_samples(self, run) -> None:
        assert run["resampled"] == run["sampled"], (
            "load_sampling_state(sampling_state()) did not make the next samples repeat")

    def test_shutdown_is_safe_twice(self, run) -> None:
        assert run["shutdown"] is None, f"shutdown() twice raised {run['shutdown']}"


def generation_backend_suite(backend: str, *, training_backend: str | None = None, overrides: Sequence[str] = (),
                             training_overrides: Sequence[str] = (), family: str = "llama", size: str = "small",
                             env: Mapping[str, str] | None = None, slow: bool = True) -> type:
    """A test class of every generation-backend check, for ``backend`` (its registered name).

    With ``training_backend`` the refit comes from that backend's worker after three training
    steps (``training_overrides`` for its learning rate); without, from a perturbed HF model.
    Other arguments as for :func:`training_backend_suite`; engines are slow to start, so the
    class is marked slow unless ``slow=False``.
    """
    attrs = {"backend": backend, "training_backend": training_backend, "overrides": tuple(overrides),
             "training_overrides": tuple(training_overrides), "family": family, "size": size,
             "env": dict(env or {}), "__module__": _caller_module()}
    cls = type(f"TestGenerationConformance_{backend}", (_GenerationChecks,), attrs)
    return pytest.mark.slow(cls) if slow else cls


def _caller_module() -> str:
    import inspect

    frame = inspect.stack()[2]
    return str(frame.frame.f_globals.get("__name__", __name__))


__all__ = ["generation_backend_suite", "training_backend_suite", "LOGPROB_TOLERANCE", "INVARIANCE_TOLERANCE"]
