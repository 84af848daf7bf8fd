"""Choosing the training backend by ``enabled`` flags and priority, and the generation backend."""

from __future__ import annotations

import logging

import pytest

from nrl_core.config import choose_backends, load_and_validate
from nrl_core.errors import ConfigError
from nrl_core.plugins import reset_plugin_manager


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
