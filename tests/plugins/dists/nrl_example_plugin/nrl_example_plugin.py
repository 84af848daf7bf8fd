"""A third-party plugin: one training backend section and one algorithm, found through the
``nrl`` entry-point group exactly like nrl's own plugins."""

from nrl_core import hookimpl
from nrl_core.config.schema import Field, Section
from nrl_core.contracts import AlgorithmSpec, TrainingBackendSpec


@hookimpl
def nrl_training_backends():
    schema = Section(fields={"enabled": Field(type=bool, default=False), "shards": Field(type=int, default=1)})
    return [TrainingBackendSpec(name="example", config_key="example_cfg", priority=5,
                                worker="nrl_example_plugin:ExampleWorker", config_schema=schema,
                                distribution="nrl-example-plugin", parallel_size_keys=("shards",))]


@hookimpl
def nrl_algorithms():
    schema = Section(fields={"greeting": Field(type=str, default="hello"), "times": Field(type=int, default=1, minimum=1)})
    return [AlgorithmSpec(name="hello", entry="nrl_example_plugin:hello", distribution="nrl-example-plugin",
                          config_schema=schema)]


def hello(config):
    for _ in range(config["hello"]["times"]):
        print(f"{config['hello']['greeting']} from the example plugin: model {config['policy']['model_name']}")
    return 0


class ExampleWorker:
    def __init__(self, config, rank, world_size):
        self.rank = rank
