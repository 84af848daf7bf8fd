"""A third-party advantage estimator, installed as its own distribution (tests/plugins/dists/
nrl_scaled_advantage: GRPO's advantages times ``grpo.adv_estimator.advantage_scale``), changes
training as its formula says.

With the scale at -1 every advantage is negated. The first optimizer step's update is then
exactly the negation of the core estimator's. Three things make that exact:
- the seeded rollouts are the same in both runs;
- there is no KL term and the ratio is forced to 1, so the gradient is linear in the advantages;
- Adam's first step is odd in the gradient (m / sqrt(v) = g / |g|), with weight decay 0 and a
  norm clip that is the same for +g and -g.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.test_grpo import assert_ok, metrics, nrl_train

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DIST = REPO / "tests" / "plugins" / "dists" / "nrl_scaled_advantage"
# A lenient verifier (the answer's first digit anywhere in the response): the untrained model's
# responses then get different rewards within a group, so the step has a gradient.
ONE_STEP = ["grpo.max_num_steps=1", "grpo.val_at_start=false", "grpo.val_period=0", "grpo.val_at_end=false",
            "checkpointing.save_period=1", "checkpointing.export_hf=true", "checkpointing.metric_name=null",
            "loss_fn.reference_policy_kl_penalty=0.0", "loss_fn.force_on_policy_ratio=true",
            "policy.optimizer.kwargs.weight_decay=0.0", "grpo.num_prompts_per_step=8",
            "grpo.num_generations_per_prompt=8", "policy.train_global_batch_size=64",
            "++env.math.verifier=tests.plugins.math_verifiers:mentions_the_answer_s_first_digit"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("estimator-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(DIST)], check=True, capture_output=True, text=True)
    return target


def weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_a_third_party_estimator_negates_the_first_update(model, site, tmp_path):
    # the plugin's site, and the repository for the verifier the environment's workers import
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])}
    runs = {}
    for name, estimator in {"core": ["grpo.adv_estimator.name=grpo"],
                            "plugin": ["grpo.adv_estimator.name=scaled_grpo",
                                       "++grpo.adv_estimator.advantage_scale=-1.0"]}.items():
        tmp = tmp_path / name
        tmp.mkdir()
        assert_ok(nrl_train(tmp, model, *ONE_STEP, *estimator, env=env))
        runs[name] = tmp
    core, plugin = (metrics(runs[n])[-1] for n in ("core", "plugin"))
    assert plugin["train/reward"] == core["train/reward"]  # the same rollouts
    assert plugin["train/pg_loss"] == pytest.approx(-core["train/pg_loss"], abs=1e-6)
    for key in ("token_mult_prob_error", "gen_kl_error", "policy_kl_error", "js_divergence_error",
                "sampling_importance_ratio", "approx_entropy", "num_valid_samples"):  # NeMo RL's mismatch metrics
        assert f"train/{key}" in core
    initial = weights(Path(model))
    core_w, plugin_w = (weights(runs[n] / "ckpt" / "hf_export") for n in ("core", "plugin"))
    moved = 0.0
    for key, w0 in initial.items():
        up_core, up_plugin = core_w[key] - w0, plugin_w[key] - w0
        torch.testing.assert_close(up_plugin, -up_core, rtol=0, atol=1e-6, msg=f"{key}: not the negated update")
        moved = max(moved, float(up_core.abs().max()))
    assert moved > 1e-5, "the core run did not move the weights: no group's rewards differed"
