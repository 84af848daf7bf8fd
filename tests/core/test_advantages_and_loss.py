"""GRPO advantages and the clipped policy-gradient loss against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from nrl_core.algorithms.advantages import group_advantages, prompt_group_ids
from nrl_core.algorithms.grpo_config import check_grpo, on_policy_ratio
from nrl_core.algorithms.loss import ClippedPGLoss, NLLLoss, kl_estimate
from nrl_core.contracts import TokenBatch
from nrl_core.errors import ConfigError

L = math.log


# ----------------------------------------------------------------------------- advantages


def test_leave_one_out_baseline_normalised_by_the_others_std():
    # Group [1, 0, 0]: others [0, 0] (mean 0, std 0: left unscaled), [1, 0] and [1, 0] (mean .5, std sqrt(.5)).
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0]), 3, leave_one_out=True, normalize=True)
    s = math.sqrt(0.5)
    assert adv.tolist() == pytest.approx([1.0, -0.5 / (s + 1e-6), -0.5 / (s + 1e-6)], rel=1e-6)


def test_leave_one_out_baseline_normalised_by_the_group_std():
    # std_of="group": the whole group's unbiased std sqrt(1/3), as TRL and verl divide.
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0]), 3, leave_one_out=True, normalize=True, std_of="group")
    s = math.sqrt(1 / 3) + 1e-6
    assert adv.tolist() == pytest.approx([1 / s, -0.5 / s, -0.5 / s], rel=1e-6)


def test_leave_one_out_leaves_groups_of_two_unnormalised():
    # One other reward has no spread: NeMo RL divides by nothing.
    adv = group_advantages(torch.tensor([3.0, 1.0]), 2, leave_one_out=True, normalize=True)
    assert adv.tolist() == [2.0, -2.0]


def test_a_tiny_spread_is_still_normalised():
    # NeMo RL normalises whenever the std is above zero (nrl used to zero advantages below 1e-6).
    adv = group_advantages(torch.tensor([0.0, 1e-7, 0.0, 1e-7], dtype=torch.float64), 4, leave_one_out=False)
    std = torch.tensor([0.0, 1e-7, 0.0, 1e-7], dtype=torch.float64).std().item()
    assert adv.tolist() == pytest.approx([-0.5e-7 / (std + 1e-6), 0.5e-7 / (std + 1e-6)] * 2, rel=1e-9)


def test_identical_prompts_form_one_group_wherever_they_stand():
    ids = prompt_group_ids([[5, 6], [7], [5, 6], [7]])
    assert ids.tolist() == [0, 1, 0, 1]
    adv = group_advantages(torch.tensor([1.0, 4.0, 0.0, 2.0]), group_ids=ids, leave_one_out=False, normalize=False)
    assert adv.tolist() == [0.5, 1.0, -0.5, -1.0]


def test_mean_baseline_unnormalised():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0]), 3, leave_one_out=False, normalize=False)
    assert adv.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3])


def test_mean_baseline_normalised():
    adv = group_advantages(torch.tensor([3.0, 1.0]), 2, leave_one_out=False, normalize=True)
    assert adv.tolist() == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], rel=1e-5)


@pytest.mark.parametrize("leave_one_out", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
def test_all_equal_rewards_give_exactly_zero(leave_one_out, normalize):
    adv = group_advantages(torch.tensor([0.5, 0.5, 0.5, 1.0, 1.0, 1.0]), 3, leave_one_out=leave_one_out, normalize=normalize)
    assert adv.tolist() == [0.0] * 6


def test_groups_are_independent():
    adv = group_advantages(torch.tensor([1.0, 0.0, 5.0, 5.0]), 2, leave_one_out=True, normalize=False)
    assert adv.tolist() == [1.0, -1.0, 0.0, 0.0]


def test_bad_shapes_are_errors():
    with pytest.raises(ValueError, match="num_prompts x 3"):
        group_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.zeros(4), 1, leave_one_out=True)


# ----------------------------------------------------------------------------- loss


def _batch(logprob_rows, prev_rows, adv, gen_rows=None, ref_rows=None, mask_rows=None) -> TokenBatch:
    prev = torch.tensor(prev_rows, dtype=torch.float64)
    fields = {
        "prev_logprobs": prev,
        "generation_logprobs": torch.tensor(gen_rows, dtype=torch.float64) if gen_rows else prev.clone(),
        "reference_logprobs": torch.tensor(ref_rows, dtype=torch.float64) if ref_rows else prev.clone(),
        "advantages": torch.tensor(adv, dtype=torch.float64).unsqueeze(1).expand_as(prev).clone(),
        "token_mask": torch.tensor(mask_rows or [[0, 1, 1]] * len(prev_rows), dtype=torch.float64),
    }
    ids = torch.zeros(prev.shape, dtype=torch.long)
    return TokenBatch(input_ids=ids, input_lengths=torch.full((prev.shape[0],), prev.shape[1]), fields=fields)


def _run(loss_fn, logprobs, batch):
    lp = torch.tensor(logprobs, dtype=torch.float64)
    mask = batch.fields["token_mask"]
    return loss_fn(lp, batch, global_valid_tokens=float(mask.sum()), global_valid_seqs=float(mask.shape[0]))


CURR = [[0.0, L(0.5), L(0.2)]]
PREV = [[0.0, L(0.4), L(0.25)]]  # ratios 1.25 (clipped to 1.2) and 0.8 (at the lower edge)


def test_positive_advantage_takes_the_clipped_ratio():
    loss, m = _run(ClippedPGLoss(), CURR, _batch(CURR, PREV, [1.0]))
    assert float(loss) == pytest.approx((-1.2 - 0.8) / 2)
    assert m["probs_ratio"] == pytest.approx((1.25 + 0.8) / 2)
    assert m["probs_ratio_clamped"] == pytest.approx((1.2 + 0.8) / 2)
    assert m["clip_fraction"] == pytest.approx(0.5)


def test_negative_advantage_and_dual_clip():
    loss, _ = _run(ClippedPGLoss(), CURR, _batch(CURR, PREV, [-1.0]))
    assert float(loss) == pytest.approx((1.25 + 0.8) / 2)
    loss, _ = _run(ClippedPGLoss(ratio_clip_c=1.1), CURR, _batch(CURR, PREV, [-1.0]))
    assert float(loss) == pytest.approx((1.1 + 0.8) / 2)


def test_kl_estimators_by_hand():
    curr, ref = torch.tensor([L(0.5)]), torch.tensor([L(0.25)])
    d = L(0.5)  # log(ref / curr) = log 0.5
    assert float(kl_estimate(curr, ref, "k1")) == pytest.approx(-d)
    assert float(kl_estimate(curr, ref, "k2")) == pytest.approx(0.5 * d * d)
    assert float(kl_estimate(curr, ref, "k3")) == pytest.approx(math.exp(d) - d - 1)
    assert float(kl_estimate(curr, ref, "k1", input_clamp=0.5)) == pytest.approx(0.5)
    assert float(kl_estimate(curr, ref, "k1", output_clamp=0.25)) == pytest.approx(0.25)


def test_kl_penalty_is_added_per_token():
    ref = [[0.0, L(0.25), L(0.2)]]  # token 1: k1 = log 2; token 2: 0
    loss_fn = ClippedPGLoss(reference_policy_kl_penalty=0.1, reference_policy_kl_type="k1")
    loss, m = _run(loss_fn, CURR, _batch(CURR, PREV, [1.0], ref_rows=ref))
    assert m["kl_penalty"] == pytest.approx(L(2) / 2)  # the raw KL, as NeMo RL logs it
    assert float(loss) == pytest.approx((-1.2 - 0.8) / 2 + 0.1 * L(2) / 2)


def test_on_policy_kl_approximation_weights_by_generation_ratio():
    ref = [[0.0, L(0.25), L(0.2)]]
    gen = [[0.0, L(0.25), L(0.25)]]  # weights exp(curr - gen): 2.0 and 0.8
    loss_fn = ClippedPGLoss(reference_policy_kl_penalty=1.0, reference_policy_kl_type="k1",
                            use_on_policy_kl_approximation=True)
    _, m = _run(loss_fn, CURR, _batch(CURR, PREV, [1.0], gen_rows=gen, ref_rows=ref))
    assert m["kl_penalty"] == pytest.approx(2.0 * L(2) / 2)


def test_importance_sampling_correction_and_truncation():
    gen = [[0.0, L(0.2), L(0.5)]]  # weights exp(prev - gen): 2.0 and 0.5
    loss, m = _run(ClippedPGLoss(use_importance_sampling_correction=True), CURR, _batch(CURR, PREV, [1.0], gen_rows=gen))
    assert float(loss) == pytest.approx((-1.2 * 2.0 - 0.8 * 0.5) / 2)
    assert m["token_mult_prob_error"] == pytest.approx((2.0 + 2.0) / 2)  # exp|log 2| on both tokens
    loss, _ = _run(ClippedPGLoss(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=1.5),
                   CURR, _batch(CURR, PREV, [1.0], gen_rows=gen))
    assert float(loss) == pytest.approx((-1.2 * 1.5 - 0.8 * 0.5) / 2)


def test_sequence_level_ratios_gspo():
    # Mean log-ratio of the sequence: (log 1.25 + log 0.8) / 2 = 0 -> ratio 1 on both tokens.
    loss, m = _run(ClippedPGLoss(sequence_level_importance_ratios=True, token_level_loss=False), CURR,
                   _batch(CURR, PREV, [1.0]))
    assert float(loss) == pytest.approx(-1.0)
    assert m["probs_ratio"] == pytest.approx(1.0)


def test_token_level_versus_sequence_level_averaging():
    curr = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    batch = _batch(curr, curr, [1.0, 3.0], mask_rows=[[0, 1, 0], [0, 1, 1]])
    token, _ = _run(ClippedPGLoss(), curr, batch)
    seq, _ = _run(ClippedPGLoss(token_level_loss=False), curr, batch)
    assert float(token) == pytest.approx(-(1 + 3 + 3) / 3)
    assert float(seq) == pytest.approx(-(1 + 3) / 2)


def test_sample_mask_drops_a_sequence():
    curr = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    batch = _batch(curr, curr, [1.0, 3.0])
    batch.fields["sample_mask"] = torch.tensor([1.0, 0.0], dtype=torch.float64)
    loss, m = ClippedPGLoss()(torch.zeros(2, 3, dtype=torch.float64), batch, global_valid_tokens=2.0, global_valid_seqs=1.0)
    assert float(loss) == pytest.approx(-1.0) and m["num_valid_tokens"] == 2.0


def test_micro_batches_sum_to_the_global_loss():
    torch.manual_seed(0)
    curr = (torch.rand(4, 5, dtype=torch.float64) - 1).tolist()
    prev = (torch.rand(4, 5, dtype=torch.float64) - 1).tolist()
    mask = [[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 0, 0, 0], [0, 1, 1, 1, 1]]
    batch = _batch(curr, prev, [0.5, -1.0, 2.0, -0.3], mask_rows=mask)
    loss_fn = ClippedPGLoss(reference_policy_kl_penalty=0.05, token_level_loss=False)
    tokens, seqs = float(batch.fields["token_mask"].sum()), 4.0
    whole, _ = loss_fn(torch.tensor(curr, dtype=torch.float64), batch, global_valid_tokens=tokens, global_valid_seqs=seqs)
    parts = sum(loss_fn(torch.tensor(curr, dtype=torch.float64)[i:i + 2], batch.select([i, i + 1]),
                        global_valid_tokens=tokens, global_valid_seqs=seqs)[0] for i in (0, 2))
    assert float(parts) == pytest.approx(float(whole), abs=1e-12)


def test_nll_loss():
    lp = torch.tensor([[0.0, L(0.5), L(0.25)]])
    batch = TokenBatch(input_ids=torch.zeros(1, 3, dtype=torch.long), input_lengths=torch.tensor([3]),
                       fields={"token_mask": torch.tensor([[0.0, 1.0, 1.0]])})
    loss, m = NLLLoss()(lp, batch, global_valid_tokens=2.0, global_valid_seqs=1.0)
    assert float(loss) == pytest.approx((L(2) + L(4)) / 2)
    assert m["num_valid_tokens"] == 2.0


def test_from_config_reads_the_loss_fn_section():
    loss_fn = ClippedPGLoss.from_config({"ratio_clip_min": 0.1, "ratio_clip_max": 0.3, "ratio_clip_c": 3.0,
                                         "reference_policy_kl_penalty": 0.02, "reference_policy_kl_type": "k2"})
    assert (loss_fn.ratio_clip_min, loss_fn.ratio_clip_max, loss_fn.ratio_clip_c) == (0.1, 0.3, 3.0)
    assert loss_fn.reference_policy_kl_type == "k2"


# ----------------------------------------------------------------------------- on-policy ratio


def test_forced_on_policy_ratio_is_one_with_the_gradient_of_the_logprobs():
    """``force_on_policy_ratio``: the batch carries no previous logprobs; the ratio is exactly 1
    and the gradient is the one a separately computed, equal ``prev_logprobs`` gives."""
    batch = _batch(CURR, CURR, [1.0], gen_rows=PREV)
    del batch.fields["prev_logprobs"]
    forced = torch.tensor(CURR, dtype=torch.float64, requires_grad=True)
    mask = batch.fields["token_mask"]
    loss, m = ClippedPGLoss(force_on_policy_ratio=True)(forced, batch, global_valid_tokens=float(mask.sum()),
                                                        global_valid_seqs=1.0)
    loss.backward()
    assert m["probs_ratio"] == 1.0 and m["clip_fraction"] == 0.0
    separate = torch.tensor(CURR, dtype=torch.float64, requires_grad=True)
    ref_loss, ref_m = ClippedPGLoss()(separate, _batch(CURR, CURR, [1.0], gen_rows=PREV),
                                      global_valid_tokens=float(mask.sum()), global_valid_seqs=1.0)
    ref_loss.backward()
    assert float(loss.detach()) == float(ref_loss.detach()) and torch.equal(forced.grad, separate.grad)
    assert m["token_mult_prob_error"] == ref_m["token_mult_prob_error"]  # against the engine's logprobs


def _grpo_config(prompts: int, generations: int, global_batch: int, forced: bool | None) -> dict:
    return {"grpo": {"num_prompts_per_step": prompts, "num_generations_per_prompt": generations},
            "policy": {"train_global_batch_size": global_batch}, "loss_fn": {"force_on_policy_ratio": forced}}


@pytest.mark.parametrize("global_batch, forced, expected", [
    (16, None, True),    # one optimizer step per GRPO step: the training forward's logprobs
    (8, None, False),    # two: the second needs the logprobs of the weights before the first
    (16, False, False),  # NeMo RL's default: always the separate pass
    (16, True, True),
])
def test_on_policy_ratio_follows_the_optimizer_steps_per_grpo_step(global_batch, forced, expected):
    assert on_policy_ratio(_grpo_config(4, 4, global_batch, forced)) is expected


def test_forcing_the_on_policy_ratio_with_several_optimizer_steps_is_one_line():
    raw = _grpo_config(4, 4, 8, True)
    raw["policy"]["generation"] = {"colocated": {"enabled": True}}
    raw["grpo"].update(use_leave_one_out_baseline=True, async_grpo={"enabled": False})
    with pytest.raises(ConfigError, match=r"loss_fn.force_on_policy_ratio: needs one optimizer step per GRPO step, "
                                          r"but 16 rollouts make 2 of policy.train_global_batch_size 8"):
        check_grpo(raw)
    raw["policy"]["train_global_batch_size"] = 16
    check_grpo(raw)
