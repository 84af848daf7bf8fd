"""GRPO's config section and its checks, registered with its :class:`~nrl_core.contracts.AlgorithmSpec`
so the schema comes from the algorithm, not the core. Imports nothing heavy: ``nrl config check``
and ``nrl plugins`` load it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nrl_core.algorithms.rewards import shaping_problem
from nrl_core.config.core_schema import NUMBER
from nrl_core.errors import ConfigError
from nrl_core.plugins import get_plugin_manager
from nrl_core.schema import Field, Section

#: Batch fields GRPO can compute before the advantages, for an estimator's ``needs``.
GRPO_BATCH_FIELDS = ("prev_logprobs", "reference_logprobs")

GRPO = Section(doc="GRPO algorithm settings (NeMo RL's names and meaning).", fields={
    "num_prompts_per_step": Field(type=int, default=32, minimum=1, doc="distinct prompts per step"),
    "num_generations_per_prompt": Field(type=int, default=16, minimum=1, doc="responses per prompt (the group)"),
    "max_rollout_turns": Field(type=int, default=1, minimum=1,
                               doc="model turns per episode with an environment that talks back (multi_turn)"),
    "max_num_epochs": Field(type=int, default=1, minimum=1),
    "max_num_steps": Field(type=int, default=1000000, minimum=1),
    "normalize_rewards": Field(type=bool, default=True, doc="divide advantages by the group's reward std"),
    "use_leave_one_out_baseline": Field(type=bool, default=True),
    "adv_estimator": Section(doc="The advantage estimator (NeMo RL's keys); docs/configuration.md lists them.", fields={
        "name": Field(type=str, default="grpo", doc="the estimator, from the nrl_advantage_estimators hook"),
        "normalize_rewards": Field(type=bool, default=None, nullable=True, doc="null: grpo.normalize_rewards"),
        "use_leave_one_out_baseline": Field(type=bool, default=None, nullable=True,
                                            doc="null: grpo.use_leave_one_out_baseline"),
        "std_of": Field(type=str, default="others", choices=("others", "group"),
                        doc="the std advantages are divided by: of the rewards the baseline averages (NeMo RL) or "
                            "of the whole group (TRL, verl)"),
    }),
    "advantage_clip_low": Field(type=NUMBER, default=None, nullable=True, doc="lower bound of normalised advantages"),
    "advantage_clip_high": Field(type=NUMBER, default=None, nullable=True, doc="upper bound of normalised advantages"),
    "use_dynamic_sampling": Field(type=bool, default=False,
                                  doc="DAPO: train only on prompts whose responses' rewards differ, generating more "
                                      "batches until num_prompts_per_step such prompts are found"),
    "dynamic_sampling_max_gen_batches": Field(type=int, default=10, minimum=1,
                                              doc="generation batches one step may use before it stops with an error"),
    "batch_multiplier": Field(type=NUMBER, default=1.0, minimum=1,
                              doc="with dynamic sampling, each generation batch has num_prompts_per_step x this prompts"),
    "reward_scaling": Section(doc="Clamp rewards to [source_min, source_max], map them onto [target_min, target_max].",
                              fields={
        "enabled": Field(type=bool, default=False),
        "source_min": Field(type=NUMBER, default=0.0), "source_max": Field(type=NUMBER, default=1.0),
        "target_min": Field(type=NUMBER, default=0.0), "target_max": Field(type=NUMBER, default=1.0),
    }),
    "reward_shaping": Section(doc="DAPO's overlong penalty, or the stop-properly penalty (NeMo RL's keys).", fields={
        "enabled": Field(type=bool, default=False),
        "overlong_buffer_length": Field(type=int, default=128, nullable=True, minimum=1,
                                        doc="responses longer than max_response_length minus this are penalised"),
        "overlong_buffer_penalty": Field(type=NUMBER, default=1.0, nullable=True, minimum=0,
                                         doc="the penalty at max_response_length, growing linearly over the buffer"),
        "max_response_length": Field(type=int, default=None, nullable=True, minimum=1,
                                     doc="null: policy.max_total_sequence_length"),
        "stop_properly_penalty_coef": Field(type=NUMBER, default=None, nullable=True,
                                            doc="instead of the overlong penalty: truncated responses' rewards times this"),
    }),
    "val_period": Field(type=int, default=10, doc="validate every N steps; 0 or less never (NeMo RL uses -1)"),
    "val_start_at": Field(type=int, default=-1,
                          doc="periodic validation only at steps from this one on (NeMo RL); -1 from the start"),
    "val_at_start": Field(type=bool, default=False),
    "val_at_end": Field(type=bool, default=False),
    "overlong_filtering": Field(type=bool, default=False, doc="zero the loss of truncated responses"),
    "max_val_samples": Field(type=int, default=256, minimum=0),
    "val_batch_size": Field(type=int, default=256, minimum=1),
    "seed": Field(type=int, default=42),
    "async_grpo": Section(doc="Generation runs ahead of training (nrl_core/algorithms/async_grpo.py).", fields={
        "enabled": Field(type=bool, default=False,
                         doc="needs non-colocated generation, an async engine and importance-sampling correction"),
        "max_trajectory_age_steps": Field(type=int, default=1, minimum=0,
                                          doc="train on rollouts sampled at most this many optimizer steps ago; "
                                              "0 is synchronous training"),
        "max_generation_failures": Field(type=int, default=0, inert=True),
        "in_flight_weight_updates": Field(type=bool, default=False,
                                          doc="refits land in the requests in flight instead of waiting for them "
                                              "(a generation backend that declares in_flight_updates)"),
        "recompute_kv_cache_after_weight_updates": Field(
            type=bool, default=False, doc="after an in-flight refit the requests in flight recompute their KV "
                                          "cache with the new weights; false keeps the old weights' cache"),
    }),
})


def check_grpo(config: Mapping[str, Any]) -> None:
    """GRPO's own rules: it generates, its groups have a baseline, its rollouts fill whole
    optimizer steps."""
    grpo, policy = config["grpo"], config["policy"]
    if policy["generation"] is None:
        raise ConfigError("policy.generation", "GRPO generates rollouts; configure a generation backend")
    group = grpo["num_generations_per_prompt"]
    if grpo["use_leave_one_out_baseline"] and group < 2:
        raise ConfigError("grpo.num_generations_per_prompt",
                          f"{group} leaves no other response to form the leave-one-out baseline; use at least 2 "
                          "(or set grpo.use_leave_one_out_baseline: false)")
    if grpo["async_grpo"]["enabled"]:
        check_async_rollouts(config, "grpo.async_grpo.enabled")
    _check_loss_and_estimator(config)
    _check_reward_processing(config)
    _check_turns(config)
    rollouts = grpo["num_prompts_per_step"] * group
    if rollouts % policy["train_global_batch_size"]:
        raise ConfigError("policy.train_global_batch_size",
                          f"{policy['train_global_batch_size']} does not divide the {rollouts} rollouts per step "
                          f"(grpo.num_prompts_per_step x num_generations_per_prompt); make it a divisor")
    if config["loss_fn"].get("force_on_policy_ratio") and rollouts != policy["train_global_batch_size"]:
        raise ConfigError("loss_fn.force_on_policy_ratio",
                          f"needs one optimizer step per GRPO step, but {rollouts} rollouts make "
                          f"{rollouts // policy['train_global_batch_size']} of policy.train_global_batch_size "
                          f"{policy['train_global_batch_size']}; set train_global_batch_size: {rollouts} or "
                          "force_on_policy_ratio: null")


def uses_reference_policy(config: Mapping[str, Any]) -> bool:
    """GRPO asks for reference logprobs for a KL penalty (in the loss, or in the reward with
    ``use_kl_in_reward``), and for an advantage estimator that needs them other than for that
    penalty (one that takes the KL into the reward reads them only for it); otherwise its policy
    keeps no copy of the initial weights."""
    if config["loss_fn"]["reference_policy_kl_penalty"]:
        return True
    name = (config["grpo"].get("adv_estimator") or {}).get("name", "grpo")
    estimator = get_plugin_manager().advantage_estimators().get(name, "grpo.adv_estimator.name")
    return "reference_logprobs" in estimator.needs and not estimator.uses_kl_in_reward


def on_policy_ratio(config: Mapping[str, Any]) -> bool:
    """Whether the loss takes the previous-policy logprobs from the training forward itself.

    With one optimizer step per GRPO step, every micro-batch's training forward runs under the
    weights a separate ``get_logprobs`` pass would use, so that pass is redundant work (TRL skips
    it too); with several, later steps need the logprobs of the weights before the first.
    ``loss_fn.force_on_policy_ratio`` null decides by that (CISPO keeps the pass, as NeMo RL
    refuses to force its ratio); false keeps the separate pass."""
    forced = config["loss_fn"].get("force_on_policy_ratio")
    if forced is not None:
        return bool(forced)
    if config["loss_fn"].get("use_cispo"):
        return False
    grpo = config["grpo"]
    rollouts = grpo["num_prompts_per_step"] * grpo["num_generations_per_prompt"]
    return rollouts == config["policy"]["train_global_batch_size"]


def _check_loss_and_estimator(config: Mapping[str, Any]) -> None:
    """The selected loss and estimator are installed and get what they need from GRPO (the loss's
    own keys are checked for every config: ``nrl_core.config.checks``)."""
    loss = config["loss_fn"]
    plugins = get_plugin_manager()
    spec = plugins.loss_functions().get(loss.get("name", "clipped_pg"), "loss_fn.name")
    if "grpo" not in spec.algorithms:
        raise ConfigError("loss_fn.name", f"loss '{spec.name}' ({spec.distribution}) is written for "
                                          f"{', '.join(spec.algorithms)}, not GRPO; pick a GRPO loss such as clipped_pg")
    estimator_name = (config["grpo"].get("adv_estimator") or {}).get("name", "grpo")
    estimator = plugins.advantage_estimators().get(estimator_name, "grpo.adv_estimator.name")
    if "reward_components" in estimator.needs:
        env_name = config.get("data", {}).get("env_name", "math")
        environment = plugins.environments().get(env_name, "data.env_name")
        if not environment.reward_components:
            raise ConfigError("grpo.adv_estimator.name", f"estimator '{estimator.name}' needs an environment that "
                                                         f"reports several named rewards; data.env_name '{env_name}' "
                                                         "reports one (use a multi-reward environment such as "
                                                         "math_multi_reward, or the grpo estimator)")
    missing = [need for need in estimator.needs if need not in (*GRPO_BATCH_FIELDS, "reward_components")]
    if missing:
        raise ConfigError("grpo.adv_estimator.name", f"estimator '{estimator.name}' needs {', '.join(missing)}, which "
                                                     "GRPO does not compute (a value model's values come with PPO); "
                                                     "use grpo, reinforce_plus_plus or a plugin's")
    if loss.get("use_kl_in_reward") and not estimator.uses_kl_in_reward:
        raise ConfigError("loss_fn.use_kl_in_reward", f"the KL penalty would go nowhere: estimator '{estimator.name}' "
                                                      "does not take it into the reward; use reinforce_plus_plus or "
                                                      "set use_kl_in_reward: false")


def check_async_rollouts(config: Mapping[str, Any], key: str) -> None:
    """What rollouts of the core's trajectory collector need (``key`` enables them): engines on
    workers of their own, and importance weights for what older weights sampled."""
    if config["policy"]["generation"]["colocated"]["enabled"]:
        raise ConfigError(key, "needs generation on its own workers, which keep generating while training runs; set "
                               "policy.generation.colocated.enabled: false (and colocated.resources)")
    if not config["loss_fn"]["use_importance_sampling_correction"]:
        raise ConfigError("loss_fn.use_importance_sampling_correction",
                          f"must be true with {key}: rollouts sampled by older weights need the correction (NeMo RL "
                          "requires it; async runs collapse without it)")


def _check_turns(config: Mapping[str, Any]) -> None:
    """Several turns need an environment that answers each one."""
    turns = int(config["grpo"].get("max_rollout_turns", 1))
    name = config.get("data", {}).get("env_name", "math")
    if turns > 1 and not get_plugin_manager().environments().get(name, "data.env_name").multi_turn:
        raise ConfigError("grpo.max_rollout_turns", f"{turns} turns need an environment that answers each turn; "
                                                    f"data.env_name '{name}' scores single responses (set 1, or "
                                                    "use a multi-turn environment such as sliding_puzzle_game)")


def _check_reward_processing(config: Mapping[str, Any]) -> None:
    """Reward scaling, shaping and DAPO's dynamic sampling make sense together."""
    grpo = config["grpo"]
    if "reward_shaping" not in grpo:  # a config built in code, without these keys: all off
        return
    problem = shaping_problem(grpo)
    if problem is not None:
        raise ConfigError(*problem)
    if grpo["batch_multiplier"] != 1 and not grpo["use_dynamic_sampling"]:
        raise ConfigError("grpo.batch_multiplier", f"{grpo['batch_multiplier']} only applies with dynamic sampling; "
                                                   "set grpo.use_dynamic_sampling: true or batch_multiplier: 1")
    if grpo["use_dynamic_sampling"] and grpo["async_grpo"]["enabled"]:
        raise ConfigError("grpo.use_dynamic_sampling", "filters whole generation batches, which the asynchronous "
                                                       "collector does not form; use it with async_grpo.enabled: false")

