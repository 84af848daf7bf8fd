"""A training backend written to nrl's first plugin contract (as ``nrl_core/contracts.py`` stood
before f86aa56): the example plugin as it was when the conformance kit was first written, less
what contract 2 added. Its worker has no ``offload_before_refit``/``offload_after_refit``/
``prepare_for_training`` and ``get_logprobs`` returns the whole batch's ``[B, T]`` tensor. This
module sets no ``NRL_CONTRACT``, so the core takes it as written for contract 1 and adapts it
(tests/plugins/test_contract_versions.py, tests/e2e/test_first_contract_plugin.py).
"""

from nrl_core import hookimpl
from nrl_core.checkpoint.hooks import worker_checkpoint_hooks
from nrl_core.contracts import TrainingBackendSpec
from nrl_core.schema import Field, Section

WORKER_PATH = "nrl_first_contract_plugin.worker:FirstContractWorker"


@hookimpl
def nrl_training_backends():
    schema = Section(fields={
        "enabled": Field(type=bool, default=False),
        "async_save": Field(type=bool, default=False),
        "load_rng": Field(type=bool, default=False),
    })
    return [TrainingBackendSpec(name="first_contract", config_key="first_contract_cfg", priority=4, worker=WORKER_PATH,
                                config_schema=schema, distribution="nrl-first-contract-plugin",
                                description="single-process PyTorch, written to the first contract")]


nrl_checkpoint_save, nrl_checkpoint_load = worker_checkpoint_hooks(WORKER_PATH)
