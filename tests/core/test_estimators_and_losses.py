"""Advantage estimators and policy losses plug in through ``nrl_advantage_estimators`` and
``nrl_loss_functions`` like any plugin; the core's own register through the same hooks; each
estimator's formula against a direct computation on hand-written numbers; the config rules that
keep a loss and an estimator consistent are one line each."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from nrl_core import hookimpl
from nrl_core.algorithms.estimators import (
    GeneralizedAdvantageEstimator,
    GroupRelativeEstimator,
    ReinforcePlusPlusEstimator,
    generalized_advantages,
)
from nrl_core.algorithms.grpo import warn_if_other_semantics
from nrl_core.algorithms.installed import load_and_validate
from nrl_core.algorithms.loss import GRPO_SEMANTICS_VERSION, ClippedPGLoss, ConfiguredLoss
from nrl_core.contracts import AdvantageEstimatorSpec, AdvantageInputs, LossFunctionSpec, TokenBatch
from nrl_core.errors import ConfigError
from nrl_core.plugins import get_plugin_manager
from nrl_core.schema import Field, Section

CONFIG = str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_tiny_cpu.yaml")


def grpo_config(*overrides: str) -> dict:
    return load_and_validate(CONFIG, ["policy.model_name=/nonexistent/model", *overrides], algorithm="grpo",
                             backend_checks=False)


def inputs(rewards, group_ids, token_mask, **fields) -> AdvantageInputs:
    mask = torch.tensor(token_mask, dtype=torch.float64)
    batch = TokenBatch(input_ids=torch.zeros(mask.shape, dtype=torch.long),
                       input_lengths=torch.full((mask.shape[0],), mask.shape[1]),
                       fields={"token_mask": mask, **{k: torch.tensor(v, dtype=torch.float64) for k, v in fields.items()}})
    return AdvantageInputs(rewards=torch.tensor(rewards, dtype=torch.float64), group_ids=torch.tensor(group_ids),
                           batch=batch)


# ----------------------------------------------------------------------------- the core's estimators


def test_the_core_registers_its_estimators_and_loss_through_the_hooks():
    pm = get_plugin_manager()
    assert {"grpo", "reinforce_plus_plus", "gae"} <= set(pm.advantage_estimators().names())
    assert pm.advantage_estimators().owner("grpo") == "nrl_core.builtin"
    assert pm.loss_functions().owner("clipped_pg") == "nrl_core.builtin"


def test_grpo_estimator_reads_the_shared_keys_or_falls_back_to_grpo_s():
    config = grpo_config("grpo.use_leave_one_out_baseline=false", "grpo.adv_estimator.normalize_rewards=false")
    estimator = GroupRelativeEstimator(config["grpo"]["adv_estimator"], config)
    assert (estimator.leave_one_out, estimator.normalize) == (False, False)
    adv = estimator(inputs([1.0, 0.0, 2.0, 2.0], [0, 0, 1, 1], [[1.0]] * 4))
    assert adv.tolist() == [0.5, -0.5, 0.0, 0.0]


def test_reinforce_plus_plus_subtracts_the_prompt_mean_and_whitens_over_tokens():
    config = grpo_config("grpo.adv_estimator.name=reinforce_plus_plus")
    mask = [[0, 1, 1], [0, 1, 0]]
    adv = ReinforcePlusPlusEstimator(config["grpo"]["adv_estimator"], config)(inputs([3.0, 1.0], [0, 0], mask))
    # rewards minus the mean 2: [1, -1]; per token [1, 1] and [-1]: mean 1/3, variance 8/9
    expected = [(v - 1 / 3) / math.sqrt(8 / 9) for v in (1.0, 1.0, -1.0)]
    assert adv[torch.tensor(mask, dtype=torch.bool)].tolist() == pytest.approx(expected, rel=1e-12)


def test_reinforce_plus_plus_takes_the_kl_into_the_reward():
    config = grpo_config("grpo.adv_estimator.name=reinforce_plus_plus", "grpo.adv_estimator.minus_baseline=false",
                         "loss_fn.use_kl_in_reward=true", "loss_fn.reference_policy_kl_penalty=0.5",
                         "loss_fn.reference_policy_kl_type=k1")
    mask = [[1.0, 1.0]]
    got = ReinforcePlusPlusEstimator(config["grpo"]["adv_estimator"], config)(
        inputs([1.0], [0], mask, prev_logprobs=[[-1.0, -2.0]], reference_logprobs=[[-1.5, -2.0]]))
    raw = torch.tensor([1.0 - 0.5 * 0.5, 1.0 - 0.0])  # k1 = logp - logp_ref: 0.5 and 0
    assert got[0].tolist() == pytest.approx(((raw - raw.mean()) / raw.std(unbiased=False)).tolist(), rel=1e-9)


def test_gae_by_hand():
    # gamma 0.5, lambda 0.5, one response of three tokens, the middle one masked (an observation)
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 9.0, 0.4]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, returns = generalized_advantages(rewards, values, mask, gamma=0.5, lam=0.5)
    last = 1.0 - 0.4  # delta at t=2 (no next value)
    first = (0.0 + 0.5 * 0.4 - 0.2) + 0.25 * last  # t=0 bootstraps from t=2, skipping the masked token
    assert adv.tolist() == [pytest.approx([first, 0.0, last])]
    assert returns.tolist() == [pytest.approx([first + 0.2, 0.0, last + 0.4])]


def test_gae_estimator_places_the_reward_on_the_last_response_token():
    config = grpo_config("grpo.adv_estimator.name=grpo")
    section = {"gae_gamma": 1.0, "gae_lambda": 1.0, "normalize_advantages": False}
    adv = GeneralizedAdvantageEstimator(section, config)(
        inputs([2.0], [0], [[0.0, 1.0, 1.0, 0.0]], values=[[0.0, 0.5, 0.25, 0.0]]))
    assert adv.tolist() == [[0.0, 1.5, 1.75, 0.0]]  # returns 2 at both tokens minus their values


# ----------------------------------------------------------------------------- third-party estimators and losses


class MedianBaseline:
    """A third-party estimator as its docs describe: reward minus the group's median, scaled."""

    def __init__(self, section, config):
        self.scale = section["median_scale"]

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor:
        out = torch.empty_like(inputs.rewards)
        for gid in inputs.group_ids.unique():
            members = inputs.group_ids == gid
            out[members] = (inputs.rewards[members] - inputs.rewards[members].median()) * self.scale
        return out


