"""Third-party refit transports and metric sinks plug in through their hooks like any plugin."""

from __future__ import annotations

import json

import torch

from nrl_core import hookimpl
from nrl_core.config import load_and_validate
from nrl_core.contracts import MetricSinkSpec, RefitTransportSpec
from nrl_core.logging import MetricLogger
from nrl_core.plugins import get_plugin_manager
from nrl_core.refit import refit
from nrl_core.refit.orchestrator import choose_transport
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
                                   placements=("same_process",), distribution="nrl-test")]

    @hookimpl
    def nrl_metric_sinks(self):
        return [MetricSinkSpec(name="recorder", sink=f"{__name__}:RecordingSinkPlugin", distribution="nrl-test")]


def test_third_party_transport_is_chosen_by_name_and_moves_the_weights():
    with get_plugin_manager().registered(ExtensionPlugin(), name="extension"):
        assert choose_transport("same_process", "copying") == "copying"
        assert choose_transport("same_process") == "in_process"  # the core's stays the default
        source = RandomWeightSource({"a.weight": (4, 3), "b.bias": (5,)})
        sink = RecordingSink()
        report = refit(source, sink, transport="copying", bucket_bytes=64)
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
        metric_logger = MetricLogger(section, total_steps=1)
        metric_logger.log_step(1, {"train/loss": 0.5})
        metric_logger.close()
    assert RECORDED == [(1, {"train/loss": 0.5, "options": {"project": "demo"}}), (-1, {})]
    assert json.loads((tmp_path / "logs" / "metrics.jsonl").read_text()) == {"step": 1, "train/loss": 0.5}
