"""Multi-process tests (gloo, world size 1 and 2). Scenarios are combined per spawned run because
starting a Megatron process costs most of the time; each run returns plain results and the
assertions live in the test functions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nrl_core.testing.distributed import gather_shards

pytest.importorskip("megatron.core", reason="nrl-backend-megatron's engine is not installed")
pytest.importorskip("nrl_backend_megatron")

from _helpers import make_batch, make_config, run_world

from nrl_core.testing.tiny_models import cached_tiny_model

FAMILIES = ("llama", "qwen2", "qwen3")


def _hf_reference(family: str, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """HF logits and target logprobs, computed in this (non-distributed) process."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cached_tiny_model(family), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch.input_ids).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros(lp.shape[0], 1), lp], 1)
    return logits, lp * (torch.arange(lp.shape[1])[None] < batch.input_lengths[:, None])


# ------------------------------------------------------------------ world of 1: HF parity, caching (packing: test_conformance)
def world1(rank: int, world: int, paths: dict[str, str]) -> dict[str, Any]:
    from nrl_backend_megatron.worker import MegatronPolicyWorker
    from nrl_core.errors import NrlError
    from nrl_core.sdk.reference import without_reference_model

    out: dict[str, Any] = {}
    batch = make_batch()
    for family, path in paths.items():
        w = MegatronPolicyWorker(make_config(path), rank, world)
        with torch.no_grad():
            pos = torch.arange(batch.input_ids.shape[1])[None].expand(batch.size, -1)
            w.model.eval()
            out[f"{family}/logits"] = w.model(batch.input_ids, pos, None).float()
        out[f"{family}/logprobs"] = gather_shards(w.get_logprobs(batch), batch)
        out[f"{family}/converted"] = w.conversion.converted
        if family == "llama":  # a second worker of the same model reuses the conversion; it is the baseline
            # of a run that never asks for reference logprobs (SFT's): no reference copy
            again = MegatronPolicyWorker(without_reference_model(make_config(path)), rank, world)
            out["again/converted"] = again.conversion.converted
            out["baseline"] = baseline_of(again)
            out["again/reference"] = again.reference
            try:
                again.get_reference_logprobs(batch)
            except NrlError as exc:
                out["again/refused"] = str(exc)
    return out


@pytest.fixture(scope="module")
def w1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("mcore-ckpt")
    paths = {f: str(cached_tiny_model(f)) for f in FAMILIES}
    (result,) = run_world(world1, 1, paths, env={"NRL_MEGATRON_CHECKPOINT_DIR": str(root)})
    result["root"] = root
    return result


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_logits_equal_hf(w1: dict[str, Any], family: str) -> None:
    batch = make_batch()
    logits, lp = _hf_reference(family, batch)
    n = int(batch.input_lengths.min())
    assert (w1[f"{family}/logits"][:, :n] - logits[:, :n]).abs().max() < 1e-4
    assert (w1[f"{family}/logprobs"] - lp).abs().max() < 1e-4


@pytest.mark.slow
def test_conversion_happens_once_then_is_reused(w1: dict[str, Any]) -> None:
    assert w1["llama/converted"] is True and w1["again/converted"] is False  # second worker reuses
    assert all(w1[f"{f}/converted"] for f in FAMILIES)
    assert any(p.name.startswith("model_") for p in w1["root"].iterdir())


