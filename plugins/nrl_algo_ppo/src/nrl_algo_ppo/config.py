"""The ``ppo`` section, NeMo RL's ``value_loss_fn`` and the checks that relate them to the critic
(``value``), with NeMo RL's names and defaults (``examples/configs/ppo_math_1B.yaml``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nrl_core.api import GRPO_SCHEMA as GRPO
from nrl_core.api import ConfigError, Field, Section, check_async_rollouts, check_in_flight, shaping_problem

NUMBER = (int, float)

ADV_ESTIMATOR = Section(doc="Generalized advantage estimation on the critic's values (NeMo RL's keys).", fields={
    "name": Field(type=str, default="gae", choices=("gae",), doc="PPO's estimator: GAE on the critic's values"),
    "gae_lambda": Field(type=NUMBER, default=0.95, minimum=0),
    "gae_gamma": Field(type=NUMBER, default=1.0, minimum=0),
    "normalize_advantages": Field(type=bool, default=True, doc="whiten over every valid token of the step"),
    "gae_lambda_value": Field(type=NUMBER, default=None, nullable=True, minimum=0,
                              doc="lambda of the critic's returns (VAPO: 1.0); null: gae_lambda"),
    "gae_lambda_policy": Field(type=NUMBER, default=None, nullable=True, minimum=0,
                               doc="lambda of the policy's advantages; null: gae_lambda"),
    "length_adaptive_alpha": Field(type=NUMBER, default=0.0, minimum=0,
                                   doc="VAPO: > 0 gives each response the policy lambda 1 - 1/(alpha x its length)"),
})

ASYNC_PPO = Section(doc="Generation runs ahead of training with bounded staleness (NeMo RL's keys; the core's "
                        "trajectory collector, as async GRPO's).", fields={
    "enabled": Field(type=bool, default=False),
    "max_trajectory_age_steps": Field(type=int, default=1, minimum=0,
                                      doc="optimizer steps a rollout's weights may lag the ones it trains"),
    "warmup_generation_lead_steps": Field(type=int, default=None, nullable=True, inert=True,
                                          doc="the collector runs ahead by max_trajectory_age_steps"),
    "in_flight_weight_updates": Field(type=bool, default=False,
                                      doc="refits land in the requests in flight instead of waiting for them"),
    "recompute_kv_cache_after_weight_updates": Field(type=bool, default=False,
                                                     doc="after an in-flight refit the requests in flight recompute "
                                                         "their KV cache with the new weights"),
    "drop_incomplete_targets_on_restore": Field(type=bool, default=False, inert=True),
})

PPO_SCHEMA = Section(doc="PPO with a value model (nrl-algo-ppo; NeMo RL's names and meaning).", fields={
    "num_prompts_per_step": Field(type=int, default=32, minimum=1),
    "num_generations_per_prompt": Field(type=int, default=16, minimum=1),
    "max_rollout_turns": Field(type=int, default=1, minimum=1, doc="turns of an episode; nrl's PPO trains on one (1)"),
    "max_num_epochs": Field(type=int, default=100000, minimum=-1, doc="-1: no limit (NeMo RL's asynchronous recipes)"),
    "max_num_steps": Field(type=int, default=100000, minimum=-1, doc="-1: as many as max_num_epochs allow"),
    "ppo_epochs": Field(type=int, default=4, minimum=1,
                        doc="passes over one step's rollouts, each training the critic and then the policy"),
    "policy_training_start_step": Field(type=int, default=0, minimum=0,
                                        doc="steps that train the critic alone before the policy trains"),
    "val_period": Field(type=int, default=20, doc="validate every N steps; 0 or less never"),
    "val_at_start": Field(type=bool, default=True),
    "val_at_end": Field(type=bool, default=False),
    "overlong_filtering": Field(type=bool, default=False, doc="truncated responses train neither model"),
    "max_val_samples": Field(type=int, default=256, minimum=0),
    "val_batch_size": Field(type=int, default=256, minimum=1),
    "seed": Field(type=int, default=42),
    "use_dynamic_sampling": Field(type=bool, default=False,
                                  doc="NeMo RL's PPO reads it without applying it; nrl refuses true"),
    "dynamic_sampling_max_gen_batches": Field(type=int, default=10, minimum=1, inert=True),
    "batch_multiplier": Field(type=NUMBER, default=1, minimum=1, doc="must be 1 (no dynamic sampling)"),
    "skip_reference_policy_logprobs_calculation": Field(type=bool, default=True,
                                                        doc="no reference logprobs (needs no KL penalty)"),
    "async_ppo": ASYNC_PPO,
    "reward_shaping": GRPO.fields["reward_shaping"],
    "reward_scaling": GRPO.fields["reward_scaling"],
    "adv_estimator": ADV_ESTIMATOR,
    "seq_logprob_error_threshold": Field(type=NUMBER, default=None, nullable=True, minimum=1,
                                         doc="responses whose mean exp|generation - policy logprob| exceeds it train "
                                             "neither model"),
})

SHARED_KEYS: Mapping[str, Section] = {
    "": Section(fields={"value_loss_fn": Section(doc="PPO's critic loss (NeMo RL's MseValueLossFn).", fields={
        "scale": Field(type=NUMBER, default=1.0, minimum=0, doc="the loss is 0.5 x scale x the squared error"),
        "cliprange": Field(type=NUMBER, default=None, nullable=True, minimum=0,
                           doc="keep each value within this of the value the step began with (PPO's value clipping)"),
    })}),
}


def uses_reference_policy(config: Mapping[str, Any]) -> bool:
    """PPO asks for reference logprobs unless ``skip_reference_policy_logprobs_calculation``; then
    its policy keeps no copy of the initial weights."""
    return not config["ppo"]["skip_reference_policy_logprobs_calculation"]


def check_ppo(config: Mapping[str, Any]) -> None:
    """What the schema cannot say: a critic on a backend with a value head, the features nrl's PPO
    does not offer, reward processing that makes sense, divisible batches."""
    ppo = config["ppo"]
    if config.get("value") is None:
        raise ConfigError("value", "PPO needs a value model: add a value section shaped like policy (value.model_name "
                                   "and its backend section)")
    if ppo["async_ppo"]["enabled"]:
        _check_async(config)
    if ppo["use_dynamic_sampling"]:
        raise ConfigError("ppo.use_dynamic_sampling", "NeMo RL's PPO reads this key but never applies it; set it to "
                                                      "false")
    if ppo["batch_multiplier"] != 1:
        raise ConfigError("ppo.batch_multiplier", f"{ppo['batch_multiplier']} only applies with dynamic sampling; "
                                                  "set it to 1")
    if int(ppo["max_rollout_turns"]) != 1:
        raise ConfigError("ppo.max_rollout_turns", "nrl's PPO trains on single responses; set it to 1")
    head = config["value"]["reward_model_cfg"]
    if head["enabled"] and head["reward_model_type"] != "regression":
        raise ConfigError("value.reward_model_cfg.reward_model_type",
                          f"the critic gives a value per token: set it to regression, got '{head['reward_model_type']}'")
    if ppo["skip_reference_policy_logprobs_calculation"] and config["loss_fn"]["reference_policy_kl_penalty"]:
        raise ConfigError("ppo.skip_reference_policy_logprobs_calculation",
                          "the KL penalty (loss_fn.reference_policy_kl_penalty) needs the reference logprobs; set it to "
                          "false or the penalty to 0")
    problem = shaping_problem(ppo)
    if problem is not None:
        raise ConfigError("ppo." + problem[0].split(".", 1)[1], problem[1])
    responses = int(ppo["num_prompts_per_step"]) * int(ppo["num_generations_per_prompt"])
    for key in ("policy", "value"):
        size = int(config[key]["train_global_batch_size"])
        if responses % size:
            raise ConfigError(f"{key}.train_global_batch_size",
                              f"{size} does not divide the {responses} responses of a step (ppo.num_prompts_per_step x "
                              "num_generations_per_prompt); make it a divisor")
    _check_critic_backend(config)


def _check_async(config: Mapping[str, Any]) -> None:
    """Asynchronous PPO as NeMo RL runs it: engines of their own that stream groups, and importance
    weights for the rollouts older weights sampled."""
    from nrl_core.api import generation_spec

    check_async_rollouts(config, "ppo.async_ppo.enabled")
    spec = generation_spec(config)
    if "streaming" not in spec.capabilities:
        raise ConfigError("ppo.async_ppo.enabled", f"the {spec.name} generation backend ({spec.distribution}) cannot "
                                                   "stream rollouts, which asynchronous PPO needs; set it to false")
    check_in_flight(config["ppo"]["async_ppo"], "ppo.async_ppo", spec, config["policy"])


def _check_critic_backend(config: Mapping[str, Any]) -> None:
    """The critic's backend declares ``value_head`` and accepts the critic with its head (its own
    checks, which the section was validated without when ``reward_model_cfg.enabled`` is false)."""
    from nrl_core.api import choose_backends, renamed_error, run_backend_check

    critic = critic_config(config)
    spec = choose_backends(critic, generation=False, warn=False).training
    if "value_head" not in spec.capabilities:
        raise ConfigError("value", f"the {spec.name} training backend ({spec.distribution}) does not declare "
                                   "value_head, which PPO's critic needs; use a backend that does")
    try:
        run_backend_check(spec.config_check, critic)
    except ConfigError as exc:
        raise renamed_error(exc, "value") from None


def critic_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The critic as a model config of its own (:func:`nrl_core.config.models.model_config`), with a
    regression value head whatever ``value.reward_model_cfg.enabled`` says (NeMo RL's Megatron
    recipes leave it false: its value worker always has the head)."""
    from nrl_core.api import model_config

    critic = model_config(config, "value")
    critic["policy"]["reward_model_cfg"] = {"enabled": True, "reward_model_type": "regression"}
    return critic
