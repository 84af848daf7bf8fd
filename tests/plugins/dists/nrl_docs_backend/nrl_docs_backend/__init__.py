"""nrl plugin: the ``docs`` training backend (``policy.docs_cfg``), one process, plain PyTorch.

This module is what the ``nrl`` entry point names, so it stays light: it only describes the
backend; the worker (torch, transformers) is imported by the core when a run builds it.
"""

from __future__ import annotations

from nrl_core import hookimpl
from nrl_core.contracts import TrainingBackendSpec
from nrl_core.schema import Field, Section

WORKER_PATH = "nrl_docs_backend.worker:DocsWorker"

NRL_CONTRACT = 5  # the plugin contract this module is written for (docs/plugins.md#8-contract-versions)

SCHEMA = Section(doc="The docs backend: one process, plain PyTorch, any HF causal LM.", fields={
    "enabled": Field(type=bool, default=False),
    "fully_parallel_save": Field(type=bool, default=True, doc="one rank: the same single write either way"),
    "fully_parallel_load": Field(type=bool, default=True, doc="one rank: the same single read either way"),
    "async_save": Field(type=bool, default=False, doc="return once the write is scheduled"),
    "load_rng": Field(type=bool, default=False, doc="save and restore every RNG with the checkpoint"),
})


@hookimpl
def nrl_training_backends() -> list[TrainingBackendSpec]:
    return [TrainingBackendSpec(name="docs", config_key="docs_cfg", priority=3, worker=WORKER_PATH,
                                config_schema=SCHEMA, distribution="nrl-docs-backend",
                                config_check="nrl_docs_backend.checks:check_config",
                                capabilities=frozenset(),
                                description="single-process PyTorch backend written from the plugin guide")]