# ------------------------------------------------------------------ world of 2: parallel layouts
def world2(rank: int, world: int, path: str, ckpt: str) -> dict[str, Any]:
    import json

    from nrl_backend_megatron import ckpt_io
    from nrl_backend_megatron.worker import MegatronPolicyWorker
    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.contracts import CheckpointOptions
    from nrl_core.errors import NrlError

    out: dict[str, Any] = {}
    batch, loss = make_batch(), NLLLoss()

    def run(tag: str, megatron: dict, export: bool = True) -> MegatronPolicyWorker:
        w = MegatronPolicyWorker(make_config(path, megatron=megatron), rank, world)
        out[f"{tag}/logprobs"] = gather_shards(w.get_logprobs(batch), batch)
        if export:  # the initial weights, before training
            out[f"{tag}/export"] = {n: t for bucket in w.export_weights(20_000, "float32") for n, t in bucket}
            out[f"{tag}/buckets"] = [sum(t.numel() * 4 for _, t in b) for b in w.export_weights(20_000, "float32")]
            out[f"{tag}/manifest"] = w.weight_manifest("float32")
        out[f"{tag}/metrics"] = [w.train(batch, loss) for _ in range(3)]
        out[f"{tag}/optimizer_bytes"] = optimizer_bytes(w)
        return w

    out["dp2/step4"] = run("dp2", {}).train(batch, loss)["loss"]
    # Megatron's distributed optimizer, both overlaps on, as NeMo RL's Megatron recipes train: the
    # same steps with half the optimizer state per rank; its checkpoint resumes bit for bit, here
    # and (w1_from_dp2) at data-parallel 1.
    # what the parameters still hold of their own when DDP allocates its contiguous buffers
    from megatron.core.distributed import param_and_grad_buffer as pgb

    original_buffer = pgb._ParamAndGradBuffer.__init__

    def counting_buffer(self, ddp_config, param_dtype, grad_dtype, params, *a, **k):
        out.setdefault("dist/held_at_buffer", []).append(
            (sum(p.untyped_storage().nbytes() for p in params), max(p.numel() * p.element_size() for p in params)))
        original_buffer(self, ddp_config, param_dtype, grad_dtype, params, *a, **k)

    pgb._ParamAndGradBuffer.__init__ = counting_buffer
    try:
        w = run("dist", DISTRIBUTED_OPTIMIZER)
    finally:
        pgb._ParamAndGradBuffer.__init__ = original_buffer
    # its reference: each rank keeps its own range of the parameter buffers, gathered for the pass
    out["dist/reference"] = gather_shards(w.get_reference_logprobs(batch), batch)
    out["dist/reference_bytes"] = w.reference.host_bytes
    out["dist/param_bytes"] = sum(p.numel() * p.element_size() for p in w.model.parameters())
    w.save_checkpoint(f"{ckpt}/dist")
    out["dist/after_save"] = [w.train(batch, loss)["loss"] for _ in range(2)]
    w.load_checkpoint(f"{ckpt}/dist")
    out["dist/after_load"] = [w.train(batch, loss)["loss"] for _ in range(2)]
    out["ckpt"] = ckpt
    run("pp2", {"pipeline_model_parallel_size": 2})
    # sequence parallelism without Transformer Engine: nrl's norms mark their weights for the
    # tensor-parallel all-reduce of their partial gradients (without it, the second step differs)
    run("tp2sp", {"tensor_model_parallel_size": 2, "sequence_parallel": True}, export=False)
    w = run("tp2", {"tensor_model_parallel_size": 2})

    # Which strategy wrappers the knobs select (spies around Megatron's own classes).
    calls: list[str] = []
    from megatron.core.dist_checkpointing.strategies import fully_parallel as fp

    for cls in (fp.FullyParallelSaveStrategyWrapper, fp.FullyParallelLoadStrategyWrapper):
        original = cls.__init__

        def spy(self, *a, __orig=original, __name=cls.__name__, **k):
            calls.append(__name)
            __orig(self, *a, **k)
        cls.__init__ = spy
    w.save_checkpoint(f"{ckpt}/default")  # knobs from the config section: defaults
    out["default/marker_on_return"] = (Path(ckpt) / "default" / ckpt_io.MARKER).exists()
    w.load_checkpoint(f"{ckpt}/default")
    out["default/wrappers"] = list(calls)
    calls.clear()
    w.save_checkpoint(f"{ckpt}/plain", CheckpointOptions(fully_parallel_save=False))
    w.load_checkpoint(f"{ckpt}/plain", CheckpointOptions(fully_parallel_load=False))
    out["plain/wrappers"] = list(calls)

    # checkpointing.save_optimizer: false: weights and step only; loading it (here into a worker that
    # trained on) puts the weights back bit for bit and starts the optimizer and its schedule fresh
    def optimizer_state() -> int:
        return sum(len(getattr(leaf, "optimizer", leaf).state)
                   for leaf in getattr(w.opt.optimizer, "chained_optimizers", None) or [w.opt.optimizer])

    saved = [p.detach().clone() for p in w.model.parameters()]
    w.save_checkpoint(f"{ckpt}/lean", CheckpointOptions(save_optimizer=False))
    out["lean/sizes"] = [sum(f.stat().st_size for f in (Path(ckpt) / name).rglob("*") if f.is_file())
                         for name in ("default", "lean")]
    out["lean/marker"] = json.loads((Path(ckpt) / "lean" / ckpt_io.MARKER).read_text())["optimizer"]
    out["lean/common"] = sorted(torch.load(Path(ckpt) / "lean" / "common.pt", weights_only=True))
    out["default/common"] = sorted(torch.load(Path(ckpt) / "default" / "common.pt", weights_only=True))
    w.train(batch, loss)
    out["lean/state_before"] = optimizer_state()
    w.load_checkpoint(f"{ckpt}/lean")
    out["lean/weights_equal"] = all(torch.equal(a, b) for a, b in zip(saved, w.model.parameters()))
    out["lean/state"], out["lean/scheduler_steps"], out["lean/step"] = optimizer_state(), w.opt.scheduler.num_steps, w.step
    out["lean/next_loss"] = w.train(batch, loss)["loss"]
    out["lean/state_after_step"] = optimizer_state()
    w.load_checkpoint(f"{ckpt}/default")  # the default brings the optimizer and schedule back
    out["default/state"], out["default/scheduler_steps"] = optimizer_state(), w.opt.scheduler.num_steps

    for bad in ("missing", "default_other"):
        try:
            if bad == "default_other":
                w.ckpt.identity["model_name"] = "someone/else"
                w.load_checkpoint(f"{ckpt}/default")
            else:
                w.load_checkpoint(f"{ckpt}/{bad}")
        except NrlError as exc:
            out[f"error/{bad}"] = str(exc)
    w.ckpt.identity["model_name"] = w.model_name

    # Resume with dropout on (RNG matters): async save, load_rng true/false.
    w = MegatronPolicyWorker(make_config(path, megatron={"tensor_model_parallel_size": 2, "async_save": True},
                                         hf_config_overrides={"attention_dropout": 0.3}), rank, world)
    w.train(batch, loss)
    w.save_checkpoint(f"{ckpt}/async")  # async_save from the config
    out["async/marker_on_return"] = (Path(ckpt) / "async" / ckpt_io.MARKER).exists()
    try:
        w.load_checkpoint(f"{ckpt}/async_not_there")
    except NrlError:
        pass
    out["async/next_loss"] = w.train(batch, loss)["loss"]
    w.finalize_checkpoint()
    out["async/marker_after_finalize"] = (Path(ckpt) / "async" / ckpt_io.MARKER).exists()
    torch.manual_seed(1000 + rank)
    w.load_checkpoint(f"{ckpt}/async", CheckpointOptions(load_rng=True))
    out["rng_true/next_loss"] = w.train(batch, loss)["loss"]
    torch.manual_seed(2000 + rank)
    w.load_checkpoint(f"{ckpt}/async")  # load_rng default: false
    out["rng_false/next_loss"] = w.train(batch, loss)["loss"]

    # NaN in a gradient: Megatron's own check (in the gradient reduction) and nrl's guard (loss and
    # gradient norm before the optimizer step) each stop it; only with both off does it train on.
    def nan_loss(logprobs, mb, **kw):
        value, metrics = loss(logprobs, mb, **kw)
        return value * float("nan"), metrics

    def inf_loss(logprobs, mb, **kw):
        value, metrics = loss(logprobs, mb, **kw)
        return value * float("inf"), {**metrics, "loss": metrics["loss"] * float("inf")}

    cases = {"both": ({}, {}, nan_loss), "guard": ({"check_for_nan_in_grad": False}, {}, nan_loss),
             "inf": ({"check_for_nan_in_grad": False}, {}, inf_loss),
             "off": ({"check_for_nan_in_grad": False}, {"check_for_nan": False}, nan_loss)}
    for tag, (megatron, policy, loss_fn) in cases.items():
        w = MegatronPolicyWorker(make_config(path, megatron=megatron, **policy), rank, world)
        before = [p.detach().clone() for p in w.model.parameters()]
        try:
            out[f"nan/{tag}"] = ("trained", w.train(batch, loss_fn)["grad_norm"])
        except Exception as exc:  # noqa: BLE001
            out[f"nan/{tag}"] = (type(exc).__name__, str(exc))
        out[f"nan/{tag}/unchanged"] = all(torch.equal(a, b) for a, b in zip(before, w.model.parameters()))
    return out


