"""Every hook nrl calls. A plugin implements any subset with ``@nrl_core.hookimpl``.

Two kinds of hook:

* **registration** hooks (collecting): every plugin's answer is gathered. Each returns a list of
  descriptor dataclasses from :mod:`nrl_core.contracts` (or ``None`` for nothing). The core builds
  one registry per hook, keyed by ``name``, and rejects duplicates. They are called once per
  process, lazily, the first time a registry is needed.
* **dispatch** hooks (first result): called with an object, the plugin that owns that object's
  type does the work and returns ``True``; every other plugin returns ``None``. The core logs who
  answered and fails if nobody did.
* **lifecycle** hooks (observing): called in the driver process, in order, at fixed points of a
  training run (start, each step's end, each published checkpoint, end), with a
  :class:`~nrl_core.contracts.RunInfo`. Every implementation runs; an exception in one fails the
  run like an error in the algorithm would.

pluggy calls implementations with keyword arguments only and never fills an implementation
parameter that has a default; arguments are added here only additively.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from nrl_core.contracts import (
        AdvantageEstimatorSpec,
        AlgorithmSpec,
        CheckpointOptions,
        CommandSpec,
        DataProcessorSpec,
        DatasetGeneratorSpec,
        DatasetSpec,
        EnvironmentSpec,
        GenerationBackendSpec,
        LossFunctionSpec,
        MetricSinkSpec,
        RefitTransportSpec,
        RunInfo,
        TrainingBackendSpec,
    )

PROJECT_NAME = "nrl"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Decorate a plugin's hook implementations with this (re-exported as ``nrl_core.hookimpl``)."""


@hookspec
def nrl_training_backends() -> list[TrainingBackendSpec] | None:
    """Training backends this plugin provides.

    Called by the core when it validates a config or selects a backend (``nrl config check``,
    ``nrl train``). Collecting. Each spec's ``config_schema`` is attached at
    ``policy.<config_key>``; the backend is a candidate when that section says ``enabled: true``.
    """


@hookspec
def nrl_generation_backends() -> list[GenerationBackendSpec] | None:
    """Generation backends this plugin provides.

    Called by the core when it validates a config or builds the generation workers. Collecting.
    Selected by ``policy.generation.backend``; the spec's schema is attached at
    ``policy.generation.<config_key>``.
    """


@hookspec
def nrl_environments() -> list[EnvironmentSpec] | None:
    """Reward environments this plugin provides.

    Called by the core when it validates ``env`` and when an algorithm builds its environments.
    Collecting. The schema is attached at ``env.<name>``.
    """


@hookspec
def nrl_refit_transports() -> list[RefitTransportSpec] | None:
    """Ways to move weight buckets from training workers into generation workers.

    Called by the refit orchestration when it is set up. Collecting.
    """


@hookspec
def nrl_metric_sinks() -> list[MetricSinkSpec] | None:
    """Metric loggers beyond the console and ``metrics.jsonl``, each switched on by
    ``logger.<name>_enabled`` with its options in ``logger.<name>``.

    Called when the config schema is built and when an algorithm builds its logger. Collecting.
    The core's ``tensorboard``, ``wandb`` and ``mlflow`` sinks register here too.
    """


@hookspec
def nrl_data_processors() -> list[DataProcessorSpec] | None:
    """Prompt processors (``data.processor``): turn a data record into token ids and metadata.

    Called when an algorithm prepares its data. Collecting. The core's ``math`` and ``sft``
    processors register here too.
    """


@hookspec
def nrl_dataset_generators() -> list[DatasetGeneratorSpec] | None:
    """Dataset generators (``data.dataset_name``), given ``data.generate`` as keyword arguments.

    Called when an algorithm loads its data and ``data.dataset_name`` is not a local path.
    Collecting. The core's ``arithmetic`` generator registers here too.
    """


@hookspec
def nrl_datasets() -> list[DatasetSpec] | None:
    """Named datasets of NeMo RL's data layout (``data.train.dataset_name``, ``data.validation``).

    Called when a config is validated (the name must resolve: ``nrl config check`` says where each
    dataset would load from) and when an algorithm loads its data. Collecting. An optional hook,
    added without a contract version: a plugin written for any contract may implement it.
    """


@hookspec
def nrl_algorithms() -> list[AlgorithmSpec] | None:
    """Algorithms runnable with ``nrl train <name>``.

    Called by the CLI to dispatch ``nrl train``. Collecting.
    """


