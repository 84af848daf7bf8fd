"""Two training backends written for contract 3 that break it, so ``nrl config check`` and the
conformance kit must each name the gap in one line: ``lacking``'s worker has no ``export_hf``;
``wrongtype``'s ``get_logprobs`` returns a tensor where contract 2 and later require a
``BatchShard``. Nothing here is ever built: both are refused before a worker exists."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nrl_core import hookimpl
from nrl_core.contracts import TrainingBackendSpec
from nrl_core.schema import Field, Section

if TYPE_CHECKING:  # the annotation below is read as text, never evaluated
    import torch

NRL_CONTRACT = 3


class _Common:
    def __init__(self, config, rank=0, world_size=1):
        raise RuntimeError("never built: the contract check refuses this worker first")

    def train(self, batch, loss_fn): ...

    def get_reference_logprobs(self, batch): ...

    def offload_before_refit(self): ...

    def offload_after_refit(self): ...

    def prepare_for_training(self): ...

    def weight_manifest(self, dtype): ...

    def export_weights(self, bucket_bytes, dtype): ...

    def finalize_checkpoint(self): ...


class LackingWorker(_Common):
    def get_logprobs(self, batch): ...


class WrongTypeWorker(_Common):
    def get_logprobs(self, batch) -> torch.Tensor: ...

    def export_hf(self, path): ...


@hookimpl
def nrl_training_backends():
    schema = Section(fields={"enabled": Field(type=bool, default=False)})
    return [TrainingBackendSpec(name=name, config_key=f"{name}_cfg", priority=1, worker=f"nrl_contract_gaps_plugin:{cls}",
                                config_schema=schema, distribution="nrl-contract-gaps-plugin")
            for name, cls in (("lacking", "LackingWorker"), ("wrongtype", "WrongTypeWorker"))]