@dataclass(frozen=True, kw_only=True)
class SquaredLoss(ConfiguredLoss):
    """A third-party loss with its own key under loss_fn.squared."""

    weight: float = 1.0

    @classmethod
    def from_config(cls, section):
        return cls(weight=section["squared"]["weight"])

    def __call__(self, logprobs, batch, *, global_valid_tokens, global_valid_seqs):
        loss = self.weight * (logprobs * batch.fields["token_mask"]).square().sum() / global_valid_tokens
        return loss, {"loss": float(loss)}


class ThirdParty:
    @hookimpl
    def nrl_advantage_estimators(self):
        return [AdvantageEstimatorSpec(name="median", estimator=f"{__name__}:MedianBaseline", distribution="nrl-test",
                                       config_schema=Section(fields={"median_scale": Field(type=float, default=1.0)}))]

    @hookimpl
    def nrl_loss_functions(self):
        return [LossFunctionSpec(name="squared", loss=f"{__name__}:SquaredLoss", distribution="nrl-test",
                                 config_schema=Section(fields={"weight": Field(type=float, default=1.0)})),
                LossFunctionSpec(name="for_sft", loss=f"{__name__}:SquaredLoss", distribution="nrl-test",
                                 algorithms=("sft",))]


def test_a_third_party_estimator_is_selected_by_name_with_its_keys():
    with get_plugin_manager().registered(ThirdParty(), name="third-party"):
        config = grpo_config("grpo.adv_estimator.name=median", "grpo.adv_estimator.median_scale=2.0")
        spec = get_plugin_manager().advantage_estimators().get("median", "grpo.adv_estimator.name")
    assert config["grpo"]["adv_estimator"]["median_scale"] == 2.0
    estimator = MedianBaseline(config["grpo"]["adv_estimator"], config)
    assert spec.estimator.endswith(":MedianBaseline")
    assert estimator(inputs([1.0, 4.0, 2.0], [0, 0, 0], [[1.0]] * 3)).tolist() == [-2.0, 4.0, 0.0]


