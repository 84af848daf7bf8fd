"""Dynamic batching on the Megatron backend (micro-batches sized by a token budget, pipeline size
1): at two data-parallel ranks whose shards split into different numbers of micro-batches (the
shorter one runs an empty one), logprobs, a training step and the logprobs after it equal padded
micro-batches'. One rank against padded micro-batches is the conformance kit's."""

from __future__ import annotations

import pytest
import torch
from _helpers import make_batch, make_config, run_world  # noqa: E402

from nrl_core.algorithms.installed import load_and_validate
from nrl_core.errors import ConfigError
from nrl_core.testing.tiny_models import cached_tiny_model

pytestmark = pytest.mark.slow

DYNAMIC = {"enabled": True, "train_mb_tokens": 24, "logprob_mb_tokens": 24, "sequence_length_round": 1}


def uneven_batch():
    """Rows alternate 12 and 2 tokens: rank 0's shard (rows 0, 2, 4) needs two micro-batches of 24
    tokens, rank 1's one."""
    batch = make_batch(rows=6, width=12)
    batch.input_lengths = torch.tensor([12, 2, 12, 2, 12, 2])
    for row, length in enumerate(batch.input_lengths.tolist()):
        batch.input_ids[row, length:] = 3
        batch.fields["token_mask"][row] = (torch.arange(12) >= 1) & (torch.arange(12) < length)
    batch.fields["token_mask"] = batch.fields["token_mask"].float()
    return batch


def world(rank: int, world_size: int, model: str, dynamic: bool) -> dict:
    from nrl_backend_megatron.worker import MegatronPolicyWorker
    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.testing.distributed import gather_shards

    policy = {"train_global_batch_size": 6, "train_micro_batch_size": 3, "logprob_batch_size": 3,
              "dynamic_batching": DYNAMIC if dynamic else {"enabled": False}}
    worker = MegatronPolicyWorker(make_config(model, **policy), rank, world_size)
    batch = uneven_batch()
    planned = worker.plan(worker.local_batch(batch), train=True)
    before = gather_shards(worker.get_logprobs(batch), batch)
    loss = worker.train(batch, NLLLoss())["loss"]
    return {"before": before, "loss": loss, "after": gather_shards(worker.get_logprobs(batch), batch),
            "micro_batches": [len(mb.rows) for mb in planned]}


def padded_then_dynamic(rank: int, world_size: int, model: str) -> dict:
    """Both workers in one launch of the two ranks (a launch costs more than a worker)."""
    return {"padded": world(rank, world_size, model, False), "dynamic": world(rank, world_size, model, True)}


def test_dynamic_batching_at_two_data_parallel_ranks_equals_padded_micro_batches():
    ranks = run_world(padded_then_dynamic, 2, str(cached_tiny_model("llama")))
    padded, dynamic = [r["padded"] for r in ranks], [r["dynamic"] for r in ranks]
    # rank 0's three long rows take two micro-batches, rank 1's three short ones one, and a padding one
    assert [r["micro_batches"] for r in dynamic] == [[2, 1], [3, 0]]
    for a, b in zip(dynamic, padded):
        assert torch.allclose(a["before"], b["before"], atol=1e-5)
        assert abs(a["loss"] - b["loss"]) < 1e-5
        assert torch.allclose(a["after"], b["after"], atol=1e-5)


def test_dynamic_batching_with_pipeline_stages_is_refused():
    with pytest.raises(ConfigError) as caught:
        load_and_validate("examples/configs/recipes/llm/grpo-llama3.2-1b-1n8g-megatron.yaml",
                          [f"policy.model_name={cached_tiny_model('llama')}", "cluster.gpus_per_node=2",
                           "policy.megatron_cfg.tensor_model_parallel_size=1", "policy.megatron_cfg.pipeline_model_parallel_size=2",
                           "policy.dynamic_batching.enabled=true", "policy.sequence_packing.enabled=false",
                           "policy.dynamic_batching.train_mb_tokens=4096"], algorithm="grpo")
    assert str(caught.value).startswith("policy.dynamic_batching.enabled: micro-batches of different shapes")
