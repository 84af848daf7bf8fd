"""DPO's loss against a hand computation on fixed logprobs, its additivity over micro-batches, and
its refusal of micro-batches that are not (chosen, rejected) pairs."""

from __future__ import annotations

import math

import pytest
import torch

from nrl_core.algorithms.dpo_loss import DPOLoss
from nrl_core.contracts import TokenBatch
from nrl_core.errors import NrlError

# Two pairs, rows chosen0, rejected0, chosen1, rejected1; positions 0-1 are the prompt, the
# response is positions 2-3 (row 3's response is one token long).
LOGPROBS = [[0.0, -1.0, -0.5, -0.25],
            [0.0, -1.0, -2.0, -1.0],
            [0.0, -3.0, -1.5, -0.5],
            [0.0, -3.0, -0.75, 0.0]]
REFERENCE = [[0.0, -1.0, -1.0, -0.5],
             [0.0, -1.0, -1.5, -0.5],
             [0.0, -2.0, -1.0, -1.0],
             [0.0, -2.0, -1.25, 0.0]]
MASK = [[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, 0]]


def pair_batch(sample_mask=(1.0, 1.0, 1.0, 1.0)) -> TokenBatch:
    return TokenBatch(input_ids=torch.zeros(4, 4, dtype=torch.long), input_lengths=torch.tensor([4, 4, 4, 3]),
                      fields={"token_mask": torch.tensor(MASK, dtype=torch.float64),
                              "reference_logprobs": torch.tensor(REFERENCE, dtype=torch.float64),
                              "chosen": torch.tensor([1.0, 0.0, 1.0, 0.0]), "pair": torch.tensor([0, 0, 1, 1]),
                              "sample_mask": torch.tensor(sample_mask, dtype=torch.float64)})


def neg_logsigmoid(x: float) -> float:
    return math.log1p(math.exp(-x))


def run(loss: DPOLoss, batch: TokenBatch, seqs: float = 4.0):
    return loss(torch.tensor(LOGPROBS, dtype=torch.float64), batch, global_valid_tokens=7.0, global_valid_seqs=seqs)


def test_summed_rewards_match_hand_computation():
    # rewards (sum of logprob - reference over the response):
    # c0: (-0.5+1) + (-0.25+0.5) = 0.75   r0: (-2+1.5) + (-1+0.5) = -1.0
    # c1: (-1.5+1) + (-0.5+1)    = 0.0    r1: (-0.75+1.25)        = 0.5
    beta = 0.5
    loss, m = run(DPOLoss(reference_policy_kl_penalty=beta, sft_loss_weight=0.0), pair_batch())
    preference = (neg_logsigmoid(beta * 1.75) + neg_logsigmoid(beta * -0.5)) / 2
    assert float(loss) == pytest.approx(preference, abs=1e-12)
    assert m["preference_loss"] == pytest.approx(preference, abs=1e-12) and m["loss"] == pytest.approx(preference)
    assert m["accuracy"] == 0.5  # pair 0 right, pair 1 wrong
    assert m["rewards_chosen_mean"] == pytest.approx((0.75 + 0.0) / 2, abs=1e-12)
    assert m["rewards_rejected_mean"] == pytest.approx((-1.0 + 0.5) / 2, abs=1e-12)
    assert m["num_valid_samples"] == 2.0
    # SFT term: NLL of the chosen responses, c0 0.75, c1 2.0, averaged over pairs
    assert m["sft_loss"] == pytest.approx((0.75 + 2.0) / 2, abs=1e-12)


def test_averaged_log_probs_and_weights_match_hand_computation():
    beta, wp, ws = 0.1, 0.5, 2.0
    loss, m = run(DPOLoss(reference_policy_kl_penalty=beta, preference_loss_weight=wp, sft_loss_weight=ws,
                          preference_average_log_probs=True, sft_average_log_probs=True), pair_batch())
    # mean rewards: c0 0.375, r0 -0.5, c1 0.0, r1 0.5 (one token); mean NLL: c0 0.375, c1 1.0
    preference = (neg_logsigmoid(beta * 0.875) + neg_logsigmoid(beta * -0.5)) / 2
    sft = (0.375 + 1.0) / 2
    assert float(loss) == pytest.approx(wp * preference + ws * sft, abs=1e-12)
    assert (m["preference_loss"], m["sft_loss"]) == (pytest.approx(preference, abs=1e-12), pytest.approx(sft, abs=1e-12))
    assert m["rewards_rejected_mean"] == pytest.approx((-0.5 + 0.5) / 2, abs=1e-12)


def test_gradient_matches_hand_computation():
    beta = 1.0
    logprobs = torch.tensor(LOGPROBS, dtype=torch.float64, requires_grad=True)
    loss, _ = DPOLoss(reference_policy_kl_penalty=beta)(logprobs, pair_batch(), global_valid_tokens=7.0,
                                                        global_valid_seqs=4.0)
    loss.backward()
    # d/d reward_c of -log sigmoid(beta (c - r)) / 2 = -beta sigmoid(-beta (c - r)) / 2, on every response token
    g0 = -beta / (1 + math.exp(beta * 1.75)) / 2
    g1 = -beta / (1 + math.exp(beta * -0.5)) / 2
    expected = torch.tensor([[0, 0, g0, g0], [0, 0, -g0, -g0], [0, 0, g1, g1], [0, 0, -g1, 0]], dtype=torch.float64)
    assert torch.allclose(logprobs.grad, expected, atol=1e-12, rtol=0)


def test_micro_batches_add_up_to_the_global_loss():
    loss_fn = DPOLoss(reference_policy_kl_penalty=0.3, sft_loss_weight=0.7)
    whole, m = run(loss_fn, pair_batch())
    parts = [loss_fn(torch.tensor(LOGPROBS, dtype=torch.float64)[rows], pair_batch().select(rows),
                     global_valid_tokens=7.0, global_valid_seqs=4.0) for rows in ([0, 1], [2, 3])]
    assert float(sum(p[0] for p in parts)) == pytest.approx(float(whole), abs=1e-12)
    for key in m:
        assert sum(p[1][key] for p in parts) == pytest.approx(m[key], abs=1e-12), key


def test_masked_pair_counts_for_nothing():
    beta = 0.5
    loss, m = run(DPOLoss(reference_policy_kl_penalty=beta), pair_batch((1.0, 1.0, 0.0, 0.0)), seqs=2.0)
    assert float(loss) == pytest.approx(neg_logsigmoid(beta * 1.75), abs=1e-12)
    assert (m["accuracy"], m["num_valid_samples"]) == (1.0, 1.0)


@pytest.mark.parametrize("rows", [[0, 2], [1, 0, 3, 2], [0, 1, 2]])
def test_rows_that_are_not_pairs_are_refused(rows):
    batch = pair_batch().select(rows)
    with pytest.raises(NrlError, match="not \\(chosen, rejected\\) pairs"):
        DPOLoss()(torch.zeros(len(rows), 4, dtype=torch.float64), batch, global_valid_tokens=1.0, global_valid_seqs=2.0)