def test_a_third_party_loss_is_selected_by_name_and_gets_its_section():
    with get_plugin_manager().registered(ThirdParty(), name="third-party"):
        config = grpo_config("loss_fn.name=squared", "loss_fn.squared.weight=0.5")
        with pytest.raises(ConfigError, match=r"loss_fn.name: loss 'for_sft' \(nrl-test\) is written for sft, not GRPO"):
            grpo_config("loss_fn.name=for_sft")
    assert SquaredLoss.from_config(config["loss_fn"]).weight == 0.5


def test_an_uninstalled_estimator_or_loss_is_one_line():
    with pytest.raises(ConfigError, match=r"grpo.adv_estimator.name: advantage estimator 'gdpo_x' is not available "
                                          r"\(installed: .*grpo.*\)"):
        grpo_config("grpo.adv_estimator.name=gdpo_x")
    with pytest.raises(ConfigError, match=r"loss_fn.name: loss function 'nope' is not available"):
        grpo_config("loss_fn.name=nope")


def test_two_estimators_declaring_one_key_differently_is_an_error():
    class Clash:
        @hookimpl
        def nrl_advantage_estimators(self):
            return [AdvantageEstimatorSpec(name="clash", estimator=f"{__name__}:MedianBaseline", distribution="nrl-x",
                                           config_schema=Section(fields={"minus_baseline": Field(type=int, default=3)}))]

    with get_plugin_manager().registered(Clash(), name="clash"):
        with pytest.raises(ConfigError, match="estimators 'reinforce_plus_plus' and 'clash' declare 'minus_baseline'"):
            grpo_config()


# ----------------------------------------------------------------------------- config rules, one line each


@pytest.mark.parametrize("overrides, message", [
    (["loss_fn.use_kl_in_reward=true"], "loss_fn.use_kl_in_reward: the KL penalty would go nowhere: estimator 'grpo'"),
    (["grpo.adv_estimator.name=gae"], "grpo.adv_estimator.name: estimator 'gae' needs values, which GRPO does not compute"),
    (["loss_fn.use_cispo=true", "loss_fn.disable_ppo_ratio=true"], "loss_fn.use_cispo: CISPO weighs each token by its "
                                                                    "clipped ratio, which loss_fn.disable_ppo_ratio removes"),
    (["loss_fn.truncated_importance_sampling_type=icepop", "loss_fn.truncated_importance_sampling_ratio=5",
      "loss_fn.use_importance_sampling_correction=true"],
     "loss_fn.truncated_importance_sampling_ratio_min: icepop keeps weights within"),
    (["loss_fn.truncated_importance_sampling_type=tis", "loss_fn.truncated_importance_sampling_ratio=2"],
     "loss_fn.truncated_importance_sampling_type: truncates the importance-sampling weights; set "
     "loss_fn.use_importance_sampling_correction: true"),
    (["loss_fn.sequence_level_importance_ratios=true"], "loss_fn.sequence_level_importance_ratios: sequence-level "
                                                        "ratios \\(GSPO\\) average per sequence"),
    (["loss_fn.ratio_clip_c=1.0"], "loss_fn.ratio_clip_c: must be greater than 1"),
])
def test_inconsistent_loss_and_estimator_keys_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        grpo_config(*overrides)


def test_the_same_rules_hold_for_a_loss_built_in_code():
    with pytest.raises(ValueError, match="loss_fn.use_cispo: CISPO replaces the clipped objective"):
        ClippedPGLoss(use_cispo=True, ratio_clip_c=3.0)


def test_cispo_keeps_the_separate_logprob_pass():
    from nrl_core.algorithms.grpo_config import on_policy_ratio

    config = grpo_config("loss_fn.use_cispo=true", "loss_fn.force_on_policy_ratio=null")
    assert on_policy_ratio(config) is False
    config["loss_fn"]["use_cispo"] = False
    rollouts = config["grpo"]["num_prompts_per_step"] * config["grpo"]["num_generations_per_prompt"]
    assert on_policy_ratio(config) is (rollouts == config["policy"]["train_global_batch_size"])


# ----------------------------------------------------------------------------- resuming older checkpoints


def test_resuming_a_checkpoint_of_the_old_semantics_warns_once(caplog):
    with caplog.at_level(logging.WARNING, logger="nrl_core.algorithms.grpo"):
        warn_if_other_semantics({"step": 3})  # written before the version was recorded
        warn_if_other_semantics({"grpo_semantics": GRPO_SEMANTICS_VERSION})
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "GRPO semantics version 1" in warnings[0] and "docs/changelog.md" in warnings[0]