@hookspec
def nrl_advantage_estimators() -> list[AdvantageEstimatorSpec] | None:
    """Advantage estimators (``grpo.adv_estimator.name``): rewards of a step's rollouts to advantages.

    Called when the config schema is built (each spec's keys under ``grpo.adv_estimator.<name>``)
    and once per run by the algorithm, which then calls the estimator in the driver every step.
    Collecting. The core's ``grpo`` (group-relative, NeMo RL's default) registers here too.
    """


@hookspec
def nrl_loss_functions() -> list[LossFunctionSpec] | None:
    """Policy losses (``loss_fn.name``) the training workers call once per micro-batch.

    Called when the config schema is built (each spec's keys under ``loss_fn.<name>``) and once
    per run by the algorithm, which ships the built loss to the workers with every train call.
    Collecting. The core's ``clipped_pg`` (NeMo RL's ``ClippedPGLossFn``) registers here too.
    """


@hookspec
def nrl_commands() -> list[CommandSpec] | None:
    """Collecting: subcommands this plugin adds to ``nrl`` (``nrl convert <name>``), each a
    :class:`~nrl_core.contracts.CommandSpec`. Called once when ``nrl`` builds its parser; the
    command's code is imported only when it runs. Since contract 8."""


@hookspec(firstresult=True)
def nrl_checkpoint_save(worker: Any, path: str, options: CheckpointOptions) -> bool | None:
    """Save ``worker``'s full training state (model, optimizer, scheduler, step, RNG when
    ``options.load_rng``) under the directory ``path``, honouring every field of ``options``.
    ``path`` is ``<checkpoint_dir>/.tmp_step_N/policy``: fresh, not yet created (create it), and
    the driver renames ``.tmp_step_N`` to ``step_N`` once the save (async included) is complete.

    Called on every rank of a training worker group by the checkpoint manager, inside the worker
    process. Stops at the first non-None result: return ``True`` when ``worker`` is yours,
    ``None`` otherwise. With ``options.async_save`` return once the save is scheduled.
    """


@hookspec(firstresult=True)
def nrl_checkpoint_load(worker: Any, path: str, options: CheckpointOptions) -> bool | None:
    """Load what :func:`nrl_checkpoint_save` wrote at ``path`` into ``worker``.

    Called on every rank when a run resumes. Stops at the first non-None result, as for saving.
    A checkpoint that is missing, truncated or from another model must raise
    :class:`nrl_core.errors.NrlError` with a one-line message and leave ``worker`` unchanged.
    """


# --------------------------------------------------------------------------- lifecycle


@hookspec
def nrl_run_start(run: RunInfo) -> None:
    """A run is built and about to take its first step (``run.first_step``).

    Called once by the driver after the workers are up and a resumed run's state is
    restored, before validation at start and before the first step.
    """


@hookspec
def nrl_step_end(run: RunInfo, step: int, metrics: dict[str, float]) -> str | None:
    """Step ``step`` has trained (and validated, when due); ``metrics`` is what it will log.

    Called by the driver after every step, before the step's metrics are logged and before its
    checkpoint is taken. Add entries to ``metrics`` to log them with the step. Return a reason
    (a string) to stop the run after this step: the step is then checkpointed as the last one and
    ``nrl_run_end`` reports ``status="stopped"`` with the first reason given; return ``None`` to go on.
    """


@hookspec
def nrl_checkpoint_saved(run: RunInfo, step: int, path: str, metrics: dict[str, float]) -> None:
    """The checkpoint of ``step`` is complete and published at ``path`` (a directory).

    Called by the driver once the checkpoint is renamed into place, which, with asynchronous saves,
    is when the next checkpoint starts or the run closes, not when the step ends. ``metrics`` are
    the step's metrics as recorded in the checkpoint.
    """


@hookspec
def nrl_run_end(run: RunInfo, status: str, last_step: int, metrics: dict[str, float],
                outputs: dict[str, str]) -> None:
    """The run is over: ``status`` is ``"completed"`` (every step ran), ``"stopped"`` (a
    ``nrl_step_end`` implementation asked for it) or ``"failed"`` (an exception is on its way to
    the user). ``metrics`` are the last step's; ``outputs`` name what was written (``metrics``,
    ``checkpoints``, ``hf_export``, ``plot``) and is empty after a failure.

    Called by the driver after pending checkpoints are published and the best one exported, before
    the workers are shut down.
    """
