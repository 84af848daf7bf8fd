"""Choosing the training backend by ``enabled`` flags and priority, and the generation backend."""

from __future__ import annotations

import logging

import pytest

from nrl_core import hookimpl
from nrl_core.algorithms.installed import choose_backends, load_and_validate
from nrl_core.cli import main
from nrl_core.contracts import GenerationBackendSpec, TrainingBackendSpec
from nrl_core.errors import ConfigError
from nrl_core.plugins import get_plugin_manager, reset_plugin_manager
from nrl_core.schema import Field, Section


def _config(write, alpha: bool, beta: bool, extra: str = ""):
    path = write("c.yaml", f"policy:\n  model_name: /m\n  alpha_cfg: {{enabled: {str(alpha).lower()}}}\n"
                           f"  beta_cfg: {{enabled: {str(beta).lower()}}}\n  generation: {{backend: gamma}}\n{extra}")
    return load_and_validate(path)


def test_both_enabled_picks_higher_priority_and_warns(write, example_backends, caplog):
    with caplog.at_level(logging.WARNING):
        choice = choose_backends(_config(write, alpha=True, beta=True))
    assert choice.training.name == "beta" and choice.overridden == ("alpha",)
    assert "using 'beta' (highest priority), not 'alpha'" in caplog.text


def test_one_enabled_is_chosen_silently(write, example_backends, caplog):
    with caplog.at_level(logging.WARNING):
        choice = choose_backends(_config(write, alpha=True, beta=False))
    assert choice.training.name == "alpha" and choice.overridden == ()
    assert choice.generation is not None and choice.generation.name == "gamma"
    assert "priority" not in caplog.text


def test_none_enabled_names_the_keys_to_set(write, example_backends):
    with pytest.raises(ConfigError, match=r"policy: no training backend is enabled; set policy.alpha_cfg.enabled=true "
                                          r"or policy.beta_cfg.enabled=true"):
        choose_backends(_config(write, alpha=False, beta=False))


@pytest.fixture
def without_first_party_plugins(monkeypatch):
    """A fresh plugin manager that skips the first-party entry points, as if uninstalled."""
    monkeypatch.setenv("NRL_BLOCKED_PLUGINS", "megatron,dtensor,vllm,math")
    reset_plugin_manager()
    yield
    monkeypatch.delenv("NRL_BLOCKED_PLUGINS")
    reset_plugin_manager()


def test_enabled_section_of_an_uninstalled_first_party_backend(write, without_first_party_plugins):
    path = write("c.yaml", "policy: {model_name: /m, megatron_cfg: {enabled: true}, generation: null}\n")
    with pytest.raises(ConfigError, match="policy.megatron_cfg.enabled: is true but the megatron backend is not "
                                          "installed; pip install nrl-backend-megatron"):
        load_and_validate(path)


def test_no_backend_installed_says_what_to_install(write, without_first_party_plugins):
    path = write("c.yaml", "policy: {model_name: /m, dtensor_cfg: {enabled: false}, generation: null}\n")
    with pytest.raises(ConfigError, match="policy: no training backend is installed; pip install nrl-backend-dtensor"):
        choose_backends(load_and_validate(path))


def test_generation_null_means_no_generation_backend(write, example_backends):
    path = write("c.yaml", "policy: {model_name: /m, alpha_cfg: {enabled: true}, generation: null}\n")
    assert choose_backends(load_and_validate(path)).generation is None



CHECKED: list[str] = []


def refuse_tensor_parallel_3(config) -> None:
    """A backend's ``config_check``: refuses what only it can judge, after the schema passed."""
    CHECKED.append("training")
    if config["policy"]["beta_cfg"]["tensor_parallel_size"] == 3:
        raise ConfigError("policy.beta_cfg.tensor_parallel_size", "3 is not supported by beta")


def record_generation_check(config) -> None:
    CHECKED.append("generation")


class CheckedBackends:
    """``beta`` and ``gamma`` with config checks, ``alpha`` without."""

    @hookimpl
    def nrl_training_backends(self):
        schema = Section(fields={"enabled": Field(type=bool, default=False),
                                 "tensor_parallel_size": Field(type=int, default=1, minimum=1)})
        common = dict(worker="tests.core:Nothing", config_schema=schema, parallel_size_keys=("tensor_parallel_size",),
                      capabilities=frozenset({"data_parallel"}))
        return [TrainingBackendSpec(name="alpha", config_key="alpha_cfg", priority=10, distribution="nrl-alpha", **common),
                TrainingBackendSpec(name="beta", config_key="beta_cfg", priority=20, distribution="nrl-beta",
                                    config_check=f"{__name__}:refuse_tensor_parallel_3", **common)]

    @hookimpl
    def nrl_generation_backends(self):
        return [GenerationBackendSpec(name="gamma", config_key="gamma_cfg", worker="tests.core:Nothing",
                                      config_schema=Section(), distribution="nrl-gamma",
                                      config_check=f"{__name__}:record_generation_check")]


