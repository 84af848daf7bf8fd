"""The core's own plugin: what nrl-core itself registers through the same hooks as any plugin."""

from __future__ import annotations

from nrl_core.algorithms.dpo_schema import DPO_SCHEMA
from nrl_core.algorithms.grpo_config import GRPO
from nrl_core.algorithms.sft_config import SFT
from nrl_core.config.core_schema import NUMBER
from nrl_core.contracts import (
    AdvantageEstimatorSpec,
    AlgorithmSpec,
    DataProcessorSpec,
    DatasetGeneratorSpec,
    LossFunctionSpec,
    MetricSinkSpec,
    RefitTransportSpec,
)
from nrl_core.hookspecs import hookimpl
from nrl_core.schema import Field, Section


@hookimpl
def nrl_algorithms() -> list[AlgorithmSpec]:
    return [
        AlgorithmSpec(name="grpo", entry="nrl_core.algorithms.grpo:main", distribution="nrl-core",
                      description="Group Relative Policy Optimization", config_schema=GRPO,
                      config_check="nrl_core.algorithms.grpo_config:check_grpo", generates=True,
                      twin={"num_prompts_per_step": 2, "num_generations_per_prompt": 4},
                      reference_policy="nrl_core.algorithms.grpo_config:uses_reference_policy"),
        AlgorithmSpec(name="sft", entry="nrl_core.algorithms.sft:main", distribution="nrl-core",
                      description="supervised fine-tuning (response-only NLL)", config_schema=SFT,
                      reference_policy=False),
        AlgorithmSpec(name="dpo", entry="nrl_core.algorithms.dpo:main", distribution="nrl-core",
                      description="Direct Preference Optimization on (chosen, rejected) pairs", config_schema=DPO_SCHEMA,
                      config_check="nrl_core.algorithms.dpo_schema:check_dpo", data_kind="preference"),
    ]


@hookimpl
def nrl_refit_transports() -> list[RefitTransportSpec]:
    """The core's transports, the most specific with the highest priority: the orchestrator takes
    the highest one that works for a placement and device, so a refit within one process never pays
    for shared memory, and weights on GPUs never go through host memory by the core's choice."""
    return [
        RefitTransportSpec(name="in_process", transport="nrl_core.refit.transports:InProcessTransport",
                           placements=("same_process",), distribution="nrl-core", priority=30,
                           description="hand tensors over by reference"),
        RefitTransportSpec(name="shared_memory", transport="nrl_core.refit.transports:SharedMemoryTransport",
                           placements=("same_process", "same_node"), distribution="nrl-core", priority=20,
                           devices=("cpu",), description="one /dev/shm file per bucket, mapped by the receiver"),
        RefitTransportSpec(name="broadcast", transport="nrl_core.refit.transports:BroadcastTransport",
                           placements=("same_node", "cross_node"), distribution="nrl-core", priority=10, collective=True,
                           description="torch.distributed broadcast from training rank 0 (NCCL between GPUs, "
                                       "gloo on the CPU)"),
    ]


@hookimpl
def nrl_metric_sinks() -> list[MetricSinkSpec]:
    return [
        MetricSinkSpec(name="tensorboard", sink="nrl_core.logging.sinks:TensorBoardSink", distribution="nrl-core",
                       description="TensorBoard event files under <log_dir>/tensorboard"),
        MetricSinkSpec(name="wandb", sink="nrl_core.logging.sinks:WandbSink", distribution="nrl-core",
                       description="Weights & Biases (needs wandb); logger.wandb holds wandb.init arguments"),
        MetricSinkSpec(name="mlflow", sink="nrl_core.logging.sinks:MlflowSink", distribution="nrl-core",
                       description="MLflow (needs mlflow); logger.mlflow: experiment_name, run_name, tracking_uri"),
    ]


@hookimpl
def nrl_data_processors() -> list[DataProcessorSpec]:
    return [
        DataProcessorSpec(name="math", processor="nrl_core.data.processors:math_processor", distribution="nrl-core",
                          description="a prompt for the math environment; the answer goes to metadata.ground_truth"),
        DataProcessorSpec(name="sft", processor="nrl_core.data.processors:sft_processor", distribution="nrl-core",
                          description="prompt and response tokens, the loss on the response"),
    ]


@hookimpl
def nrl_dataset_generators() -> list[DatasetGeneratorSpec]:
    return [DatasetGeneratorSpec(name="arithmetic", generator="nrl_core.data.arithmetic:arithmetic_splits",
                                 distribution="nrl-core", description="seeded a + b / a - b problems (the demo's data)"),
            DatasetGeneratorSpec(name="arithmetic_preference",
                                 generator="nrl_core.data.preference:arithmetic_preference_splits",
                                 distribution="nrl-core",
                                 description="the arithmetic problems as preference pairs: right answer over a wrong one")]


@hookimpl
def nrl_advantage_estimators() -> list[AdvantageEstimatorSpec]:
    """NeMo RL's estimators; their shared keys (normalize_rewards, use_leave_one_out_baseline,
    std_of) sit at the top of ``grpo.adv_estimator``, as in NeMo RL's configs."""
    return [
        AdvantageEstimatorSpec(name="grpo", estimator="nrl_core.algorithms.estimators:GroupRelativeEstimator",
                               distribution="nrl-core",
                               description="reward minus the prompt's (leave-one-out) mean, over its std"),
        AdvantageEstimatorSpec(
            name="gdpo", estimator="nrl_core.algorithms.estimators:MultiRewardEstimator", distribution="nrl-core",
            needs=("reward_components",),
            config_schema=Section(fields={"reward_weights": Field(type=list, item_type=NUMBER, default=None, nullable=True,
                                                                  doc="one weight per named reward, alphabetical")}),
            description="GDPO: a group-relative advantage per named reward, weighted, summed, normalised"),
        AdvantageEstimatorSpec(
            name="reinforce_plus_plus", estimator="nrl_core.algorithms.estimators:ReinforcePlusPlusEstimator",
            distribution="nrl-core", needs=("prev_logprobs", "reference_logprobs"), uses_kl_in_reward=True,
            config_schema=Section(fields={"minus_baseline": Field(type=bool, default=True,
                                                                  doc="subtract the prompt's mean reward")}),
            description="REINFORCE++: baseline, KL in the reward, whitened over the batch's tokens"),
        AdvantageEstimatorSpec(
            name="gae", estimator="nrl_core.algorithms.estimators:GeneralizedAdvantageEstimator",
            distribution="nrl-core", needs=("values", "prev_logprobs", "reference_logprobs"), uses_kl_in_reward=True,
            config_schema=Section(fields={
                "gae_gamma": Field(type=NUMBER, default=1.0, minimum=0), "gae_lambda": Field(type=NUMBER, default=0.95, minimum=0),
                "normalize_advantages": Field(type=bool, default=True)}),
            description="generalized advantage estimation on a value model's values (PPO)"),
    ]


@hookimpl
def nrl_loss_functions() -> list[LossFunctionSpec]:
    return [LossFunctionSpec(name="clipped_pg", loss="nrl_core.algorithms.loss:ClippedPGLoss", distribution="nrl-core",
                             description="NeMo RL's ClippedPGLossFn: PPO/GRPO clipping, GSPO, CISPO, REINFORCE, "
                                         "truncated importance sampling, KL penalty")]
