"""The dtensor worker at world size 1 (in the pytest process): training, logprobs, packing,
weights out, checkpoints and bad input."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from common import make_batch, make_config
from torch.distributed.tensor import DTensor

from nrl_backend_dtensor.worker import DTensorPolicyWorker
from nrl_core.algorithms.loss import NLLLoss
from nrl_core.contracts import CheckpointOptions, TrainingWorker
from nrl_core.errors import ConfigError, NrlError
from nrl_core.testing.distributed import gather_shards
from nrl_core.testing.tiny_models import cached_tiny_model


def worker(**overrides) -> DTensorPolicyWorker:
    return DTensorPolicyWorker(make_config(**overrides), 0, 1)


def params(w: DTensorPolicyWorker) -> list[torch.Tensor]:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in w.model.parameters()]


def fsdp_worker(**overrides) -> DTensorPolicyWorker:
    """A worker wrapped in FSDP2 although it runs at one data-parallel rank in float32."""
    from nrl_backend_dtensor import parallel

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(parallel, "fsdp_needed", lambda *a, **k: True)
        return worker(**overrides)


@pytest.mark.parametrize("chunk", [None, 16])
def test_one_rank_in_float32_skips_fsdp_and_trains_bit_identically(chunk):
    """FSDP2 at one rank shards nothing but copies every layer's parameters in and its gradients
    out; the worker leaves it out there, and the logprobs, losses, gradient norms and weights are
    exactly the wrapped worker's. Chunked logprobs call the output head, an FSDP unit of its own,
    once per chunk and again when each chunk is recomputed in backward."""
    from torch.distributed.fsdp import FSDPModule

    batch = make_batch()
    plain, wrapped = worker(logprob_chunk_size=chunk), fsdp_worker(logprob_chunk_size=chunk)
    assert not plain.fsdp and not any(isinstance(m, FSDPModule) for m in plain.model.modules())
    assert wrapped.fsdp and isinstance(wrapped.model, FSDPModule)
    for _ in range(2):
        a, b = plain.train(batch, NLLLoss()), wrapped.train(batch, NLLLoss())
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
        # the plain worker points its parameters at the reference copy for this pass, then back
        assert torch.equal(gather_shards(plain.get_reference_logprobs(batch), batch),
                           gather_shards(wrapped.get_reference_logprobs(batch), batch))
    assert all(torch.equal(x, y) for x, y in zip(params(plain), params(wrapped)))
    assert torch.equal(gather_shards(plain.get_logprobs(batch), batch), gather_shards(wrapped.get_logprobs(batch), batch))


def test_loss_falls_and_reference_stays_initial():
    w = worker()
    assert isinstance(w, TrainingWorker)
    batch = make_batch()
    initial = gather_shards(w.get_logprobs(batch), batch)
    assert initial.dtype == torch.float32 and initial.shape == batch.input_ids.shape
    assert torch.all(initial[:, 0] == 0) and torch.all(initial[batch.input_ids == 3] == 0)
    losses = [w.train(batch, NLLLoss())["loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 0.5, losses
    assert w.step == 4
    assert torch.equal(gather_shards(w.get_reference_logprobs(batch), batch), initial)
    assert not torch.allclose(gather_shards(w.get_logprobs(batch), batch), initial)


def test_a_run_that_never_asks_for_the_reference_keeps_no_copy_and_says_so_in_one_line():
    """The core marks the config of an algorithm with ``reference_policy`` false (SFT): the worker
    takes no host copy of its weights, and a reference pass is refused in one line."""
    from nrl_core.sdk.reference import without_reference_model

    w = DTensorPolicyWorker(without_reference_model(make_config()), 0, 1)
    assert w.reference is None
    with pytest.raises(NrlError, match="keeps no reference policy") as info:
        w.get_reference_logprobs(make_batch())
    assert "\n" not in str(info.value)
    assert w.train(make_batch(), NLLLoss())["loss"] > 0


def test_gradients_reduce_once_per_step_with_the_same_update(monkeypatch):
    """Four micro-batches: FSDP reduces each parameter group's gradients once per optimizer step,
    after the last micro-batch, and the update is bit-identical to reducing after every one."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    reduces = []
    real_reduce = _fsdp_param_group.foreach_reduce
    monkeypatch.setattr(_fsdp_param_group, "foreach_reduce", lambda *a, **k: reduces.append(1) or real_reduce(*a, **k))
    batch = make_batch()
    once = fsdp_worker()
    groups = sum(isinstance(m, FSDPModule) for m in once.model.modules())
    once.train(batch, NLLLoss())
    assert len(reduces) == groups

    real_sync = FSDPModule.set_requires_gradient_sync
    monkeypatch.setattr(FSDPModule, "set_requires_gradient_sync", lambda self, _, **k: real_sync(self, True, **k))
    every = fsdp_worker()
    every.train(batch, NLLLoss())
    assert len(reduces) == groups + 4 * groups  # make_batch: 8 sequences, micro-batches of 2
    assert all(torch.equal(a, b) for a, b in zip(params(once), params(every)))