def optimizer_bytes(worker: Any) -> int:
    leaves = getattr(worker.opt.optimizer, "chained_optimizers", None) or [worker.opt.optimizer]
    return sum(t.numel() * t.element_size() for leaf in leaves for state in leaf.optimizer.state.values()
               for t in state.values() if torch.is_tensor(t))


DISTRIBUTED_OPTIMIZER = {"optimizer": {"use_distributed_optimizer": True},
                         "distributed_data_parallel_config": {"overlap_grad_reduce": True, "overlap_param_gather": True}}


def from_dp2(rank: int, world: int, path: str, ckpt: str) -> dict[str, Any]:
    """Data-parallel 1 resumes the data-parallel-2 distributed optimizer's checkpoint; one without
    the distributed optimizer is refused in one line."""
    from nrl_backend_megatron.worker import MegatronPolicyWorker
    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.errors import NrlError

    out: dict[str, Any] = {}
    w = MegatronPolicyWorker(make_config(path, megatron=DISTRIBUTED_OPTIMIZER), rank, world)
    w.load_checkpoint(f"{ckpt}/dist")
    out["step"] = w.step
    out["losses"] = [w.train(make_batch(), NLLLoss())["loss"] for _ in range(2)]
    plain = MegatronPolicyWorker(make_config(path), rank, world)
    try:
        plain.load_checkpoint(f"{ckpt}/dist")
    except NrlError as exc:
        out["refused"] = str(exc)
    return out


