"""``policy.precision`` defaults to null: bf16 on a bf16-capable GPU, float32 here, resolved by
``nrl_core.device.resolve_precision`` in every process that reads it (workers, refit endpoints),
never on a driver that may have no GPU. An explicit value is kept, and a bad one is still one line."""

from __future__ import annotations

import pytest
import torch

from nrl_core.algorithms.installed import validate_config
from nrl_core.algorithms.refit_orchestrator import refit
from nrl_core.config.loader import load_config
from nrl_core.errors import ConfigError
from nrl_core.refit.buckets import parse_dtype, refit_dtype
from nrl_core.refit.plan import RefitPlan
from nrl_core.testing.refit_host import RandomWeightSource, RecordingSink

from .conftest import VALID


def _config(tmp_path, *overrides: str) -> dict:
    path = tmp_path / "c.yaml"
    path.write_text(VALID)
    return validate_config(load_config(str(path), list(overrides)), backend_checks=False)


pytestmark = pytest.mark.usefixtures("example_backends")


def test_unset_precision_validates_to_null_and_resolves_to_float32_without_a_gpu(tmp_path) -> None:
    config = _config(tmp_path)
    assert config["policy"]["precision"] is None
    assert parse_dtype(config["policy"]["precision"]) == torch.float32
    assert refit_dtype(None) == "float32" and RefitPlan.for_run(config).dtype is None


def test_an_explicit_precision_is_kept_and_a_bad_one_is_one_line(tmp_path) -> None:
    config = _config(tmp_path, "policy.precision=bfloat16")
    assert config["policy"]["precision"] == "bfloat16" and RefitPlan.for_run(config).dtype == "bfloat16"
    assert parse_dtype(config["policy"]["precision"]) == torch.bfloat16
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, "policy.precision=fp64")
    assert info.value.key_path == "policy.precision"


def test_a_refit_with_a_null_dtype_moves_the_weights_in_the_owners_precision() -> None:
    source, sink = RandomWeightSource({"a": (3, 4), "b": (5,)}), RecordingSink()
    report = refit(source, sink, RefitPlan(dtype=None))
    assert report.version == 1 and {t.dtype for t in sink.received.values()} == {torch.float32}
    assert sink.checksums() == source.checksums()
