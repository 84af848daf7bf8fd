"""nrl-algo-ppo without a run: GAE, the returns and the value loss against their definitions, and the
config rules (a critic with a value head, what nrl's PPO does not offer) refused in one line."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nrl_algo_ppo")

from nrl_algo_ppo.gae import GAEConfig, advantages_and_returns, explained_variance, terminal_rewards, token_values  # noqa: E402
from nrl_algo_ppo.loss import OLD_VALUES, RETURNS, ClippedValueLoss  # noqa: E402
from nrl_core.algorithms.estimators import whiten  # noqa: E402
from nrl_core.algorithms.installed import load_and_validate  # noqa: E402
from nrl_core.contracts import TokenBatch  # noqa: E402
from nrl_core.errors import ConfigError  # noqa: E402
from nrl_core.testing.tiny_models import cached_tiny_model  # noqa: E402

RECIPE = "examples/configs/ppo_tiny_cpu.yaml"
MASK = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0, 0.0],    # a prompt of two tokens, three response tokens
                     [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]])


def test_gae_with_gamma_and_lambda_one_and_a_zero_critic_gives_the_plain_returns():
    """Every response token's advantage and return is the response's reward (what follows it)."""
    rewards = torch.tensor([2.0, -1.0])
    cfg = GAEConfig(gamma=1.0, lam=1.0, normalize=False)
    advantages, returns = advantages_and_returns(terminal_rewards(rewards, MASK), torch.zeros_like(MASK), MASK, cfg)
    plain = rewards[:, None] * MASK
    assert torch.equal(advantages.float(), plain) and torch.equal(returns.float(), plain)


def test_gae_by_its_recursion_with_decoupled_lambdas():
    """delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lambda A_{t+1}, over the response
    tokens only; the returns A + V use the value lambda, the advantages the policy's."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(2, 6, generator=g, dtype=torch.float64)
    token_rewards = terminal_rewards(torch.tensor([1.0, 0.5], dtype=torch.float64), MASK)
    gamma = 0.9

    def by_hand(lam: float) -> torch.Tensor:
        out = torch.zeros(2, 6, dtype=torch.float64)
        for row in range(2):
            steps = MASK[row].nonzero().flatten().tolist()
            following, next_value = 0.0, 0.0
            for t in reversed(steps):
                delta = token_rewards[row, t] + gamma * next_value - values[row, t]
                following = delta + gamma * lam * following
                out[row, t], next_value = following, values[row, t]
        return out

    cfg = GAEConfig(gamma=gamma, lam=0.95, lam_value=1.0, lam_policy=0.5, normalize=False)
    advantages, returns = advantages_and_returns(token_rewards, values, MASK, cfg)
    assert torch.allclose(advantages, by_hand(0.5), atol=1e-12)
    assert torch.allclose(returns, (by_hand(1.0) + values) * MASK, atol=1e-12)


def test_advantages_are_whitened_with_the_sample_variance_as_nemo_rl_does():
    g = torch.Generator().manual_seed(1)
    values = torch.randn(2, 6, generator=g, dtype=torch.float64)
    token_rewards = terminal_rewards(torch.tensor([1.0, 0.0], dtype=torch.float64), MASK)
    raw, _ = advantages_and_returns(token_rewards, values, MASK, GAEConfig(normalize=False))
    whitened, _ = advantages_and_returns(token_rewards, values, MASK, GAEConfig(normalize=True))
    picked = raw[MASK > 0]
    expected = (picked - picked.mean()) / (picked.var(unbiased=True) + 1e-8).sqrt()
    assert torch.allclose(whitened[MASK > 0], expected, atol=1e-12) and bool((whitened[MASK == 0] == 0).all())
    assert torch.allclose(whiten(raw, MASK.double()), (raw - picked.mean()) / picked.std(unbiased=False))


def test_length_adaptive_lambda_is_one_minus_one_over_alpha_times_length():
    cfg = GAEConfig(length_adaptive_alpha=0.1)
    lam = cfg.policy_lambda(torch.ones(3, 40) * (torch.arange(40) < torch.tensor([[5], [20], [40]])))
    assert torch.allclose(lam, torch.tensor([0.0, 0.5, 0.75]))


def test_the_value_of_a_tokens_state_is_the_heads_output_one_position_earlier():
    raw = torch.tensor([[1.0, 2.0, 3.0]])
    assert token_values(raw).tolist() == [[0.0, 1.0, 2.0]]


