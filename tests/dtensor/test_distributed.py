"""World size 2 on gloo (spawned ranks) against world size 1 in the pytest process."""

from __future__ import annotations

import pytest
import scenarios
import torch
from common import make_batch, make_config

from nrl_backend_dtensor.worker import DTensorPolicyWorker
from nrl_core.algorithms.loss import NLLLoss
from nrl_core.contracts import CheckpointOptions
from nrl_core.testing.distributed import gather_shards, run_distributed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def single():
    """World-size-1 reference: logprobs before and after two steps, and the losses."""
    batch = make_batch()
    w = DTensorPolicyWorker(make_config(), 0, 1)
    out = {"logprobs": gather_shards(w.get_logprobs(batch), batch), "load": w.load_stats}
    out["losses"] = [w.train(batch, NLLLoss())["loss"] for _ in range(2)]
    out["logprobs_after"] = gather_shards(w.get_logprobs(batch), batch)
    qwen = DTensorPolicyWorker(make_config("qwen3"), 0, 1)
    out["qwen3/logprobs"] = gather_shards(qwen.get_logprobs(batch), batch)
    return out


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    return a.shape == b.shape and float((a - b).abs().max()) <= tol


def test_fsdp_world_2_matches_world_1_and_checkpoints_reshard(single, tmp_path):
    ranks = run_distributed(scenarios.fsdp_and_checkpoints, 2, str(tmp_path))
    whole = single["load"]
    assert whole.path == "sharded" and whole.bytes_read == whole.local_bytes  # one rank: all of it, once
    for r in ranks:  # each rank read exactly the shards it holds, no tensor whole: together the model once
        load = r["load"]
        assert load["path"] == "sharded" and load["bytes_read"] == load["local_bytes"], load
        assert load["largest_read"] < whole.largest_read, load
    assert sum(r["load"]["bytes_read"] for r in ranks) == whole.bytes_read
    for r in ranks:
        assert close(r["logprobs"], single["logprobs"])
        assert all(abs(a - b) < 1e-5 for a, b in zip(r["losses"], single["losses"]))
        assert close(r["logprobs_after"], single["logprobs_after"])
        assert "does not divide over 2 data-parallel ranks" in r["bad_batch_error"]
        assert "\n" not in r["bad_batch_error"]
        loaded = [v for k, v in r.items() if k.startswith("loaded/")]
        assert len(loaded) == 9 and all(torch.equal(v, r["logprobs_after"]) for v in loaded)
        assert r["step/sharded"] == r["step/consolidated"] == r["step/lean"] == r["step/safetensors"] == 2
        assert r["optimizer_state/async"] > 0 and r["optimizer_state/lean"] == 0 and r["optimizer_state/safetensors"] > 0
    # each rank wrote its own safetensors shard of the weights (model_save_format: safetensors)
    assert len(list((tmp_path / "safetensors" / "model").glob("*.safetensors"))) == 2
    # a world-size-2 sharded checkpoint loads at world size 1 (DCP reshards), in either format
    for name in ("sharded", "safetensors"):
        w = DTensorPolicyWorker(make_config(), 0, 1)
        w.load_checkpoint(str(tmp_path / name), CheckpointOptions())
        assert close(gather_shards(w.get_logprobs(make_batch()), make_batch()), ranks[0]["logprobs_after"]), name


def test_tensor_parallel_2_matches_1(single):
    ranks = run_distributed(scenarios.tensor_parallel, 2)
    for r in ranks:
        for sp in (False, True):
            load = r[f"sp={sp}/load"]  # the rank's column or row slices, and the replicated norms
            assert load["path"] == "sharded" and load["bytes_read"] == load["local_bytes"] < single["load"].bytes_read
            assert close(r[f"sp={sp}/logprobs"], single["logprobs"]), sp
            assert abs(r[f"sp={sp}/loss"] - single["losses"][0]) < 1e-5, sp
            assert close(r[f"sp={sp}/logprobs_after"], ranks[0]["sp=False/logprobs_after"])
        assert close(r["qwen3/logprobs"], single["qwen3/logprobs"])


def test_lora_at_data_parallel_2_matches_one_rank_and_its_checkpoints_load(tmp_path):
    """LoRA adapters under FSDP at dp=2 train as at one rank (the adapters' gradients are reduced
    like any parameter's) and their adapter-only checkpoints load at dp=2, sharded or consolidated."""
    batch = make_batch()
    w = DTensorPolicyWorker(scenarios.lora_config(), 0, 1)
    reference = gather_shards(w.get_logprobs(batch), batch)
    losses = [w.train(batch, NLLLoss())["loss"] for _ in range(2)]
    after = gather_shards(w.get_logprobs(batch), batch)
    for r in run_distributed(scenarios.lora_data_parallel, 2, str(tmp_path)):
        assert all(abs(a - b) < 1e-5 for a, b in zip(r["losses"], losses))
        assert close(r["logprobs_after"], after) and close(r["reference"], reference)
        assert not close(after, reference)
        assert close(r["loaded/sharded"], r["logprobs_after"]) and close(r["loaded/consolidated"], r["logprobs_after"])


def test_a_value_head_at_tensor_and_data_parallel_2_matches_one_rank():
    """Values (a regression head: one per token), a training step and the values after it, at TP=2
    with and without sequence parallelism and at DP=2, equal one rank's."""
    batch = make_batch()
    torch.manual_seed(0)
    w = DTensorPolicyWorker(scenarios.value_config(), 0, 1)
    values = gather_shards(w.get_values(batch), batch)
    loss = w.train(batch, scenarios.SquaredValueLoss())["loss"]
    after = gather_shards(w.get_values(batch), batch)
    for r in run_distributed(scenarios.value_head, 2):
        for name in ("tp", "tp+sp", "dp"):
            assert close(r[f"{name}/values"], values), name
            assert abs(r[f"{name}/loss"] - loss) < 1e-5, name
            assert close(r[f"{name}/values_after"], after), name