# ----------------------------------------------------------------------------- corrections that must reduce


def _loss_and_grad(loss_fn: ClippedPGLoss, prev_offset: float = 0.0, engine_is_trainer: bool = False):
    """Loss and gradient on fixed numbers; ``prev_offset`` moves the previous logprobs off the
    current ones, ``engine_is_trainer`` makes the engine's logprobs equal the previous ones."""
    torch.manual_seed(3)
    lp = (torch.rand(3, 5, dtype=torch.float64) - 1.5)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float64)
    prev = lp + prev_offset
    fields = {"token_mask": mask, "advantages": torch.tensor([[1.0], [-0.5], [2.0]], dtype=torch.float64) * mask,
              "prev_logprobs": prev,
              "generation_logprobs": prev.clone() if engine_is_trainer else lp + 0.3 * torch.rand(3, 5, dtype=torch.float64),
              "sample_mask": torch.ones(3, dtype=torch.float64)}
    batch = TokenBatch(input_ids=torch.zeros(3, 5, dtype=torch.long), input_lengths=torch.full((3,), 5), fields=fields)
    leaf = lp.clone().requires_grad_(True)
    tokens, seqs = batch.loss_counts()
    loss, _ = loss_fn(leaf, batch, global_valid_tokens=tokens, global_valid_seqs=seqs)
    loss.backward()
    return float(loss.detach()), leaf.grad


@pytest.mark.parametrize("truncation", [
    {"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 1e9},
    {"truncated_importance_sampling_type": "icepop", "truncated_importance_sampling_ratio": 1e9,
     "truncated_importance_sampling_ratio_min": 0.0},
    {"truncated_importance_sampling_type": "seq-mask-tis", "truncated_importance_sampling_ratio": 1e9,
     "truncated_importance_sampling_ratio_min": 0.0},
])
def test_truncations_with_bounds_that_never_bind_are_plain_importance_sampling(truncation):
    plain = _loss_and_grad(ClippedPGLoss(use_importance_sampling_correction=True))
    truncated = _loss_and_grad(ClippedPGLoss(use_importance_sampling_correction=True, **truncation))
    assert truncated[0] == plain[0] and torch.equal(truncated[1], plain[1])


@pytest.mark.parametrize("variant", [{"use_cispo": True}, {"disable_ppo_ratio": True}])
def test_cispo_and_reinforce_have_the_policy_gradient_of_ppo_on_policy(variant):
    # prev == logprobs: ratio 1, inside the clip; all three gradients are -A grad(logprobs) / tokens
    ppo = _loss_and_grad(ClippedPGLoss())
    other = _loss_and_grad(ClippedPGLoss(**variant))
    torch.testing.assert_close(other[1], ppo[1], rtol=0, atol=1e-15)


def test_importance_sampling_with_the_engine_equal_to_the_trainer_changes_nothing():
    # generation == prev: every weight is exactly 1, so the corrected loss is the plain one
    plain = _loss_and_grad(ClippedPGLoss(), prev_offset=0.01, engine_is_trainer=True)
    corrected = _loss_and_grad(ClippedPGLoss(use_importance_sampling_correction=True,
                                             truncated_importance_sampling_type="icepop",
                                             truncated_importance_sampling_ratio=2.0,
                                             truncated_importance_sampling_ratio_min=0.5),
                               prev_offset=0.01, engine_is_trainer=True)
    assert corrected[0] == plain[0] and torch.equal(corrected[1], plain[1])


def test_advantages_are_clipped_after_the_estimator():
    from nrl_core.algorithms.advantages import clip_advantages

    config = grpo_config("grpo.advantage_clip_low=-1.0", "grpo.advantage_clip_high=0.5")
    adv = GroupRelativeEstimator(config["grpo"]["adv_estimator"], config)(
        inputs([3.0, 0.0, 0.0, 0.0], [0, 0, 0, 0], [[1.0]] * 4))
    clipped = clip_advantages(adv, config["grpo"]["advantage_clip_low"], config["grpo"]["advantage_clip_high"])
    assert float(adv[0]) > 0.5 and clipped.tolist() == [0.5, *adv[1:].clamp(min=-1.0).tolist()]
    assert clip_advantages(adv, None, None) is adv
