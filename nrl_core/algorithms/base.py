"""What GRPO and SFT share: the policy workers, the prompt dataloader, checkpoints (save, resume,
HF export of the best) and the metric logger. Subclasses write ``step`` and ``validate``."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from nrl_core.algorithms.policy import Policy
from nrl_core.algorithms.policy_launch import colocated_generation
from nrl_core.algorithms.runtime import Runtime, call_with_runtime
from nrl_core.algorithms.setup import resume_point, seed_everything
from nrl_core.checkpoint.manager import CheckpointManager
from nrl_core.cluster import cluster_failure, init_ray, shutdown_ray
from nrl_core.config import choose_backends
from nrl_core.contracts import RunInfo
from nrl_core.data import DatumSpec, PromptDataloader
from nrl_core.errors import ConfigError
from nrl_core.logging import MetricLogger
from nrl_core.timeline import mark
from nrl_core.watchdog import Watchdog, fired, phase

logger = logging.getLogger(__name__)


class AlgorithmRun:
    """One run of an algorithm: build, ``run()`` the step loop, ``close()``."""

    section: str  # the algorithm's config section ("grpo", "sft")
    summary_prefixes: tuple[str, ...] = ("val/",)  # metrics the final log line reports
    val_data: Sequence[DatumSpec] = ()

    def __init__(self, config: Mapping[str, Any], *, batch_size: int, train_data: Sequence[DatumSpec],
                 with_generation: bool = False, runtime: Runtime | None = None) -> None:
        """``runtime``: what ``nrl train`` made for the run (its registries, the workers it launched
        early); a run built in code gets this process's plugins and launches its own workers."""
        self.runtime = runtime if runtime is not None else Runtime.for_process()
        self.config = config
        self.cfg = config[self.section]
        seed_everything(self.cfg["seed"])
        self.choice = choose_backends(config, self.runtime.plugins, generation=with_generation)
        self.train_loader = PromptDataloader(train_data, batch_size, shuffle=config["data"]["shuffle"],
                                             seed=self.cfg["seed"])
        self.checkpoints = CheckpointManager(config["checkpointing"], on_publish=self.checkpoint_published)
        self.resume_from, self.state = resume_point(self.checkpoints)
        init_ray(config["cluster"])
        spec = self.algorithm_spec()
        self.algorithm_name = spec.name if spec is not None else self.section  # whose checks the config passed
        self.policy = Policy(self.worker_config(config), self.choice.training, generation=self.choice.generation,
                             colocated_generation=colocated_generation(config, generates=with_generation),
                             models_beside=len(spec.model_sections) if spec is not None else 0,
                             reference_policy=spec is None or spec.uses_reference_policy(config),
                             runtime=self.runtime)
        mark("policy_built")
        epochs, steps = int(self.cfg["max_num_epochs"]), int(self.cfg["max_num_steps"])
        by_epochs = epochs * len(self.train_loader) if epochs > 0 else None  # NeMo RL's -1: no limit
        if steps < 0 and by_epochs is None:
            raise ConfigError(f"{self.section}.max_num_steps", "and max_num_epochs are both unlimited (-1); bound one")
        self.max_steps = by_epochs if steps < 0 else steps if by_epochs is None else min(steps, by_epochs)
        self.log = MetricLogger(config["logger"], plugins=self.runtime.plugins, total_steps=self.max_steps,
                                resume_step=self.state.step if self.resume_from is not None else None)
        self.hooks = self.runtime.plugins
        self.info = RunInfo(algorithm=self.section, config=config, first_step=self.state.step + 1,
                            max_steps=self.max_steps, log_dir=str(self.log.log_dir),
                            checkpoint_dir=str(self.checkpoints.root) if self.checkpoints.enabled else None)
        self.stop_reason: str | None = None
        self.last_metrics: dict[str, float] = {}

    def algorithm_spec(self) -> Any:
        """The installed ``AlgorithmSpec`` of this run's section (None for a run built in code only)."""
        return next((spec for spec in self.runtime.plugins.algorithms() if spec.section == self.section), None)

    def worker_config(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        """The config the training workers get (DPO counts its batches in pairs, workers in sequences)."""
        return config

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict[str, float]:
        if self.resume_from is not None:
            with phase("checkpoint_load"):
                self.restore(self.resume_from)
        self.start()
        self.hooks.run_start(self.info)
        if self.cfg["val_at_start"] and self.state.step == 0:
            with phase("validation", step=0):
                self.last_metrics = self.validate(0)
            if self.last_metrics:
                self.log.log_step(0, self.last_metrics)
        for step in range(self.state.step + 1, self.max_steps + 1):
            with phase("step", step=step):
                metrics = self.step(self.step_data(step))
            mark("step_end", step=step)
            if self.validation_due(step):
                with phase("validation", step=step):
                    metrics.update(self.validate(step))
            self.stop_reason = self.hooks.step_end(self.info, step, metrics)
            self.log.log_step(step, metrics)
            self.state.step = step
            last_step = step == self.max_steps or self.stop_reason is not None
            if self.checkpoints.should_save(step, last_step=last_step):
                with phase("checkpoint_save", step=step):
                    self.save_checkpoint(step, metrics)
            self.last_metrics = metrics
            if self.stop_reason is not None:
                logger.info("stopping after step %d: %s", step, self.stop_reason)
                break
        return self.last_metrics

    def start(self) -> None:
        """Called once, after a resumed run's state is restored and before the first step."""

    def step_data(self, step: int) -> Any:
        """What ``step`` trains on: the next batch of the dataloader (async GRPO: rollouts)."""
        return self.train_loader.next_batch()

    def step(self, batch: Any) -> dict[str, float]:
        raise NotImplementedError

    def validate(self, step: int) -> dict[str, float]:
        """Validation metrics with the weights after ``step`` (0: before training)."""
        raise NotImplementedError

    def validation_due(self, step: int) -> bool:
        period = int(self.cfg["val_period"])
        at_end = step == self.max_steps and bool(self.cfg.get("val_at_end"))
        started = step >= int(self.cfg.get("val_start_at", -1))  # NeMo RL's GRPO: periodic validation from then on
        return bool(self.val_data) and ((period > 0 and step % period == 0 and started) or at_end)

    # ------------------------------------------------------------------ checkpoints

    def dataloader_state(self) -> dict[str, Any]:
        """Where the data resumes after the step being saved."""
        return self.train_loader.state_dict()

    def extra_state(self) -> dict[str, Any]:
        """Driver state a subclass adds to ``training_info.json``."""
        return {}

    def restore_extra_state(self, info: Mapping[str, Any]) -> None:
        """Inverse of :meth:`extra_state`."""

    def trained_models(self) -> dict[str, Policy]:
        """Every model the run trains, by the checkpoint directory it is saved in: the policy, and
        a subclass's others (PPO's critic under ``value``), saved and restored together (the
        policy alone is exported)."""
        return {"policy": self.policy}

    def on_devices(self, name: str) -> AbstractContextManager[Any]:
        """Where ``trained_models()[name]`` is saved or restored: on its devices (a subclass whose
        models take turns there brings the one named onto them)."""
        return nullcontext()

    def save_checkpoint(self, step: int, metrics: Mapping[str, float]) -> None:
        tmp = self.checkpoints.prepare(step)
        models = self.trained_models()
        for name, model in models.items():
            with self.on_devices(name):
                model.save_checkpoint(str(tmp / name))
        info = {
            "metrics": {key.replace("/", "_"): value for key, value in metrics.items()},  # val/reward -> val_reward
            "algorithm": self.algorithm_name,
            "dataloader": self.dataloader_state(),
            "config": dict(self.config),
            "plugins": self.runtime.plugins.versions(),
            **self.extra_state(),
        }
        pending = [model for model in models.values() if model.checkpoint_options.async_save]

        def saved() -> None:
            for model in pending:
                model.finalize_checkpoint()

        self.checkpoints.commit(step, tmp, info, wait=saved if pending else None)

    def checkpoint_published(self, step: int, path: Path, info: Mapping[str, Any]) -> None:
        self.hooks.checkpoint_saved(self.info, step, str(path), dict(info.get("metrics", {})))

    def restore(self, path: Path) -> None:
        for name, model in self.trained_models().items():
            with self.on_devices(name):
                model.load_checkpoint(str(path / name))
        self.train_loader.load_state_dict(self.state.dataloader)
        self.restore_extra_state(self.checkpoints.load_info(path))

    # ------------------------------------------------------------------ the end

    def close(self, status: str = "completed") -> dict[str, str]:
        """Finish pending saves, export the best checkpoint, tell ``nrl_run_end`` how the run ended
        (``status``), stop workers; returns where outputs are.

        After the local Ray lost its GCS nothing of that is possible (every step would wait on the
        dead GCS): the cluster's processes are killed and the pending save stays unpublished; so
        after the watchdog fired (its workers are killed)."""
        if cluster_failure() is not None or fired() is not None:
            shutdown_ray()
            self.hooks.run_end(self.info, "failed", self.state.step, self.last_metrics, {})
            return {}
        outputs: dict[str, str] = {}
        try:
            self.checkpoints.close()
            for model in self.trained_models().values():
                model.finalize_checkpoint()
            plot = self.log.close()
            outputs["metrics"] = str(self.log.metrics_path)
            if plot is not None:
                outputs["plot"] = str(plot)
            if self.checkpoints.enabled:
                outputs["checkpoints"] = str(self.checkpoints.root)
                best = self.checkpoints.first_verified(self.checkpoints.preference())
                if best is not None and self.config["checkpointing"]["export_hf"]:
                    self.policy.load_checkpoint(str(best / "policy"))
                    export = self.checkpoints.export(lambda tmp: self.policy.export_hf(str(tmp)))
                    outputs["hf_export"] = f"{export} (from {best.name})"
            self.hooks.run_end(self.info, status, self.state.step, self.last_metrics, outputs)
        finally:
            self.shutdown()
        for what, where in outputs.items():
            logger.info("%s: %s", what, where)
        return outputs

    def shutdown(self) -> None:
        self.policy.shutdown()

    @classmethod
    def main(cls, config: Mapping[str, Any], runtime: Runtime | None = None) -> int:
        """``nrl train <section>``: build, run every step, close (even after an error), every phase
        under the run's watchdog (docs/watchdog.md). ``runtime`` reaches the run when its class
        takes one."""
        with Watchdog.for_run(config):
            with phase("start_up"):
                run = cls(config) if runtime is None else call_with_runtime(cls, config, runtime)
            status = "failed"
            try:
                final = run.run()
                status = "completed" if run.stop_reason is None else "stopped"
            finally:
                run.close(status)
        logger.info("%s finished: %s", cls.section.upper(),
                    {k: round(v, 4) for k, v in final.items() if k.startswith(cls.summary_prefixes)})
        return 0