def test_fsdp_reduces_and_reshards_the_output_head_right_after_its_backward():
    """Untied, the output head is an FSDP unit of its own: gathered at its forward, and back to its
    shard (its gradient reduced) once its backward is done, rather than staying gathered, with its
    whole gradient, until the root's backward ends."""
    from torch.distributed.fsdp import FSDPModule

    w = fsdp_worker()
    head = w.model.hf.get_output_embeddings()
    assert isinstance(head, FSDPModule) and not isinstance(w.model.hf.get_input_embeddings(), FSDPModule)
    ids = make_batch().input_ids[:2]
    head_sharded_in_backward = []

    def watch(module, args, out):
        (out[0] if isinstance(out, tuple) else out).register_hook(
            lambda grad: head_sharded_in_backward.append(isinstance(head.weight, DTensor)))

    w.model.hf.model.layers[0].register_forward_hook(watch)
    logprobs = w.model(ids, torch.arange(ids.shape[1]).expand_as(ids))
    assert not isinstance(head.weight, DTensor)  # kept from its forward to its backward
    logprobs.sum().backward()
    assert head_sharded_in_backward == [True]


@pytest.mark.parametrize("mode", ["packing", "dynamic", "chunked+checkpointing"])
def test_packed_dynamic_chunked_equal_padded(mode):
    batch = make_batch(seed=1)
    if mode == "packing":
        over = dict(sequence_packing={"enabled": True, "train_mb_tokens": 48, "logprob_mb_tokens": 64,
                                      "sequence_length_round": 4})
    elif mode == "dynamic":
        over = dict(dynamic_batching={"enabled": True, "train_mb_tokens": 48, "logprob_mb_tokens": 64,
                                      "sequence_length_round": 4})
    else:
        over = dict(logprob_chunk_size=5, dtensor_config={"activation_checkpointing": True})
    padded, other = worker(), worker(**over)
    assert torch.allclose(gather_shards(other.get_logprobs(batch), batch), gather_shards(padded.get_logprobs(batch), batch), atol=1e-5, rtol=0)
    for _ in range(2):
        a, b = padded.train(batch, NLLLoss()), other.train(batch, NLLLoss())
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4
    assert torch.allclose(gather_shards(other.get_logprobs(batch), batch), gather_shards(padded.get_logprobs(batch), batch), atol=1e-5, rtol=0)


