"""Every nrl error class survives pickling (the trip from a Ray worker) and the CLI's exit codes."""

from __future__ import annotations

import pickle

import pytest
from ray import cloudpickle

from nrl_core.errors import NrlError
from nrl_core.testing.errors import example_error, nrl_error_classes

CLASSES = nrl_error_classes()


def test_discovery_finds_the_core_and_plugin_errors() -> None:
    names = {cls.__name__ for cls in CLASSES}
    assert {"NrlError", "ConfigError", "PluginError", "WorkerError", "WorkerRaisedError", "WorkerDiedError",
            "WorkerTimeoutError", "RefitError"} <= names, names


@pytest.mark.parametrize("dumps, loads", [(pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)],
                         ids=["pickle", "cloudpickle"])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: f"{cls.__module__}.{cls.__name__}")
def test_every_error_class_round_trips(cls, dumps, loads) -> None:
    original = example_error(cls)
    original.add_note("a note")
    copy = loads(dumps(original))
    assert type(copy) is cls
    assert str(copy) == str(original) and copy.args == original.args
    assert copy.__dict__ == original.__dict__  # attributes (key_path, missing, ...) and notes


def test_a_subclass_with_keyword_only_arguments_round_trips() -> None:
    class Odd(NrlError):
        def __init__(self, *, where: str, count: int) -> None:
            self.where, self.count = where, count
            super().__init__(f"{where}: {count} problems")

    # a local class pickles by value with cloudpickle, as Ray does for classes defined in scripts
    copy = cloudpickle.loads(cloudpickle.dumps(Odd(where="data.train_data_path", count=3)))
    assert str(copy) == "data.train_data_path: 3 problems" and (copy.where, copy.count) == ("data.train_data_path", 3)
