"""What every algorithm builds before its loop: Ray, the policy and generation workers, data,
environment, logger and checkpoints, and, when a complete checkpoint exists, the resumed state."""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nrl_core.algorithms.guarded_env import GuardedEnvironment
from nrl_core.algorithms.guarded_loss import GuardedLoss
from nrl_core.checkpoint.manager import CheckpointManager
from nrl_core.cluster import init_ray
from nrl_core.config.core_schema import DEFAULT_ENV_CALL_TIMEOUT_S
from nrl_core.contracts import Environment, GenerationBackendSpec, LossFunction, import_object
from nrl_core.plugin_faults import call_plugin
from nrl_core.plugins import get_plugin_manager
from nrl_core.timeline import mark
from nrl_core.watchdog import phase as watched

logger = logging.getLogger(__name__)


class PhaseTimer:
    """Wall-clock seconds per named phase of one step (``timing/<phase>`` metrics); each phase also
    runs under the run's watchdog and goes into its trace (:func:`nrl_core.watchdog.phase`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with watched(phase):
                yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{k}": v for k, v in self.seconds.items()}


def load_tokenizer(config: Mapping[str, Any]) -> Any:
    from transformers import AutoTokenizer

    from nrl_core.errors import NrlError

    name = config["policy"]["tokenizer"]["name"]
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=config["policy"]["trust_remote_code"])
    except (OSError, ValueError) as exc:
        raise NrlError(f"policy.tokenizer.name: cannot load a tokenizer from '{name}' "
                       f"({type(exc).__name__}); point it at a local Hugging Face model directory") from None
    if config["policy"]["tokenizer"].get("chat_template"):
        tokenizer.chat_template = config["policy"]["tokenizer"]["chat_template"]
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_loss(config: Mapping[str, Any], *, force_on_policy_ratio: bool) -> LossFunction:
    """The loss ``loss_fn.name`` selects, built from its section. ``force_on_policy_ratio`` says the
    algorithm takes one optimizer step per batch of rollouts, so the ratio's old logprobs are the
    training forward's own."""
    registry, name = get_plugin_manager().loss_functions(), config["loss_fn"]["name"]
    spec = registry.get(name, "loss_fn.name")
    logger.info("loss: %s, from %s", spec.name, spec.distribution)
    owner, log_dir = registry.plugin_owner(name), (config.get("logger") or {}).get("log_dir")
    loss_class = import_object(spec.loss)
    section = {**config["loss_fn"], "force_on_policy_ratio": force_on_policy_ratio}
    return GuardedLoss(call_plugin(owner, f"{loss_class.__name__}.from_config", log_dir, loss_class.from_config, section),
                       owner, log_dir)


def generation_spec(config: Mapping[str, Any]) -> GenerationBackendSpec:
    """The installed generation backend ``policy.generation.backend`` names."""
    backend = config["policy"]["generation"]["backend"]
    return get_plugin_manager().generation_backends().get(backend, "policy.generation.backend")


def build_environment(config: Mapping[str, Any]) -> Environment:
    name = config["data"]["env_name"]
    registry = get_plugin_manager().environments()
    spec = registry.get(name, "data.env_name")
    section = (config.get("env") or {}).get(name)
    if section is None:
        section = spec.config_schema.validate({}, f"env.{name}")
    init_ray(config.get("cluster"))  # before the environment's workers, so they start on the configured cluster
    mark("environment_build_start", env=name)
    owner, log_dir = registry.plugin_owner(name), (config.get("logger") or {}).get("log_dir")
    environment_class = import_object(spec.environment)
    call_timeout_s = float(section.get("call_timeout_s", DEFAULT_ENV_CALL_TIMEOUT_S))
    if "call_timeout_s" not in spec.config_schema.fields:  # the core's key, not the plugin's to read
        section = {key: value for key, value in section.items() if key != "call_timeout_s"}
    environment = call_plugin(owner, f"{environment_class.__name__}.__init__", log_dir, environment_class, section)
    mark("environment_built", env=name)
    return GuardedEnvironment(environment, owner, log_dir, call_timeout_s=call_timeout_s)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


@dataclass
class RunState:
    """Where the driver's loop stands: the last completed step and the dataloader position."""

    step: int = 0
    dataloader: dict[str, Any] = field(default_factory=dict)


def resume_point(checkpoints: CheckpointManager) -> tuple[Path | None, RunState]:
    """The latest complete checkpoint whose files verify and the driver state saved in it (or a
    fresh state); a corrupted one is skipped with a warning."""
    latest = checkpoints.latest_verified() if checkpoints.enabled else None
    if latest is None:
        return None, RunState()
    info = checkpoints.load_info(latest)
    state = RunState(step=int(info["step"]), dataloader=info.get("dataloader", {}))
    logger.info("resuming from %s (step %d)", latest, state.step)
    return latest, state
