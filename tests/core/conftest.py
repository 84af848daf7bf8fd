"""Core tests register small backend descriptors in-process, so they pass with no plugin
distribution installed (the core must stay green when every plugin is uninstalled)."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nrl_core import hookimpl
from nrl_core.cluster import shutdown_ray
from nrl_core.contracts import GenerationBackendSpec, TrainingBackendSpec
from nrl_core.plugins import get_plugin_manager
from nrl_core.schema import Field, Section


class ExampleBackends:
    """Two training backends and one generation backend, named apart from the real ones."""

    @hookimpl
    def nrl_training_backends(self):
        schema = Section(fields={"enabled": Field(type=bool, default=False),
                                 "tensor_parallel_size": Field(type=int, default=1)})
        return [
            TrainingBackendSpec(name="alpha", config_key="alpha_cfg", priority=10, worker="tests.core:Nothing",
                                config_schema=schema, distribution="nrl-alpha", config_aliases={"alpha_config": "alpha_cfg"},
                                parallel_size_keys=("tensor_parallel_size",), capabilities=frozenset({"data_parallel"})),
            TrainingBackendSpec(name="beta", config_key="beta_cfg", priority=20, worker="tests.core:Nothing",
                                config_schema=schema, distribution="nrl-beta", parallel_size_keys=("tensor_parallel_size",),
                                capabilities=frozenset({"data_parallel"})),
        ]

    @hookimpl
    def nrl_generation_backends(self):
        schema = Section(fields={"engine_threads": Field(type=int, default=1)})
        return [GenerationBackendSpec(name="gamma", config_key="gamma_cfg", worker="tests.core:Nothing",
                                      config_schema=schema, distribution="nrl-gamma")]


@pytest.fixture
def example_backends():
    with get_plugin_manager().registered(ExampleBackends(), name="example-backends"):
        yield


@pytest.fixture
def write(tmp_path: Path) -> Callable[[str, str], Path]:
    """Write a dedented YAML file into the test's directory and return its path."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return _write


VALID = textwrap.dedent("""\
    policy:
      model_name: /models/tiny
      train_global_batch_size: 8
      train_micro_batch_size: 2
      alpha_cfg: {enabled: true}
      generation:
        backend: gamma
        max_new_tokens: 16
    grpo:
      num_prompts_per_step: 4
    """)


@pytest.fixture(scope="module")
def worker_path() -> Iterator[None]:
    """Actors import this directory's worker modules (``cluster_workers``, ``hang_workers``) through
    the PYTHONPATH init_ray forwards."""
    shutdown_ray()
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent)] + ([saved] if saved else []))
    try:
        yield
    finally:
        shutdown_ray()
        os.environ.pop("PYTHONPATH") if saved is None else os.environ.__setitem__("PYTHONPATH", saved)