@pytest.mark.parametrize("overrides, code, checked", [
    ([], 2, ["training"]),  # the first refusal ends the check
    (["beta_cfg.enabled=false"], 0, ["generation"]),  # alpha is selected; it has no check of its own
    (["beta_cfg.tensor_parallel_size=1"], 0, ["training", "generation"]),
    (["beta_cfg.tensor_parallel_size=1", "--algorithm", "sft"], 0, ["training"]),  # SFT does not generate
])
def test_the_selected_backends_config_checks_run(write, without_first_party_plugins, capsys, overrides, code, checked):
    path = write("c.yaml", "policy: {model_name: /m, train_global_batch_size: 6, train_micro_batch_size: 2, "
                           "alpha_cfg: {enabled: true}, beta_cfg: {enabled: true, "
                           "tensor_parallel_size: 3}, generation: {backend: gamma}}\ncluster: {gpus_per_node: 3}\n")
    CHECKED.clear()
    args = [f"policy.{o}" if "=" in o else o for o in overrides]
    with get_plugin_manager().registered(CheckedBackends(), name="checked"):
        assert main(["config", "check", str(path), *args]) == code
    if code:
        assert "error: policy.beta_cfg.tensor_parallel_size: 3 is not supported by beta" in capsys.readouterr().err
    assert CHECKED == checked


def test_a_schema_error_comes_before_any_backend_check(write, without_first_party_plugins):
    path = write("c.yaml", "policy: {model_name: /m, beta_cfg: {enabled: true, tensor_parallel_size: 0}, "
                           "generation: null}\n")
    CHECKED.clear()
    with get_plugin_manager().registered(CheckedBackends(), name="checked"):
        with pytest.raises(ConfigError, match=r"^policy.beta_cfg.tensor_parallel_size: must be positive"):
            load_and_validate(path)
    assert CHECKED == []


def test_a_feature_the_backend_does_not_declare_is_refused_in_one_line(write, example_backends):
    """alpha declares data parallelism only: packing would be silently ignored, so it is refused."""
    path = write("c.yaml", """\
        policy: {model_name: /m, alpha_cfg: {enabled: true}, generation: null, sequence_packing: {enabled: true}}
        """)
    with pytest.raises(ConfigError, match=r"^policy.sequence_packing.enabled: the alpha training backend \(nrl-alpha\) "
                                          r"does not support sequence packing"):
        load_and_validate(path, algorithm="sft")


def test_save_optimizer_false_needs_the_capability(write, example_backends, tmp_path, capsys):
    """A backend that does not declare skip_optimizer_state would save the optimizer anyway (it
    never reads CheckpointOptions.save_optimizer): ``nrl config check`` refuses in one line."""
    path = write("c.yaml", f"""\
        policy: {{model_name: /m, alpha_cfg: {{enabled: true}}, generation: null}}
        checkpointing: {{enabled: true, checkpoint_dir: {tmp_path / 'ck'}, save_optimizer: false}}
        """)
    assert main(["config", "check", str(path), "--algorithm", "sft"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == ["error: checkpointing.save_optimizer: the alpha training backend (nrl-alpha) does not declare "
                      "skip_optimizer_state, so it would save the optimizer anyway; set it to true or use a backend "
                      "that declares it"]
    assert load_and_validate(path, ["checkpointing.save_optimizer=true"], algorithm="sft")["checkpointing"][
        "save_optimizer"] is True
    assert load_and_validate(path, ["checkpointing.enabled=false"], algorithm="sft")  # nothing is saved


def test_an_unknown_capability_is_a_plugin_error():
    from nrl_core.contracts import TrainingBackendSpec
    from nrl_core.errors import PluginError
    from nrl_core.schema import Section

    with pytest.raises(PluginError, match="declares unknown capabilities \\['packing'\\]; known: data_parallel"):
        TrainingBackendSpec(name="x", config_key="x_cfg", priority=1, worker="m:W", config_schema=Section(),
                            distribution="nrl-x", capabilities=frozenset({"packing"}))
