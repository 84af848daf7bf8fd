"""An algorithm's environment starts its workers on the cluster the config describes.

GRPO builds its environment before the policy; the math environment's verifier actors need Ray,
and a Ray started there without ``config["cluster"]`` ignored ``cluster.num_cpus``,
``cluster.env_vars`` and ``cluster.ray_address`` for the whole run.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("nrl_env_math")

pytestmark = pytest.mark.slow


def test_build_environment_starts_ray_from_the_cluster_section() -> None:
    from nrl_core.algorithms.setup import build_environment
    from nrl_core.cluster import shutdown_ray

    shutdown_ray()  # this test owns its Ray: the cluster section must be what starts it
    try:
        env = build_environment({"data": {"env_name": "math"}, "env": {"math": {"num_workers": 1}},
                                 "cluster": {"num_cpus": 3}})
        try:
            assert ray.cluster_resources()["CPU"] == 3
        finally:
            env.shutdown()
    finally:
        shutdown_ray()
