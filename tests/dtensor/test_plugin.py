"""Registration through the `nrl` entry-point group and the `policy.dtensor_config` schema."""

import pytest

from nrl_backend_dtensor import plugin
from nrl_backend_dtensor.schema import DTENSOR_CONFIG_SCHEMA
from nrl_core.contracts import CheckpointOptions
from nrl_core.errors import ConfigError
from nrl_core.plugins import get_plugin_manager
from nrl_core.schema import Section


def test_backend_is_registered_through_entry_points():
    spec = get_plugin_manager().training_backends().get("dtensor", "policy")
    assert (spec.config_key, spec.priority, spec.distribution) == ("dtensor_config", 10, "nrl-backend-dtensor")
    assert spec.config_aliases == {"dtensor_cfg": "dtensor_config"}
    assert spec.worker == "nrl_backend_dtensor.worker:DTensorPolicyWorker"


def test_schema_defaults_alias_and_inert_keys():
    policy = Section(fields={}).attach("", "dtensor_config", DTENSOR_CONFIG_SCHEMA,
                                       aliases={"dtensor_cfg": "dtensor_config"})
    out = policy.validate({"dtensor_cfg": {"enabled": True, "_v2": True, "env_vars": {"A": "1"}}}, "policy")
    cfg = out["dtensor_config"]
    assert cfg["enabled"] and cfg["tensor_parallel_size"] == 1 and cfg["fully_parallel_save"] is True
    assert CheckpointOptions.from_section(cfg) == CheckpointOptions()
    with pytest.raises(ConfigError, match="policy.dtensor_config.tensor_paralel_size: unknown key; did you mean"):
        policy.validate({"dtensor_config": {"tensor_paralel_size": 2}}, "policy")


def test_checkpoints_are_the_workers_own_methods_not_hooks():
    """The core calls save_checkpoint/load_checkpoint on the worker; the plugin answers no hook."""
    assert not hasattr(plugin, "nrl_checkpoint_save") and not hasattr(plugin, "nrl_checkpoint_load")
