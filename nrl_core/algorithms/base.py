"""What GRPO and SFT share: the policy workers, the prompt dataloader, checkpoints (save, resume,
HF export of the best) and the metric logger. Subclasses write ``step`` and ``validate``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

from nrl_core.algorithms.policy import Policy
from nrl_core.algorithms.setup import resume_point, seed_everything
from nrl_core.checkpoint.manager import CheckpointManager
from nrl_core.cluster import cluster_failure, init_ray, shutdown_ray
from nrl_core.config import choose_backends
from nrl_core.data import DatumSpec, PromptDataloader
from nrl_core.logging import MetricLogger
from nrl_core.plugins import get_plugin_manager

logger = logging.getLogger(__name__)


class AlgorithmRun:
    """One run of an algorithm: build, ``run()`` the step loop, ``close()``."""

    section: str  # the algorithm's config section ("grpo", "sft")
    summary_prefixes: tuple[str, ...] = ("val/",)  # metrics the final log line reports
    val_data: Sequence[DatumSpec] = ()

    def __init__(self, config: Mapping[str, Any], *, batch_size: int, train_data: Sequence[DatumSpec],
                 colocated_generation: bool = False, with_generation: bool = False) -> None:
        self.config = config
        self.cfg = config[self.section]
        seed_everything(self.cfg["seed"])
        self.choice = choose_backends(config, generation=with_generation)
        self.train_loader = PromptDataloader(train_data, batch_size, shuffle=config["data"]["shuffle"],
                                             seed=self.cfg["seed"])
        self.checkpoints = CheckpointManager(config["checkpointing"])
        self.resume_from, self.state = resume_point(self.checkpoints)
        init_ray(config["cluster"])
        self.policy = Policy(self.worker_config(config), self.choice.training, colocated_generation=colocated_generation)
        self.max_steps = min(int(self.cfg["max_num_steps"]), int(self.cfg["max_num_epochs"]) * len(self.train_loader))
        self.log = MetricLogger(config["logger"], total_steps=self.max_steps, resume=self.resume_from is not None)

    def worker_config(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        """The config the training workers get (DPO counts its batches in pairs, workers in sequences)."""
        return config

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict[str, float]:
        if self.resume_from is not None:
            self.restore(self.resume_from)
        self.start()
        last: dict[str, float] = {}
        if self.cfg["val_at_start"] and self.state.step == 0:
            last = self.validate(0)
            if last:
                self.log.log_step(0, last)
        for step in range(self.state.step + 1, self.max_steps + 1):
            metrics = self.step(self.step_data(step))
            if self.validation_due(step):
                metrics.update(self.validate(step))
            self.log.log_step(step, metrics)
            self.state.step = step
            if self.checkpoints.should_save(step, last_step=step == self.max_steps):
                self.save_checkpoint(step, metrics)
            last = metrics
        return last

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
        return bool(self.val_data) and ((period > 0 and step % period == 0) or at_end)

    # ------------------------------------------------------------------ checkpoints

    def dataloader_state(self) -> dict[str, Any]:
        """Where the data resumes after the step being saved."""
        return self.train_loader.state_dict()

    def extra_state(self) -> dict[str, Any]:
        """Driver state a subclass adds to ``training_info.json``."""
        return {}

    def restore_extra_state(self, info: Mapping[str, Any]) -> None:
        """Inverse of :meth:`extra_state`."""

    def save_checkpoint(self, step: int, metrics: Mapping[str, float]) -> None:
        tmp = self.checkpoints.prepare(step)
        self.policy.save_checkpoint(str(tmp / "policy"))
        info = {
            "metrics": {key.replace("/", "_"): value for key, value in metrics.items()},  # val/reward -> val_reward
            "dataloader": self.dataloader_state(),
            "config": dict(self.config),
            "plugins": get_plugin_manager().versions(),
            **self.extra_state(),
        }
        asynchronous = self.policy.checkpoint_options.async_save
        self.checkpoints.commit(step, tmp, info, wait=self.policy.finalize_checkpoint if asynchronous else None)

    def restore(self, path: Path) -> None:
        self.policy.load_checkpoint(str(path / "policy"))
        self.train_loader.load_state_dict(self.state.dataloader)
        self.restore_extra_state(self.checkpoints.load_info(path))

    # ------------------------------------------------------------------ the end

    def close(self) -> dict[str, str]:
        """Finish pending saves, export the best checkpoint, stop workers; returns where outputs are.

        After the local Ray lost its GCS nothing of that is possible (every step would wait on the
        dead GCS): the cluster's processes are killed and the pending save stays unpublished."""
        if cluster_failure() is not None:
            shutdown_ray()
            return {}
        outputs: dict[str, str] = {}
        try:
            self.checkpoints.close()
            self.policy.finalize_checkpoint()
            plot = self.log.close()
            outputs["metrics"] = str(self.log.metrics_path)
            if plot is not None:
                outputs["plot"] = str(plot)
            if self.checkpoints.enabled:
                outputs["checkpoints"] = str(self.checkpoints.root)
                best = self.checkpoints.best()
                if best is not None and self.config["checkpointing"]["export_hf"]:
                    export = self.checkpoints.root / "hf_export"
                    self.policy.load_checkpoint(str(best / "policy"))
                    self.policy.export_hf(str(export))
                    outputs["hf_export"] = f"{export} (from {best.name})"
        finally:
            self.shutdown()
        for what, where in outputs.items():
            logger.info("%s: %s", what, where)
        return outputs

    def shutdown(self) -> None:
        self.policy.shutdown()

    @classmethod
    def main(cls, config: Mapping[str, Any]) -> int:
        """``nrl train <section>``: build, run every step, close (even after an error)."""
        run = cls(config)
        try:
            final = run.run()
        finally:
            run.close()
        logger.info("%s finished: %s", cls.section.upper(),
                    {k: round(v, 4) for k, v in final.items() if k.startswith(cls.summary_prefixes)})
        return 0
