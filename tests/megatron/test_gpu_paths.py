"""What the Megatron backend does for GPU runs, checked on the CPU: the batch the loss reads is
checked against the logprobs' device, parameters are synced before they are read when the
distributed optimizer defers its all-gather, the colocated hand-off leaves training bit-identical,
sequence parallelism pads to the tensor-parallel size, and context parallelism is refused (its
sequences are not split per rank)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="nrl-backend-megatron's engine is not installed")
pytest.importorskip("nrl_backend_megatron")

from _helpers import make_batch, make_config, run_world

from nrl_core.errors import ConfigError
from nrl_core.testing.tiny_models import cached_tiny_model


def world1(rank: int, world: int, path: str, ckpt: str) -> dict[str, Any]:
    from nrl_backend_megatron import worker as worker_module
    from nrl_core import device
    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.errors import NrlError

    w = worker_module.MegatronPolicyWorker(make_config(path), rank, world)
    batch = make_batch()
    out: dict[str, Any] = {"loss": w.train(batch, NLLLoss())["loss"]}  # check mode on: the batch is in place

    # the distributed optimizer with overlap_param_gather (CUDA only) defers the parameters'
    # all-gather to the next forward: whatever reads them first must finish it
    calls: list[dict] = []
    w.ddp_config = dataclasses.replace(w.ddp_config, overlap_param_gather=True, use_distributed_optimizer=True)
    w.ddp.start_param_sync = lambda *a, **k: calls.append(k)
    list(w.export_weights(1 << 30, "float32"))
    out["synced/export"] = list(calls)
    w.get_reference_logprobs(batch)
    out["synced/reference"] = list(calls)
    w.save_checkpoint(ckpt)
    out["synced/save"] = list(calls)

    def misplaced(value: Any, where: Any) -> Any:
        moved = device.to_device(value, where)
        return dataclasses.replace(moved, rows=device.to_device(moved.rows, "meta"))

    worker_module.to_device = misplaced
    try:
        w.train(batch, NLLLoss())
        out["misplaced"] = None
    except NrlError as exc:
        out["misplaced"] = str(exc)

    import gc
    import weakref

    # a dropped worker must free its device memory: nothing global (the exit finalizer) may hold it
    refs = [weakref.ref(w), weakref.ref(next(w.model.parameters()))]
    del w
    gc.collect()
    out["alive_after_drop"] = [r() is not None for r in refs]
    return out


@pytest.fixture(scope="module")
def w1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("mcore-gpu-paths")
    (result,) = run_world(world1, 1, str(cached_tiny_model("llama")), str(root / "ckpt"),
                          env={"NRL_CHECK_DEVICES": "1"})  # the session's conversion
    return result


@pytest.mark.slow
def test_a_batch_on_another_device_than_the_logprobs_fails_in_check_mode(w1: dict[str, Any]) -> None:
    assert w1["loss"] == w1["loss"]
    assert w1["misplaced"] is not None and "\n" not in w1["misplaced"]
    assert w1["misplaced"].startswith("megatron train: batch.input_ids is on meta but the logprobs are on cpu")


@pytest.mark.slow
def test_a_dropped_worker_is_collected_with_its_parameters(w1: dict[str, Any]) -> None:
    """On a GPU a closed worker kept its memory allocated: the exit finalizer held the worker."""
    assert w1["alive_after_drop"] == [False, False]


@pytest.mark.slow
def test_parameters_are_synced_before_export_reference_logprobs_and_save(w1: dict[str, Any]) -> None:
    assert w1["synced/export"] == [{"force_sync": True}]
    assert w1["synced/reference"] == [{"force_sync": True}] * 2
    assert w1["synced/save"] == [{"force_sync": True}] * 3


# the hand-off run also empties the (CUDA) cache at every point and recomputes attention in backward:
# neither may change a bit either
HANDED_MEGATRON = {"empty_unused_memory_level": 2, "activation_checkpointing": True, "recompute_granularity": "selective"}


def handoff_world(rank: int, world: int, path: str, handoff: bool) -> dict[str, Any]:
    """Two training steps, with or without the colocated hand-off (both offloads, then prepare)
    between them: the losses and the final weights."""
    from nrl_backend_megatron.optim import main_params
    from nrl_backend_megatron.worker import MegatronPolicyWorker
    from nrl_core.algorithms.loss import NLLLoss

    w = MegatronPolicyWorker(make_config(path, megatron=HANDED_MEGATRON if handoff else None), rank, world)
    losses = [w.train(make_batch(), NLLLoss())["loss"]]
    if handoff:
        w.offload_before_refit()
        w.offload_after_refit()
        w.prepare_for_training()
    losses.append(w.train(make_batch(seed=1), NLLLoss())["loss"])
    weights = {n: t.clone() for bucket in w.export_weights(1 << 30, "float32") for n, t in bucket}
    return {"losses": losses, "weights": weights, "main_params": len(main_params(w.opt.optimizer)),
            "cache_empties": dict(w.cache_empties),
            "recompute": (w.tconfig.recompute_granularity, list(w.tconfig.recompute_modules))}


def without_then_with_handoff(rank: int, world: int, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both runs in one launch, each on a fresh worker (a launch costs more than a worker)."""
    return handoff_world(rank, world, path, False), handoff_world(rank, world, path, True)