@pytest.fixture(scope="module")
def w1_from_dp2(w2: list[dict[str, Any]]) -> dict[str, Any]:
    (result,) = run_world(from_dp2, 1, str(cached_tiny_model("llama")), w2[0]["ckpt"])
    return result


@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    ckpt = tmp_path_factory.mktemp("mcore-train-ckpt")
    return run_world(world2, 2, str(cached_tiny_model("llama")), str(ckpt))  # the session's conversions


@pytest.fixture(scope="module")
def w1_baseline(w1: dict[str, Any]) -> dict[str, Any]:
    """A fresh single-rank worker of the tiny Llama: its logprobs, then three training steps."""
    return w1["baseline"]


def baseline_of(worker: Any) -> dict[str, Any]:
    from nrl_core.algorithms.loss import NLLLoss

    batch = make_batch()
    return {"logprobs": gather_shards(worker.get_logprobs(batch), batch),
            "metrics": [worker.train(batch, NLLLoss()) for _ in range(3)]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "tp2sp", "pp2", "dp2", "dist"])
def test_parallel_layout_equals_single_rank(w2, w1_baseline, layout: str) -> None:
    for rank in w2:
        assert (rank[f"{layout}/logprobs"] - w1_baseline["logprobs"]).abs().max() < 1e-5
        ours = [m["loss"] for m in rank[f"{layout}/metrics"]]
        ref = [m["loss"] for m in w1_baseline["metrics"]]
        assert max(abs(a - b) for a, b in zip(ours, ref)) < 1e-5
        gn = [m["grad_norm"] for m in rank[f"{layout}/metrics"]]
        assert max(abs(a - b["grad_norm"]) for a, b in zip(gn, w1_baseline["metrics"])) < 1e-4


@pytest.mark.slow
def test_the_distributed_optimizer_halves_the_state_and_resumes_exactly_at_either_data_parallel_size(
        w2, w1_from_dp2) -> None:
    """Each of two data-parallel ranks holds half of Adam's state and of the reference weights (to
    the bucket padding); its checkpoint resumes bit for bit at data-parallel 2 and, to float32
    reduction order, at 1."""
    for rank in w2:
        assert 0.45 < rank["dist/optimizer_bytes"] / rank["dp2/optimizer_bytes"] <= 0.55
        assert rank["dist/after_load"] == rank["dist/after_save"]
        # the reference pass after three steps scores with the initial weights, from half the host
        # copy, and puts the trained ones back: the fourth step is the plain optimizer's
        assert torch.equal(rank["dist/reference"], rank["dist/logprobs"])
        assert 0.45 < rank["dist/reference_bytes"] / rank["dist/param_bytes"] <= 0.55
        assert abs(rank["dist/after_save"][0] - rank["dp2/step4"]) < 1e-5
    assert w2[0]["dist/optimizer_bytes"] + w2[1]["dist/optimizer_bytes"] >= w2[0]["dp2/optimizer_bytes"]
    assert w1_from_dp2["step"] == 3
    assert max(abs(a - b) for a, b in zip(w1_from_dp2["losses"], w2[0]["dist/after_save"])) < 1e-5
    refused = w1_from_dp2["refused"]
    assert "\n" not in refused and "holds the distributed optimizer's state" in refused
    assert "use_distributed_optimizer: true" in refused


