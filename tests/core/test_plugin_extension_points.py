"""Third-party refit transports, metric sinks, data processors and dataset generators plug in
through their hooks like any plugin, and the core's own built-ins register through the same hooks."""

from __future__ import annotations

import json

import torch

from nrl_core import hookimpl
from nrl_core.algorithms.installed import load_and_validate
from nrl_core.algorithms.refit_orchestrator import choose_transport, refit
from nrl_core.contracts import DataProcessorSpec, DatasetGeneratorSpec, MetricSinkSpec, RefitTransportSpec
from nrl_core.data import DatumSpec, load_data_splits
from nrl_core.logging import MetricLogger
from nrl_core.plugins import get_plugin_manager
from nrl_core.refit.plan import RefitPlan
from nrl_core.testing.refit_host import RandomWeightSource, RecordingSink

RECORDED: list[tuple[int, dict]] = []


class CopyingTransport:
    """Clones every tensor on the way: a different transport, visible in the sink's storage."""

    name = "copying"

    def prepare(self, session):
        return session

    def sender(self, session):
        return self

    def receiver(self, session):
        return self

    def send(self, bucket):
        return [(name, tensor.clone()) for name, tensor in bucket]

    def buckets(self, handles):
        return iter(handles)

    def close(self):
        pass

    def cleanup(self, session):
        pass


class RecordingSinkPlugin:
    def __init__(self, log_dir, options):
        self.options = dict(options)

    def log(self, step, metrics, prefix=""):
        RECORDED.append((step, {**dict(metrics), "options": self.options}))

    def close(self):
        RECORDED.append((-1, {}))


class ExtensionPlugin:
    @hookimpl
    def nrl_refit_transports(self):
        return [RefitTransportSpec(name="copying", transport=f"{__name__}:CopyingTransport",
                                   placements=("same_process",), distribution="nrl-test"),
                # a GPU-only transport (say, CUDA IPC) that outranks the core's between GPUs on a node
                RefitTransportSpec(name="gpu_direct", transport=f"{__name__}:CopyingTransport",
                                   placements=("same_node",), devices=("cuda",), priority=25,
                                   distribution="nrl-test")]

    @hookimpl
    def nrl_metric_sinks(self):
        return [MetricSinkSpec(name="recorder", sink=f"{__name__}:RecordingSinkPlugin", distribution="nrl-test")]


def test_third_party_transport_is_chosen_by_name_and_moves_the_weights():
    with get_plugin_manager().registered(ExtensionPlugin(), name="extension"):
        assert choose_transport("same_process", "copying").name == "copying"
        assert choose_transport("same_process").name == "in_process"  # the core's stays the default
        assert choose_transport("same_node", device="cuda").name == "gpu_direct"
        assert choose_transport("same_node", device="cpu").name == "shared_memory"
        source = RandomWeightSource({"a.weight": (4, 3), "b.bias": (5,)})
        sink = RecordingSink()
        report = refit(source, sink, RefitPlan(transport="copying", bucket_bytes=64))
    assert report.transport == "copying" and sink.weight_version == 1
    for name, tensor in source.tensors.items():
        assert torch.equal(sink.received[name], tensor)
        assert sink.received[name].data_ptr() != tensor.data_ptr()  # it really went through the copy


def test_third_party_metric_sink_gets_its_config_section(tmp_path):
    config_file = tmp_path / "c.yaml"
    config_file.write_text(f"policy: {{model_name: /m, generation: null}}\n"
                           f"logger: {{log_dir: {tmp_path / 'logs'}, console: false, recorder_enabled: true, "
                           f"recorder: {{project: demo}}}}\n")
    RECORDED.clear()
    with get_plugin_manager().registered(ExtensionPlugin(), name="extension"):
        section = load_and_validate(str(config_file))["logger"]
        metric_logger = MetricLogger(section, plugins=get_plugin_manager(), total_steps=1)
        metric_logger.log_step(1, {"train/loss": 0.5})
        metric_logger.close()
    assert RECORDED == [(1, {"train/loss": 0.5, "options": {"project": "demo"}}), (-1, {})]
    assert json.loads((tmp_path / "logs" / "metrics.jsonl").read_text()) == {"step": 1, "train/loss": 0.5}


def countdown(start: int = 5) -> tuple[list[dict], list[dict]]:
    """A third-party generator: ``data.generate`` arrives as keyword arguments."""
    return [{"problem": f"count down from {n}", "expected_answer": str(n - 1)} for n in range(start, 0, -1)], []


def shouting(record, idx, tokenizer, cfg) -> DatumSpec:
    text = str(record[cfg.input_key]).upper()
    return DatumSpec(idx=idx, prompt_text=text, prompt_ids=[len(text)], metadata={"answer": record[cfg.output_key]})


class DataPlugin:
    @hookimpl
    def nrl_dataset_generators(self):
        return [DatasetGeneratorSpec(name="countdown", generator=f"{__name__}:countdown", distribution="nrl-test")]

    @hookimpl
    def nrl_data_processors(self):
        return [DataProcessorSpec(name="shouting", processor=f"{__name__}:shouting", distribution="nrl-test")]


def test_third_party_generator_and_processor_are_selected_by_name():
    from nrl_core.data.processors import get_processor

    with get_plugin_manager().registered(DataPlugin(), name="data-plugin"):
        splits = load_data_splits({"dataset_name": "countdown", "generate": {"start": 3}}, get_plugin_manager())
        assert [r["expected_answer"] for r in splits.train] == ["2", "1", "0"]
        datum = get_processor("shouting", get_plugin_manager())(splits.train[0], 0, None, _PromptConfig())
    assert datum.prompt_text == "COUNT DOWN FROM 3" and datum.metadata == {"answer": "2"}


def test_the_core_registers_its_built_ins_through_the_hooks():
    pm = get_plugin_manager()
    assert {"tensorboard", "wandb", "mlflow"} <= set(pm.metric_sinks().names())
    assert pm.metric_sinks().owner("tensorboard") == "nrl_core.builtin"
    assert {"math", "sft"} <= set(pm.data_processors().names())
    assert pm.dataset_generators().owner("arithmetic") == "nrl_core.builtin"


class _PromptConfig:
    input_key, output_key = "problem", "expected_answer"
