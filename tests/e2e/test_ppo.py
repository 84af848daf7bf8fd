"""PPO with a value model through ``nrl train ppo`` as a user runs it (nrl-algo-ppo).

On the demo's arithmetic task, from the demo's SFT model (cached as the distillation tests build
it), PPO raises the expected reward on held-out problems, the probability the policy gives each
right answer (greedy accuracy would move by whole answers with the host's float path:
docs/testing.md), and a run resumed from its checkpoint (policy and critic)
continues bit-exactly. Scored by the tiny reward model instead (a reward the critic can learn to
predict from the text), the critic explains more of the returns' variance as it trains. Megatron,
policy and critic at two data-parallel ranks with the engine on a worker of its own, validates as
DTensor does and trains.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from nrl_core.testing.tiny_models import cached_tiny_model
from tests.e2e.likelihood import answer_scores, held_out_problems
from tests.e2e.test_distillation import teacher_model
from tests.e2e.test_grpo import TIMING, assert_ok, finite, metrics, run_nrl
from tests.e2e.test_reward_model import reward_model_export

pytest.importorskip("nrl_algo_ppo")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "configs" / "ppo_tiny_cpu.yaml"
MEGATRON = REPO / "examples" / "configs" / "recipes" / "llm" / "ppo-tinyllama-1n2cpu-megatron.yaml"
LEARNING = ["ppo.max_num_steps=30", "ppo.val_period=30", "checkpointing.save_period=15",
            "policy.dtensor_config.load_rng=true", "value.dtensor_config.load_rng=true"]


def run(tmp: Path, *overrides: str, config: Path = RECIPE) -> list[dict]:
    tmp.mkdir(parents=True, exist_ok=True)
    assert_ok(run_nrl(tmp, config, "ppo", [f"policy.model_name={teacher_model()}", *overrides]))
    rows = metrics(tmp)
    assert finite(rows)
    return rows


@pytest.fixture(scope="module")
def learning(tmp_path_factory) -> Path:
    """The tiny recipe on DTensor (colocated vLLM, one rank): 30 steps, validated at 0 and 30,
    checkpointed (with RNG state) at 15 and 30."""
    tmp = tmp_path_factory.mktemp("ppo")
    # step 30 exported (the newest: no metric ranks the checkpoints), step 15 kept for the resume
    run(tmp, *LEARNING, "checkpointing.export_hf=true", "checkpointing.metric_name=null", "checkpointing.keep_top_k=2")
    return tmp


def test_ppo_raises_the_reward_on_the_demo_task(learning):
    """The trained policy's expected reward on the 200 held-out problems (the probability it gives
    each right answer, which one sample at temperature 1 scores) is higher than that of the SFT
    model it started from: by 0.011 to 0.019 at three seeds on the AVX2 path, asserted above 0.005.
    The greedy validation reward rose too (by 0.055 to 0.07), but greedy answers move by whole
    problems with the host's float path (docs/testing.md)."""
    rows = metrics(learning)
    val = [r["val/reward"] for r in rows if "val/reward" in r]
    assert len(val) == 2, val
    problems = held_out_problems(RECIPE)
    before, after = (answer_scores(m, problems, RECIPE).probability
                     for m in (teacher_model(), learning / "ckpt" / "hf_export"))
    print(f"PPO: expected reward on held-out problems {before:.4f} -> {after:.4f}; greedy validation reward {val}")
    assert after > before + 0.005, (before, after, val)
    assert [r["step"] for r in rows if "train/loss" in r][0] == 3  # two steps of critic warm-up first
    assert all("train/critic/loss" in r for r in rows if r["step"] > 0)


def test_resuming_from_a_checkpoint_reproduces_the_next_step(learning, tmp_path):
    """Step 15's checkpoint (policy, critic, engines' sampling state) copied into a fresh directory:
    the resumed run computes step 16 exactly as the uninterrupted run did."""
    shutil.copytree(learning / "ckpt" / "step_15", tmp_path / "ckpt" / "step_15")
    assert (tmp_path / "ckpt" / "step_15" / "value").is_dir()
    resumed = run(tmp_path, *LEARNING[2:], "ppo.max_num_steps=16", "ppo.val_period=0")
    assert [r["step"] for r in resumed] == [16]
    strip = lambda row: {k: v for k, v in row.items() if not k.startswith(TIMING)}  # noqa: E731
    assert strip(resumed[0]) == strip(metrics(learning)[16])