@pytest.mark.slow
def test_a_run_that_never_asks_for_the_reference_keeps_no_copy(w1) -> None:
    assert w1["again/reference"] is None
    assert "keeps no reference policy" in w1["again/refused"] and "\n" not in w1["again/refused"]


@pytest.mark.slow
def test_the_distributed_optimizer_loads_into_its_buffers_without_a_second_copy(w2) -> None:
    """When DDP allocates the contiguous buffer the distributed optimizer shards, the parameters it
    will hold have already let their own storage go (one element each, far below the largest
    tensor), so a rank never holds its weights twice; they are loaded into the buffer after (the
    layout's logprobs equal one rank's, above)."""
    for rank in w2:
        assert rank["dist/held_at_buffer"]
        for held, largest in rank["dist/held_at_buffer"]:
            assert held < largest


@pytest.mark.slow
def test_loss_falls(w1_baseline) -> None:
    losses = [m["loss"] for m in w1_baseline["metrics"]]
    assert losses[2] < losses[1] < losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_export_gathers_full_hf_tensors(w2, layout: str) -> None:
    """Sharded weights gathered back (TP all-gather, PP broadcast) are the HF file's, bit for bit."""
    from safetensors.torch import load_file

    hf = load_file(str(cached_tiny_model("llama") / "model.safetensors"))
    for rank in w2:
        exported = rank[f"{layout}/export"]
        assert exported.keys() == hf.keys()
        assert all(exported[k].shape == hf[k].shape for k in hf)
        assert [s.name for s in rank[f"{layout}/manifest"]] == list(exported)
        assert max(rank[f"{layout}/buckets"]) <= max(20_000, max(t.numel() * 4 for t in hf.values()))
    # every rank sees the same full tensors
    assert all(torch.equal(w2[0][f"{layout}/export"][k], w2[1][f"{layout}/export"][k]) for k in hf)
    assert all(torch.equal(w2[0][f"{layout}/export"][k], hf[k]) for k in hf)


@pytest.mark.slow
def test_checkpoint_knobs(w2) -> None:
    for rank in w2:
        assert rank["default/wrappers"] == ["FullyParallelSaveStrategyWrapper", "FullyParallelLoadStrategyWrapper"]
        assert rank["plain/wrappers"] == []
        assert rank["async/marker_on_return"] is False and rank["async/marker_after_finalize"] is True
        assert rank["rng_true/next_loss"] == rank["async/next_loss"]  # bit-identical resume
        assert rank["rng_false/next_loss"] != rank["async/next_loss"]
    assert w2[0]["default/marker_on_return"] is True


@pytest.mark.slow
def test_checkpoints_without_optimizer_state(w2) -> None:
    for rank in w2:
        default, lean = rank["lean/sizes"]
        assert lean < 0.6 * default  # Adam keeps two moments per weight
        assert rank["lean/marker"] is False
        assert "scheduler" in rank["default/common"] and "scheduler" not in rank["lean/common"]
        assert rank["lean/state_before"] > 0 and rank["lean/weights_equal"]
        assert (rank["lean/state"], rank["lean/scheduler_steps"], rank["lean/step"]) == (0, 0, 3)  # fresh, step kept
        assert rank["lean/state_after_step"] == rank["lean/state_before"]  # built again at the next step
        assert rank["default/state"] > 0 and rank["default/scheduler_steps"] == 3


@pytest.mark.slow
def test_bad_training_checkpoints_are_one_line(w2) -> None:
    for rank in w2:
        assert "does not exist" in rank["error/missing"] and "\n" not in rank["error/missing"]
        assert "another model" in rank["error/default_other"] and "\n" not in rank["error/default_other"]


@pytest.mark.slow
def test_nan_stops_training_unless_both_checks_are_off(w2) -> None:
    for rank in w2:
        for tag, says in (("both", "Megatron-Core's check"), ("guard", "grad_norm=nan"), ("inf", "loss=inf")):
            status, detail = rank[f"nan/{tag}"]
            assert status == "NonFiniteError" and "\n" not in detail, (tag, detail)
            assert "training step 1 (megatron)" in detail and says in detail and "policy.check_for_nan" in detail
            assert rank[f"nan/{tag}/unchanged"], tag
        assert rank["nan/off"][0] == "trained" and not rank["nan/off/unchanged"]