@pytest.mark.slow
def test_training_after_the_hand_off_is_bit_identical_to_training_without_it() -> None:
    """The hand-off moves gradients, optimizer state and (mixed precision, GPU only: none here)
    the fp32 main parameters off the device and back; nothing it moves may change a bit."""
    ((plain, handed),) = run_world(without_then_with_handoff, 1, str(cached_tiny_model("llama")))
    assert handed["main_params"] == plain["main_params"] == 0  # fp32 on the CPU: no separate main copy
    assert handed["losses"] == plain["losses"]
    assert all(torch.equal(handed["weights"][n], t) for n, t in plain["weights"].items())
    # empty_unused_memory_level 2 reached the worker: two steps, one prepare_for_training (level 0: none)
    assert handed["cache_empties"] == {"after_forward_backward": 2, "after_optimizer_step": 2,
                                       "after_prepare_for_training": 1}
    assert plain["cache_empties"] == {}
    assert handed["recompute"] == ("selective", ["core_attn"]) and plain["recompute"][0] is None


@dataclasses.dataclass
class _Layout:
    tp: int
    pp: int
    sequence_parallel: bool


def test_sequence_parallel_pads_every_micro_batch_to_the_tensor_parallel_size() -> None:
    from nrl_backend_megatron.worker import MegatronPolicyWorker
    from nrl_core.engine import plan_micro_batches

    batch = make_batch(rows=4, width=11)
    worker = MegatronPolicyWorker.__new__(MegatronPolicyWorker)  # lay_out reads only the policy and layout
    for sequence_parallel, width in ((True, 12), (False, 11)):
        worker.policy, worker.layout = {"train_micro_batch_size": 2}, _Layout(tp=4, pp=1,
                                                                               sequence_parallel=sequence_parallel)
        mbs = plan_micro_batches(batch, worker.policy, train=True)
        worker.lay_out(mbs)
        for mb in mbs:
            assert tuple(mb.inputs.input_ids.shape) == (2, width) and tuple(mb.inputs.position_ids.shape) == (2, width)
            assert torch.equal(mb.inputs.input_ids[:, :11], mb.batch.input_ids)
            assert bool((mb.inputs.input_ids[:, 11:] == 0).all())


def test_context_parallel_is_refused_in_one_line() -> None:
    from nrl_backend_megatron.model import ParallelLayout
    from nrl_backend_megatron.parallel import check_layout

    with pytest.raises(ConfigError, match="split per context-parallel rank") as err:
        check_layout(ParallelLayout(cp=2), 2, None)
    assert "\n" not in str(err.value)


def test_megatron_initialises_on_the_cpu_only_without_cuda() -> None:
    from nrl_backend_megatron.model import ParallelLayout, transformer_config
    from nrl_core.config.model_config import read_model_config

    hf = read_model_config(str(cached_tiny_model("llama")))
    config = transformer_config(hf, ParallelLayout(), params_dtype=torch.float32)
    assert config.use_cpu_initialization is not torch.cuda.is_available()