def test_a_step_whose_responses_are_all_filtered_trains_nothing_and_the_run_goes_on(tmp_path):
    """One-token responses are all cut at the limit, and ppo.overlong_filtering drops every one:
    NeMo RL's loss is zero then and its run goes on; so does nrl's, training neither model."""
    proc = run_nrl(tmp_path, RECIPE, "ppo", [f"policy.model_name={teacher_model()}", "ppo.max_num_steps=2",
                                             "ppo.val_period=0", "ppo.val_at_start=false", "ppo.overlong_filtering=true",
                                             "policy.generation.max_new_tokens=1", "checkpointing.enabled=false"])
    assert_ok(proc)
    assert proc.stderr.count("every response was filtered out") == 2
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(r["train/truncated_fraction"] == 1.0 for r in rows)
    assert not [key for r in rows for key in r if key.startswith("train/critic/")]


def test_the_critic_explains_more_of_the_return_as_it_trains(tmp_path):
    """Rewards from the tiny reward model, a function of the text: the critic learns to predict
    them, and the policy to raise them."""
    rows = run(tmp_path, f"policy.model_name={cached_tiny_model('llama', 'small')}",
               f"value.model_name={cached_tiny_model('llama', 'small')}", "data.env_name=reward_model", "env.math=null",
               f"env.reward_model.model_name={reward_model_export()}", "env.reward_model.dtensor_cfg.enabled=true",
               "env.reward_model.precision=float32", "env.reward_model.max_model_len=64", "cluster.gpus_per_node=2",
               "ppo.max_num_steps=30",
               "ppo.val_at_start=false", "ppo.val_period=0", "checkpointing.enabled=false")
    explained = [r["train/critic/explained_var"] for r in rows if "train/critic/explained_var" in r]
    # near 0 at first (a fresh head); the returns' variance itself shrinks as the policy converges
    assert sum(explained[10:25]) / 15 > sum(explained[:5]) / 5 + 0.05, explained
    critic = [r["train/critic/loss"] for r in rows if "train/critic/loss" in r]
    assert sum(critic[-5:]) < 0.5 * sum(critic[:5]), critic
    reward = [r["train/reward"] for r in rows]
    assert sum(reward[-5:]) > sum(reward[:5]), reward


def test_megatron_non_colocated_at_two_data_parallel_ranks_validates_as_dtensor_and_trains(learning, tmp_path):
    rows = run(tmp_path, "ppo.max_num_steps=3", "ppo.val_period=0", "ppo.policy_training_start_step=1",
               "checkpointing.enabled=false", "cluster.gpus_per_node=3", "policy.generation.colocated.enabled=false",
               "policy.generation.colocated.resources.gpus_per_node=1", config=MEGATRON)
    dtensor = next(r for r in metrics(learning) if r["step"] == 0)
    assert rows[0]["step"] == 0 and rows[0]["val/reward"] == dtensor["val/reward"]
    assert [r["step"] for r in rows if "train/loss" in r] == [2, 3]
    assert all(r["train/critic/loss"] > 0 for r in rows[1:])


@pytest.mark.quick  # the algorithm's run in the quick tier
def test_asynchronous_ppo_trains_on_rollouts_within_the_age_bound(tmp_path):
    """The engine on a worker of its own runs a step ahead (NeMo RL's async PPO on the core's
    collector): some steps train on rollouts of the previous weights, none older, with importance
    weights; the critic warms up first and the engine still takes a new version each step."""
    rows = run(tmp_path, "ppo.async_ppo.enabled=true", "ppo.async_ppo.max_trajectory_age_steps=1",
               "loss_fn.use_importance_sampling_correction=true", "policy.generation.colocated.enabled=false",
               "cluster.gpus_per_node=2", "policy.generation.colocated.resources.gpus_per_node=1",
               "ppo.max_num_steps=5", "ppo.val_period=5", "ppo.val_at_start=false", "checkpointing.enabled=false")
    trained = [r for r in rows if "train/reward" in r]
    assert [r["step"] for r in trained] == [1, 2, 3, 4, 5]
    ages = [r["async/trajectory_age_max"] for r in trained]
    assert max(ages) == 1 and all(age in (0, 1) for age in ages), ages
    assert [r["step"] for r in trained if "train/loss" in r] == [3, 4, 5]
    assert all("train/critic/loss" in r for r in trained) and "val/reward" in rows[-1]
