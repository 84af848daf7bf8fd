"""Rollout batches: prompt + response rows, response-only masks, aligned engine logprobs; the
temperature both sides' logprobs are taken at."""

from __future__ import annotations

import logging

import pytest
import torch

from nrl_core.algorithms.rollouts import repeat_prompts, rollout_batch
from nrl_core.contracts import GenerationOutput, logprob_temperature


def test_repeat_keeps_groups_together():
    assert repeat_prompts([[1], [2, 3]], 2) == [[1], [1], [2, 3], [2, 3]]


def test_rollout_batch_layout():
    out = GenerationOutput(token_ids=[[7, 8], [9]], logprobs=[[-0.5, -0.25], [-1.0]],
                           finish_reasons=["stop", "length"], weight_version=3)
    batch = rollout_batch([[1, 2], [3, 4, 5]], out, pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 7, 8], [3, 4, 5, 9]]
    assert batch.input_lengths.tolist() == [4, 4]
    assert batch.fields["token_mask"].tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]
    assert batch.fields["generation_logprobs"].tolist() == [[0, 0, -0.5, -0.25], [0, 0, 0, -1.0]]
    assert batch.fields["truncated"].tolist() == [0.0, 1.0]
    assert batch.fields["response_lengths"].tolist() == [2.0, 1.0]


def test_a_multi_turn_loss_mask_keeps_environment_tokens_out_of_the_loss():
    """Response tokens 8 and 9 came from the environment: in the context, never in the loss."""
    out = GenerationOutput(token_ids=[[7, 8, 9, 6], [5]], logprobs=[[-0.5, 0.0, 0.0, -0.25], [-1.0]],
                           finish_reasons=["stop", "stop"], weight_version=1)
    batch = rollout_batch([[1, 2], [3]], out, pad_token_id=0, loss_masks=[[1, 0, 0, 1], [1]])
    assert batch.input_ids.tolist() == [[1, 2, 7, 8, 9, 6], [3, 5, 0, 0, 0, 0]]
    assert batch.fields["token_mask"].tolist() == [[0, 0, 1, 0, 0, 1], [0, 1, 0, 0, 0, 0]]
    assert batch.fields["response_lengths"].tolist() == [2.0, 1.0]
    assert batch.loss_counts() == (3.0, 2.0)
    with pytest.raises(ValueError, match="a rollout has 4 tokens, 4 logprobs and a loss mask of 3"):
        rollout_batch([[1, 2], [3]], out, pad_token_id=0, loss_masks=[[1, 0, 0], [1]])


def test_the_colocated_hand_off_moves_each_thing_once_in_order():
    from nrl_core.algorithms.handoff import DeviceHandOff, Holder

    class Calls(list):
        def __getattr__(self, name):
            return lambda: self.append(name)

    for offload_weights, expected in [(True, ["offload_before_refit", "offload_after_refit", "prepare_for_training"]),
                                      (False, ["offload_before_refit", "prepare_for_training"])]:
        calls = Calls()
        hand_off = DeviceHandOff(calls, offload_weights=offload_weights)
        hand_off.before_refit()
        hand_off.before_refit()  # asked twice (a refit, then validation's prepare): moved once
        hand_off.before_generation()
        hand_off.before_generation()
        assert hand_off.holder is (Holder.GENERATION if offload_weights else Holder.REFIT)
        hand_off.before_training()
        assert calls == expected and hand_off.holder is Holder.TRAINING


def test_rollout_batch_pads_and_truncates():
    out = GenerationOutput(token_ids=[[7, 8, 9], [6]], logprobs=[[-1.0] * 3, [-2.0]],
                           finish_reasons=["length", "stop"], weight_version=0)
    batch = rollout_batch([[1], [2]], out, pad_token_id=0, max_total_length=3)
    assert batch.input_ids.tolist() == [[1, 7, 8], [2, 6, 0]]
    assert batch.input_lengths.tolist() == [3, 2]
    assert batch.fields["token_mask"].tolist() == [[0, 1, 1], [0, 1, 0]]


def test_select_and_shard_keep_fields_aligned():
    out = GenerationOutput(token_ids=[[7], [8, 9], [5], [4, 3, 2]], logprobs=[[-1.0], [-1.0] * 2, [-1.0], [-1.0] * 3],
                           finish_reasons=["stop"] * 4, weight_version=0)
    batch = rollout_batch([[1]] * 4, out, pad_token_id=0)
    shard = batch.shard(1, 2)  # rows 1 and 3
    assert shard.input_ids.tolist() == [[1, 8, 9, 0], [1, 4, 3, 2]]
    assert shard.fields["token_mask"].shape == shard.input_ids.shape
    assert torch.equal(shard.fields["truncated"], torch.zeros(2))
    narrow = batch.select([0, 2])
    assert narrow.input_ids.tolist() == [[1, 7], [1, 5]]  # trimmed to the longest selected row


def test_loss_counts_honour_the_sample_mask():
    out = GenerationOutput(token_ids=[[7, 8], [9], [5, 6, 4]], logprobs=[[-1.0] * 2, [-1.0], [-1.0] * 3],
                           finish_reasons=["stop", "length", "stop"], weight_version=0)
    batch = rollout_batch([[1], [2], [3]], out, pad_token_id=0)
    assert batch.loss_counts() == (6.0, 3.0)
    batch.fields["sample_mask"] = torch.tensor([1.0, 0.0, 1.0])  # the truncated one filtered out
    assert batch.loss_counts() == (5.0, 2.0)


@pytest.mark.parametrize("generation, expected", [
    ({"temperature": 0.7}, 0.7),
    ({"temperature": 1.0}, 1.0),
    ({"temperature": 0.0}, 1.0),  # greedy: the logits are left alone
    (None, 1.0),                  # no generation (SFT)
])
def test_policy_logprobs_follow_the_sampling_temperature(generation, expected) -> None:
    assert logprob_temperature({"policy": {"generation": generation}}) == expected


def test_grpo_warns_that_truncated_sampling_breaks_exact_ratios(caplog) -> None:
    from nrl_core.algorithms.grpo import _warn_truncated_sampling

    with caplog.at_level(logging.WARNING):
        _warn_truncated_sampling({"top_p": 1.0, "top_k": None})
        assert not caplog.records
        _warn_truncated_sampling({"top_p": 0.9, "top_k": None})
        _warn_truncated_sampling({"top_p": 1.0, "top_k": 20})
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["policy.generation.top_p/top_k truncate sampling"] * 2


def test_env_results_of_parts_combine_into_the_whole_batch():
    from nrl_core.contracts import EnvResult

    parts = [EnvResult(rewards=[1.0, 0.0], metrics={"accuracy": 0.5, "num_samples": 2.0}, counts=("num_samples",)),
             EnvResult(rewards=[1.0, 1.0, 1.0, 0.0], metrics={"accuracy": 0.75, "num_samples": 4.0},
                       counts=("num_samples",))]
    whole = EnvResult.combine(parts)
    assert whole.rewards == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert whole.metrics == {"accuracy": (0.5 * 2 + 0.75 * 4) / 6, "num_samples": 6.0}