def test_explained_variance_is_one_for_a_perfect_critic_and_zero_for_the_mean():
    returns = torch.tensor([[0.0, 1.0, 3.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(returns, torch.full_like(returns, 4 / 3), mask) == pytest.approx(0.0, abs=1e-12)


def value_batch(old: torch.Tensor, returns: torch.Tensor) -> TokenBatch:
    return TokenBatch(input_ids=torch.zeros(2, 6, dtype=torch.long), input_lengths=torch.tensor([5, 6]),
                      fields={"token_mask": MASK, "sample_mask": torch.tensor([1.0, 1.0]), OLD_VALUES: old,
                              RETURNS: returns})


def test_the_value_loss_is_half_the_scaled_clipped_squared_error_per_token():
    g = torch.Generator().manual_seed(2)
    raw, old, returns = (torch.randn(2, 6, generator=g) for _ in range(3))
    batch = value_batch(old, returns)
    loss, metrics = ClippedValueLoss(scale=0.4, cliprange=0.2)(raw, batch, global_valid_tokens=6.0,
                                                               global_valid_seqs=2.0)
    predicted = token_values(raw)
    kept = old + (predicted - old).clamp(-0.2, 0.2)
    per_token = torch.maximum((predicted - returns) ** 2, (kept - returns) ** 2)
    assert float(loss) == pytest.approx(float(0.5 * 0.4 * (per_token * MASK).sum() / 6), rel=1e-6)
    clipped = ((kept - returns) ** 2 > (predicted - returns) ** 2).float()
    assert metrics["vf_clipfrac"] == pytest.approx(float((clipped * MASK).sum() / 6))
    unclipped, _ = ClippedValueLoss(scale=0.4)(raw, batch, global_valid_tokens=6.0, global_valid_seqs=2.0)
    assert float(unclipped) == pytest.approx(float(0.5 * 0.4 * (((predicted - returns) ** 2) * MASK).sum() / 6))


def test_value_loss_micro_batches_add_up_and_a_perfect_critic_has_zero_loss_and_gradient():
    g = torch.Generator().manual_seed(3)
    raw, old = torch.randn(2, 6, generator=g), torch.randn(2, 6, generator=g)
    batch = value_batch(old, token_values(raw) * MASK)
    loss_fn = ClippedValueLoss(cliprange=0.2)
    noisy = raw + torch.randn(2, 6, generator=g)
    whole, _ = loss_fn(noisy, batch, global_valid_tokens=6.0, global_valid_seqs=2.0)
    halves = [loss_fn(noisy[[r]], batch.select([r]), global_valid_tokens=6.0, global_valid_seqs=2.0)[0] for r in (0, 1)]
    assert float(sum(halves)) == pytest.approx(float(whole), rel=1e-6)
    exact = raw.clone().requires_grad_()
    loss, _ = ClippedValueLoss()(exact, batch, global_valid_tokens=6.0, global_valid_seqs=2.0)
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(exact.grad.abs().max()) == 0.0


# ---------------------------------------------------------------------------------------- config


@pytest.fixture(scope="module")
def model() -> str:
    return str(cached_tiny_model("llama", "small"))


def checked(model: str, *overrides: str) -> dict:
    return load_and_validate(RECIPE, [f"policy.model_name={model}", *overrides], algorithm="ppo")


def refusal(model: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        checked(model, *overrides)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_the_recipe_has_a_critic_with_a_value_head(model):
    config = checked(model)
    assert config["value"]["model_name"] == model and config["value"]["reward_model_cfg"]["enabled"]
    assert config["value_loss_fn"] == {"scale": 1.0, "cliprange": 0.2}
    assert config["ppo"]["adv_estimator"]["gae_lambda"] == 1.0 and config["ppo"]["ppo_epochs"] == 2


@pytest.mark.parametrize("override, start", [
    ("value=null", "value: PPO needs a value model"),
    ("ppo.async_ppo.enabled=true", "ppo.async_ppo.enabled: needs generation on its own workers"),
    ("ppo.use_dynamic_sampling=true", "ppo.use_dynamic_sampling: NeMo RL's PPO reads this key but never applies it"),
    ("value.reward_model_cfg.reward_model_type=bradley_terry", "value.reward_model_cfg.reward_model_type: the critic"),
    ("loss_fn.reference_policy_kl_penalty=0.1", "ppo.skip_reference_policy_logprobs_calculation: the KL penalty"),
    ("value.train_global_batch_size=96", "value.train_global_batch_size: 96 does not divide the 128 responses"),
    ("value.dtensor_config.tensor_parallel_size=3", "value.dtensor_config.tensor_parallel_size:"),
    ("policy.reward_model_cfg.enabled=true", "policy.reward_model_cfg.enabled: ppo does not train or read a value "
                                             "head (reward model) in policy"),
])
def test_what_ppo_cannot_run_is_refused_naming_the_key(model, override, start):
    assert refusal(model, override).startswith(start)


def test_asynchronous_ppo_needs_importance_weights(model):
    assert refusal(model, "ppo.async_ppo.enabled=true", "policy.generation.colocated.enabled=false",
                   "cluster.gpus_per_node=2", "policy.generation.colocated.resources.gpus_per_node=1").startswith(
        "loss_fn.use_importance_sampling_correction: must be true with ppo.async_ppo.enabled")


def test_a_critic_with_the_head_switched_off_gets_one_anyway(model):
    """NeMo RL's Megatron recipes leave value.reward_model_cfg.enabled false: its value worker
    always has the head, and so does nrl's critic."""
    from nrl_algo_ppo.config import critic_config

    config = checked(model, "value.reward_model_cfg.enabled=false")
    assert critic_config(config)["policy"]["reward_model_cfg"] == {"enabled": True, "reward_model_type": "regression"}