@pytest.mark.parametrize("packed", [False, True])
def test_sliding_window_layers_keep_their_window(packed):
    """Gemma 3's local layers see only the last ``sliding_window`` tokens. The backend's own
    attention, padded or packed, gives the logprobs of transformers' SDPA forward (which builds the
    banded mask, as vLLM applies the window) for sequences well past the window."""
    from transformers import AutoModelForCausalLM

    from nrl_core.api import hf_logprobs

    batch = make_batch(max_len=48, min_len=24, seed=2)
    over = dict(sequence_packing={"enabled": True, "train_mb_tokens": 96, "logprob_mb_tokens": 96,
                                  "sequence_length_round": 4}) if packed else {}
    w = worker(family="gemma3", max_total_sequence_length=48, **over)
    plain = AutoModelForCausalLM.from_pretrained(w.policy["model_name"], dtype=torch.float32, attn_implementation="sdpa")
    assert plain.config.sliding_window < 24 and "sliding_attention" in plain.config.layer_types
    assert (hf_logprobs(plain.eval(), batch, 1.0) - gather_shards(w.get_logprobs(batch), batch)).abs().max() < 1e-5


def test_weights_out_and_hf_export_reload(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    w = worker(logprob_batch_size=8)  # one forward, so the hook below sees every row
    batch = make_batch()
    w.train(batch, NLLLoss())
    manifest = w.weight_manifest("bfloat16")
    buckets = list(w.export_weights(bucket_bytes=40_000, dtype="bfloat16"))
    flat = [(n, t) for b in buckets for n, t in b]
    assert [(n, tuple(t.shape), str(t.dtype)) for n, t in flat] == \
        [(s.name, s.shape, "torch." + s.dtype) for s in manifest]
    assert all(sum(t.numel() * 2 for _, t in b) <= 40_000 or len(b) == 1 for b in buckets) and len(buckets) > 1
    assert "model.layers.0.self_attn.q_proj.weight" in dict(flat)

    captured = []
    hook = w.model.hf.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach().clone()))
    gather_shards(w.get_logprobs(batch), batch)
    hook.remove()
    w.export_hf(str(tmp_path / "hf"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    AutoTokenizer.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        logits = reloaded(input_ids=batch.input_ids).logits[:, :-1]
    assert torch.equal(logits, captured[0])


def test_checkpoint_resume_is_bit_identical_with_load_rng(tmp_path):
    # attention dropout makes the next step depend on the RNG state
    over = dict(hf_config_overrides={"attention_dropout": 0.2})
    batch = make_batch()
    a = worker(**over)
    a.train(batch, NLLLoss())
    a.save_checkpoint(str(tmp_path / "ck"), CheckpointOptions(load_rng=True))
    saved = params(a)
    expected = a.train(batch, NLLLoss())["loss"]

    b = worker(**over)
    b.load_checkpoint(str(tmp_path / "ck"), CheckpointOptions(load_rng=True))
    assert all(torch.equal(x, y) for x, y in zip(params(b), saved)) and b.step == 1
    assert b.train(batch, NLLLoss())["loss"] == expected  # bit-identical

    c = worker(**over)
    c.load_checkpoint(str(tmp_path / "ck"), CheckpointOptions(load_rng=False))
    assert c.train(batch, NLLLoss())["loss"] != expected  # the RNG state is what made it identical


def _optimizer_tensors(w: DTensorPolicyWorker) -> list[torch.Tensor]:
    return [(v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for state in w.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
def test_checkpoints_without_optimizer_state(tmp_path, caplog, layout):
    """checkpointing.save_optimizer: false writes the weights and step only: no optimizer or
    scheduler state (a smaller checkpoint), and a resume loads the weights bit for bit and starts
    the optimizer and its schedule fresh (NeMo RL's rule). The default still saves and restores
    both exactly; the checkpoint manager's checksums accept the lean checkpoint and still fall
    back from a corrupted one."""
    import json

    from nrl_backend_dtensor.safe_load import SafeFileSystemReader, load_file
    from nrl_core.checkpoint.manager import CheckpointManager

    manager = CheckpointManager({"enabled": True, "checkpoint_dir": str(tmp_path / "run"), "save_period": 1,
                                 "keep_top_k": None, "metric_name": None})
    batch = make_batch()
    a = fsdp_worker()
    for _ in range(2):  # the LinearLR warm-up moves the learning rate at each step
        a.train(batch, NLLLoss())
    saved, moments = params(a), _optimizer_tensors(a)
    lr, sched = a.optimizer.param_groups[0]["lr"], a.scheduler.state_dict()["last_epoch"]
    for step, save_optimizer in ((1, True), (2, False)):
        tmp = manager.prepare(step)
        a.save_checkpoint(str(tmp / "policy"), CheckpointOptions(save_optimizer=save_optimizer,
                                                                 fully_parallel_save=layout == "sharded"))
        manager.commit(step, tmp, {})
    full, lean = manager.root / "step_1" / "policy", manager.root / "step_2" / "policy"

    def size(root):
        return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())

    assert size(lean) < 0.6 * size(full)  # AdamW keeps two moments per weight
    assert json.loads((lean / "nrl_checkpoint.json").read_text())["optimizer"] is False
    assert set(load_file(str(lean / "trainer_state.pt"))) == {"step"}
    assert set(load_file(str(full / "trainer_state.pt"))) == {"step", "scheduler"}
    for root, has_optim in ((full, True), (lean, False)):
        if layout == "sharded":
            keys = SafeFileSystemReader(str(root / "model_optim")).read_metadata().state_dict_metadata
        else:
            keys = load_file(str(root / "consolidated.pt"))
        assert any(k.startswith("optim") for k in keys) is has_optim and any(k.startswith("model") for k in keys)
    assert manager.latest_verified().name == "step_2"  # a checkpoint without optimizer files verifies

    fresh = fsdp_worker()
    for opts in (CheckpointOptions(), CheckpointOptions(fully_parallel_load=False)):
        b = fsdp_worker()
        b.load_checkpoint(str(lean), opts)
        assert all(torch.equal(x, y) for x, y in zip(params(b), saved)) and b.step == 2
        assert len(b.optimizer.state) == 0  # Adam starts without moments or step count
        assert b.optimizer.param_groups[0]["lr"] == fresh.optimizer.param_groups[0]["lr"] != lr
        assert b.scheduler.state_dict()["last_epoch"] == 0
        b.train(batch, NLLLoss())
        assert {float(s["step"]) for s in b.optimizer.state.values()} == {1.0}

        c = fsdp_worker()  # the default: optimizer and schedule come back exactly
        c.load_checkpoint(str(full), opts)
        assert all(torch.equal(x, y) for x, y in zip(params(c), saved)) and c.step == 2
        assert all(torch.equal(x, y) for x, y in zip(_optimizer_tensors(c), moments)) and len(moments) > 0
        assert c.optimizer.param_groups[0]["lr"] == lr and c.scheduler.state_dict()["last_epoch"] == sched

    with caplog.at_level("INFO", logger="nrl_backend_dtensor.checkpoint"):
        a.load_checkpoint(str(lean), CheckpointOptions())  # a worker that has trained is reset too
    assert len(a.optimizer.state) == 0 and a.optimizer.param_groups[0]["lr"] == fresh.optimizer.param_groups[0]["lr"]
    assert "holds no optimizer state" in caplog.text and "start fresh" in caplog.text

    shard = next(p for p in lean.rglob("*") if p.suffix in (".distcp", ".pt") and p.parent.name != "rng"
                 and p.name != "trainer_state.pt")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert manager.latest_verified().name == "step_1"  # a corrupted one still falls back


def test_failed_loads_are_one_line_and_leave_the_model_untouched(tmp_path):
    a = worker()
    batch = make_batch()
    a.save_checkpoint(str(tmp_path / "good"), CheckpointOptions())
    a.train(batch, NLLLoss())
    before = gather_shards(a.get_logprobs(batch), batch)

    truncated = tmp_path / "truncated"
    shutil.copytree(tmp_path / "good", truncated)
    shard = next(p for p in (truncated / "model_optim").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    incomplete = tmp_path / "incomplete"
    shutil.copytree(tmp_path / "good", incomplete)
    os.remove(incomplete / "nrl_checkpoint.json")
    other = DTensorPolicyWorker(make_config("qwen3"), 0, 1)
    other.save_checkpoint(str(tmp_path / "qwen3"), CheckpointOptions())

    cases = {str(tmp_path / "missing"): "does not exist", str(truncated): "truncated",
             str(incomplete): "incomplete", str(tmp_path / "qwen3"): "another architecture"}
    for path, words in cases.items():
        for opts in (CheckpointOptions(), CheckpointOptions(fully_parallel_load=False)):
            with pytest.raises(NrlError, match=words) as info:
                a.load_checkpoint(path, opts)
            assert "\n" not in str(info.value)
    # a truncated shard that passes the size check still fails inside DCP, before any copy
    (truncated / "nrl_checkpoint.json").unlink()
    shutil.copy(tmp_path / "good" / "nrl_checkpoint.json", truncated / "nrl_checkpoint.json")
    import json
    marker = json.loads((truncated / "nrl_checkpoint.json").read_text())
    marker["files"] = {k: v for k, v in marker["files"].items() if not k.endswith(".distcp")}
    (truncated / "nrl_checkpoint.json").write_text(json.dumps(marker))
    with pytest.raises(NrlError, match="truncated or corrupt") as info:
        a.load_checkpoint(str(truncated), CheckpointOptions())
    assert "\n" not in str(info.value)
    assert torch.equal(gather_shards(a.get_logprobs(batch), batch), before) and a.step == 1


def test_bad_model_and_config_are_one_line(tmp_path):
    from transformers import BertConfig

    BertConfig(architectures=["BertForMaskedLM"], hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32).save_pretrained(
        tmp_path / "bert")
    cases = [(dict(model_name=str(tmp_path / "nope")), NrlError, "is not a directory"),
             (dict(model_name=str(tmp_path / "bert")), NrlError, "not a causal language model"),
             (dict(dtensor_config={"context_parallel_size": 2}), ConfigError, "not supported"),
             (dict(dtensor_config={"tensor_parallel_size": 2}), ConfigError, "does not divide the world size")]
    for overrides, error, words in cases:
        with pytest.raises(error, match=words) as info:
            worker(**overrides)
        assert "\n" not in str(info.value)
    assert cached_tiny_model("llama").exists()


class _Diverged:
    """NLL scaled by ``factor`` (NaN or Inf), in the loss and its reported metric alike."""

    def __init__(self, factor: float) -> None:
        self.factor, self.inner = factor, NLLLoss()

    def __call__(self, logprobs, batch, **kw):
        loss, metrics = self.inner(logprobs, batch, **kw)
        return loss * self.factor, {**metrics, "loss": metrics["loss"] * self.factor}


@pytest.mark.parametrize("factor", [float("nan"), float("inf")])
def test_nonfinite_loss_stops_before_the_optimizer_step(factor):
    from nrl_core.nonfinite import NonFiniteError

    w = worker()
    batch = make_batch()
    w.train(batch, NLLLoss())
    before = params(w)
    with pytest.raises(NonFiniteError) as info:
        w.train(batch, _Diverged(factor))
    message = str(info.value)
    assert "\n" not in message and "training step 2 (dtensor)" in message and "policy.check_for_nan" in message
    assert f"loss={factor}" in message and "grad_norm=nan" in message
    assert w.step == 1
    assert all(torch.equal(a, b) for a, b in zip(before, params(w)))


def test_nonfinite_guard_can_be_turned_off():
    w = worker(check_for_nan=False)
    metrics = w.train(make_batch(), _Diverged(float("nan")))
    assert w.step == 1 and metrics["grad_norm"] != metrics["grad_norm"]
    assert all(torch.isnan(p).any() for p in params(w))


def test_a_batch_on_another_device_than_the_logprobs_fails_in_check_mode(monkeypatch):
    """With NRL_CHECK_DEVICES=1 (the suite's setting) the worker checks the batch the loss reads
    against the logprobs' device; a batch left behind (here: sent to the meta device) is one line."""
    from nrl_core import device
    from nrl_core.contracts import TokenBatch
    from nrl_core.engine import worker as worker_module  # the engine moves what the loss reads

    w = worker()
    w.train(make_batch(), NLLLoss())  # moved where the logprobs are: passes the check
    misplaced = lambda value, where: device.to_device(value, "meta" if isinstance(value, TokenBatch) else where)
    monkeypatch.setattr(worker_module, "to_device", misplaced)
    monkeypatch.setenv(device.CHECK_DEVICES_ENV, "1")
    with pytest.raises(NrlError, match=r"^dtensor train: batch\.\S+ is on meta but the logprobs are on cpu"):
        w.train(make_batch(), NLLLoss())


@pytest.mark.parametrize(("family", "save_optimizer"), [("llama", True), ("llama", False), ("gemma3", True)])
def test_safetensors_checkpoints_hold_the_weights_by_hf_name_and_resume_exactly(tmp_path, family, save_optimizer):
    """checkpointing.model_save_format: safetensors (NeMo RL's DTensor format): the weights are
    safetensors shards under their Hugging Face names, the optimizer DCP shards beside them; a
    resume is exact, through either load path, and the marker records the format. Gemma 3 ties
    its output layer to the embeddings: the tied weight is written once, as save_pretrained does."""
    import json

    from safetensors import safe_open

    batch = make_batch()
    a = fsdp_worker(family=family)
    a.train(batch, NLLLoss())
    path = tmp_path / "ck"
    a.save_checkpoint(str(path), CheckpointOptions(model_save_format="safetensors", save_optimizer=save_optimizer))
    assert json.loads((path / "nrl_checkpoint.json").read_text())["format"] == "safetensors"
    assert not (path / "model_optim").exists() and (path / "optim").exists() is save_optimizer
    names: dict[str, torch.Tensor] = {}
    for file in (path / "model").glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names.update({key: f.get_tensor(key) for key in f.keys()})
    live = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for name, p in a.model.hf.named_parameters()}
    assert set(live) <= set(names) and all(torch.equal(names[n], t) for n, t in live.items())
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert ("lm_head.weight" in names) is (family == "llama")
    saved, expected = params(a), a.train(batch, NLLLoss())["loss"]
    stepped = params(a)
    for parallel_load in (True, False):
        b = fsdp_worker(family=family)
        b.load_checkpoint(str(path), CheckpointOptions(fully_parallel_load=parallel_load))
        assert all(torch.equal(x, y) for x, y in zip(params(b), saved)) and b.step == 1
        assert b.train(batch, NLLLoss())["loss"] == expected
        # Adam's moments came back, or (without them) a fresh optimizer takes another step
        assert all(torch.equal(x, y) for x, y in zip(params(b), stepped)) is save_optimizer


def test_cpu_offload_is_a_no_op_where_the_device_is_the_cpu():
    """dtensor_cfg.cpu_offload (NeMo RL's sliding-puzzle recipe sets it) moves device state to
    pinned host memory; on a CPU there is nothing to move and pinning needs an accelerator, so the
    worker builds and trains exactly as without it (before, FSDP raised at construction)."""
    batch = make_batch()
    offloaded, plain = worker(dtensor_config={"cpu_offload": True}), worker()
    assert not offloaded.fsdp and offloaded.moves_to_host == plain.moves_to_host
    assert offloaded.train(batch, NLLLoss())["loss"] == plain.train(batch, NLLLoss())["loss"]
    assert all(torch.equal(a, b) for a, b in zip(params(offloaded), params(plain)))
