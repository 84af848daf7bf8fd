"""TE's FusedAdam, named by NeMo RL's Automodel recipes, on a machine without Transformer Engine."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from common import make_batch
from test_worker import fsdp_worker, params

from nrl_backend_dtensor.fused_adam import TE_FUSED_ADAM, FusedAdam
from nrl_backend_dtensor.optim import build_optimizer
from nrl_core.algorithms.loss import NLLLoss
from nrl_core.contracts import CheckpointOptions
from nrl_core.errors import ConfigError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None
                                and torch.cuda.is_available(),
                                reason="where Transformer Engine runs, its own FusedAdam is used")

# The optimizer kwargs of NeMo RL's Automodel recipes (Qwen3.5, Gemma 4), with the learning rate
# raised so that one step visibly lowers the loss.
RECIPE_KWARGS = {"lr": 1e-3, "weight_decay": 0.1, "master_weights": True, "store_param_remainders": True,
                 "exp_avg_dtype": "torch.bfloat16", "exp_avg_sq_dtype": "torch.bfloat16"}


def _run(optimizer_of, steps: int = 5, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Linear, object]:
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8).to(dtype)
    optimizer = optimizer_of(layer.parameters())
    data = torch.randn(steps, 4, 16)
    for x in data:
        optimizer.zero_grad()
        layer(x.to(dtype)).float().pow(2).mean().backward()
        optimizer.step()
    return layer, optimizer


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fp32_moments_step_as_torch_adamw_and_adam(adam_w_mode):
    """With float32 moments and no master copy, the update is torch's AdamW (decoupled decay) or
    Adam (L2 decay), up to the order of float32 operations."""
    reference = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ours, _ = _run(lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode))
    theirs, _ = _run(lambda p: reference(p, lr=1e-2, weight_decay=0.1, foreach=False))
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bfloat16_moments_are_stored_as_bfloat16_and_stay_close():
    fp32, _ = _run(lambda p: FusedAdam(p, lr=1e-2))
    bf16, optimizer = _run(lambda p: FusedAdam(p, lr=1e-2, exp_avg_dtype=torch.bfloat16,
                                               exp_avg_sq_dtype=torch.bfloat16))
    state = next(iter(optimizer.state.values()))
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    diffs = [(a - b).abs().max().item() for a, b in zip(fp32.parameters(), bf16.parameters())]
    assert 0 < max(diffs) < 1e-3  # moments rounded to bfloat16 change the update, within its precision


def test_master_weights_keep_updates_that_bfloat16_weights_would_round_away():
    """An update below bfloat16's spacing: bfloat16 weights alone never move, while the fp32 master
    copy accumulates it and the weights follow it once it crosses a spacing."""
    lr = 2e-4
    plain, _ = _run(lambda p: FusedAdam(p, lr=lr), steps=12, dtype=torch.bfloat16)
    mastered, optimizer = _run(lambda p: FusedAdam(p, lr=lr, master_weights=True, store_param_remainders=True),
                               steps=12, dtype=torch.bfloat16)
    torch.manual_seed(0)
    initial = torch.nn.Linear(16, 8).to(torch.bfloat16)
    moved = lambda layer: sum(int((a != b).sum()) for a, b in zip(layer.parameters(), initial.parameters()))  # noqa: E731
    assert moved(mastered) > 2 * moved(plain)
    for param in mastered.parameters():
        master = optimizer.state[param]["master_param"]
        assert master.dtype == torch.float32 and torch.equal(param, master.to(torch.bfloat16))
    import copy

    restored = FusedAdam(mastered.parameters(), lr=lr, master_weights=True)
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # torch's loader alone would round the master copy
    for param in mastered.parameters():
        assert all(torch.equal(restored.state[param][key], optimizer.state[param][key])
                   and restored.state[param][key].dtype == optimizer.state[param][key].dtype
                   for key in ("exp_avg", "exp_avg_sq", "master_param"))


@pytest.mark.parametrize(("kwargs", "names"), [
    ({"amsgrad": True}, "amsgrad"),
    ({"exp_avg_dtype": "torch.uint8"}, "exp_avg_dtype"),
    ({"exp_avg_sq_dtype": "torch.float16"}, "per-tensor scaling"),
    ({"master_weights": True, "master_weight_dtype": "torch.bfloat16"}, "master_weight_dtype"),
    ({"use_decoupled_grad": True}, "use_decoupled_grad"),
    ({"exp_avg_dtype": "torch.bfloat17"}, "torch has no 'torch.bfloat17'"),
    ({"betas": [0.9]}, "betas: give two coefficients"),
])
def test_what_it_cannot_do_is_one_line(kwargs, names):
    with pytest.raises(ConfigError) as info:
        build_optimizer([torch.nn.Parameter(torch.zeros(2))], {"name": TE_FUSED_ADAM, "kwargs": kwargs})
    assert names in str(info.value) and "\n" not in str(info.value)


def test_the_recipe_kwargs_train_an_fsdp_worker_and_resume_exactly(tmp_path, caplog):
    """The Automodel recipes' optimizer section on an FSDP2 worker: the name resolves here (with a
    warning), the loss falls, and a checkpoint brings the bfloat16 moments and the master copy
    back exactly."""
    optimizer = {"name": TE_FUSED_ADAM, "kwargs": RECIPE_KWARGS}
    batch = make_batch()
    a = fsdp_worker(optimizer=optimizer)
    assert isinstance(a.optimizer, FusedAdam) and "Transformer Engine cannot run here" in caplog.text
    first = a.train(batch, NLLLoss())["loss"]
    a.save_checkpoint(str(tmp_path / "ck"), CheckpointOptions())
    saved = params(a)
    expected = a.train(batch, NLLLoss())["loss"]
    assert expected < first
    b = fsdp_worker(optimizer=optimizer)
    b.load_checkpoint(str(tmp_path / "ck"), CheckpointOptions())
    assert all(torch.equal(x, y) for x, y in zip(params(b), saved))
    state = next(iter(b.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.bfloat16 and "master_param" in state
    assert b.train(batch, NLLLoss())["loss"] == expected
