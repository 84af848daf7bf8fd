"""A third-party nrl plugin: a minimal single-process PyTorch training backend (``example``) and
an algorithm (``nrl train hello``), found through the ``nrl`` entry-point group exactly like nrl's
own plugins. docs/plugins.md walks through it.

This module is what the entry point names, so it imports nothing heavy: the worker (torch,
transformers) is named by its import path and loaded only when a run builds it.
"""

from nrl_core.api import AlgorithmSpec, Field, Section, TrainingBackendSpec, hookimpl

WORKER_PATH = "nrl_example_plugin.worker:ExampleWorker"

NRL_CONTRACT = 14  # the plugin contract this module is written for (docs/plugins.md#8-contract-versions)


@hookimpl
def nrl_training_backends():
    schema = Section(fields={
        "enabled": Field(type=bool, default=False),
        # CheckpointOptions.from_section reads only the keys the schema declares
        "fully_parallel_save": Field(type=bool, default=True),
        "fully_parallel_load": Field(type=bool, default=True),
        "async_save": Field(type=bool, default=False),
        "load_rng": Field(type=bool, default=False),
    })
    return [TrainingBackendSpec(name="example", config_key="example_cfg", priority=5, worker=WORKER_PATH,
                                config_schema=schema, distribution="nrl-example-plugin",
                                capabilities=frozenset(),  # one rank, padded micro-batches only
                                description="single-process PyTorch (the plugin guide's example)")]


@hookimpl
def nrl_algorithms():
    schema = Section(fields={"greeting": Field(type=str, default="hello"), "times": Field(type=int, default=1, minimum=1)})
    return [AlgorithmSpec(name="hello", entry="nrl_example_plugin:hello", distribution="nrl-example-plugin",
                          config_schema=schema)]


def hello(config):
    """``nrl train hello``: an algorithm with its own config section (``hello.greeting``, ``hello.times``)."""
    for _ in range(config["hello"]["times"]):
        print(f"{config['hello']['greeting']} from the example plugin: model {config['policy']['model_name']}")
    return 0
