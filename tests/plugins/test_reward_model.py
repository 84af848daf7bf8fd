"""nrl-reward-model without a run: the Bradley-Terry loss against its definition, a DTensor worker
with a value head against Hugging Face's sequence classifier, and the config rules (a value head
only where an algorithm reads one, on a backend that declares it) refused in one line."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nrl_reward_model")

from nrl_core.algorithms.installed import load_and_validate  # noqa: E402
from nrl_core.data.preference import PreferencePair, preference_batch  # noqa: E402
from nrl_core.errors import ConfigError, NrlError  # noqa: E402
from nrl_core.sdk.value_head import head_architecture, last_token_values  # noqa: E402
from nrl_core.testing.preference import random_pairs  # noqa: E402
from nrl_core.testing.tiny_models import cached_tiny_model  # noqa: E402
from nrl_reward_model.loss import BradleyTerryLoss  # noqa: E402

RECIPE = "examples/configs/rm_tiny_cpu.yaml"
PAD = 3


def pairs(count: int, seed: int = 0) -> list[PreferencePair]:
    return random_pairs(count, seed)


def test_the_loss_is_the_mean_negative_log_sigmoid_of_score_gaps_over_valid_pairs():
    batch = preference_batch(pairs(4), PAD)
    batch.fields["sample_mask"][6:] = 0.0  # the last pair pads the batch: weighted 0
    values = torch.randn(batch.size, int(batch.input_ids.shape[1]))
    loss, metrics = BradleyTerryLoss()(values, batch, global_valid_tokens=1.0, global_valid_seqs=6.0)
    scores = values[torch.arange(batch.size), batch.input_lengths.long() - 1]
    chosen, rejected, valid = scores[0::2], scores[1::2], batch.fields["sample_mask"][0::2]
    expected = -(torch.nn.functional.logsigmoid(chosen - rejected) * valid).sum() / 3
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    assert metrics["accuracy"] == pytest.approx(float(((chosen > rejected).float() * valid).sum() / 3))
    assert metrics["num_valid_samples"] == 3
    halves = [BradleyTerryLoss()(values[rows], batch.select(rows), global_valid_tokens=1.0, global_valid_seqs=6.0)
              for rows in ([0, 1, 2, 3], [4, 5, 6, 7])]
    assert float(sum(h[0] for h in halves)) == pytest.approx(float(loss), rel=1e-6)
    assert sum(h[1]["accuracy"] for h in halves) == pytest.approx(metrics["accuracy"])


def test_a_batch_laid_out_for_two_ranks_reads_as_pairs_in_pair_order():
    """Validation computes the loss over the whole batch on the driver (PreferenceRun.validate):
    the rows, and the model's outputs for them, a data-parallel layout interleaves are put back in
    pair order, and the metrics are the one-rank batch's."""
    from nrl_core.data.preference import pair_order

    one, two = preference_batch(pairs(4), PAD), preference_batch(pairs(4), PAD, data_parallel_size=2)
    values_one = torch.randn(one.size, int(one.input_ids.shape[1]))
    row_of = {(int(p), int(c)): r for r, (p, c) in enumerate(zip(one.fields["pair"], one.fields["chosen"]))}
    values_two = values_one[[row_of[(int(p), int(c))] for p, c in zip(two.fields["pair"], two.fields["chosen"])]]
    with pytest.raises(NrlError):  # as laid out for the ranks, the rows are not pairs
        BradleyTerryLoss()(values_two, two, global_valid_tokens=1.0, global_valid_seqs=8.0)
    order = pair_order(two)
    _, metrics = BradleyTerryLoss()(values_two[order], two.select(order), global_valid_tokens=1.0,
                                    global_valid_seqs=8.0)
    assert metrics == BradleyTerryLoss()(values_one, one, global_valid_tokens=1.0, global_valid_seqs=8.0)[1]


def test_a_micro_batch_that_splits_a_pair_is_refused():
    batch = preference_batch(pairs(2), PAD)
    with pytest.raises(NrlError, match="not \\(chosen, rejected\\) pairs"):
        BradleyTerryLoss()(torch.zeros(3, 4), batch.select([0, 1, 2]), global_valid_tokens=1.0, global_valid_seqs=4.0)


def test_the_score_is_the_value_at_each_rows_last_token():
    values = torch.arange(12.0).reshape(3, 4)
    assert last_token_values(values, torch.tensor([4, 1, 2])).tolist() == [3.0, 4.0, 9.0]


def test_the_exported_class_follows_the_head_type():
    assert head_architecture(["LlamaForCausalLM"], "llama", "bradley_terry") == "LlamaForSequenceClassification"
    assert head_architecture(["Qwen2ForSequenceClassification"], "qwen2", "regression") == "Qwen2ForTokenClassification"
    assert head_architecture(None, "qwen3", "bradley_terry") == "Qwen3ForSequenceClassification"


# ------------------------------------------------------------------------------ a DTensor value model


@pytest.fixture(scope="module")
def value_worker():
    import sys
    from pathlib import Path

    from nrl_backend_dtensor.worker import DTensorPolicyWorker

    sys.path.insert(0, str(Path(__file__).parents[1] / "dtensor"))
    from common import make_config

    config = make_config(model_name=str(cached_tiny_model("llama", "small")),
                         reward_model_cfg={"enabled": True, "reward_model_type": "bradley_terry"})
    return DTensorPolicyWorker(config, 0, 1)


def test_a_dtensor_value_model_trains_and_exports_an_hf_sequence_classifier(value_worker, tmp_path):
    from transformers import AutoModelForSequenceClassification

    train, held_out = preference_batch(pairs(8, seed=1), PAD), preference_batch(pairs(4, seed=2), PAD)
    losses = [value_worker.train(train, BradleyTerryLoss())["loss"] for _ in range(4)]
    assert losses[-1] < losses[0]
    values = value_worker.get_values(held_out).values
    assert values.shape == held_out.input_ids.shape

    value_worker.export_hf(str(tmp_path / "rm"))
    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm")).eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.num_labels == 1
    with torch.no_grad():  # HF pools at each row's last non-pad token, as the worker's score does
        logits = hf(input_ids=held_out.input_ids).logits.squeeze(-1)
    assert torch.allclose(logits, last_token_values(values, held_out.input_lengths), atol=1e-5)


def test_packed_values_equal_padded_ones_at_every_position(value_worker):
    """A value reads its own position, so packing must not zero a sequence's first one (as it does
    for logprobs, which a segment's first token has none of); regression heads (critics) read them all."""
    from common import make_config

    from nrl_backend_dtensor.worker import DTensorPolicyWorker

    packed = DTensorPolicyWorker(make_config(
        model_name=str(cached_tiny_model("llama", "small")), reward_model_cfg={"enabled": True},
        sequence_packing={"enabled": True}), 0, 1)
    packed.model.load_state_dict(value_worker.model.state_dict())
    batch = preference_batch(pairs(6, seed=3), PAD)
    valid = torch.arange(batch.input_ids.shape[1])[None] < batch.input_lengths[:, None]
    plain, both = value_worker.get_values(batch).values, packed.get_values(batch).values
    assert torch.allclose(plain[valid], both[valid], atol=1e-5) and bool((both[:, 0] != 0).all())


def test_an_export_of_a_model_without_a_pad_id_names_the_one_nrl_pads_with(tmp_path):
    """A base model whose config has no pad id (Llama 3, Qwen2.5): the export's is the tokenizer's,
    so HF's classifier scores each row's last real token of a right-padded batch, as nrl does."""
    from common import make_config
    from transformers import AutoModelForSequenceClassification

    from nrl_backend_dtensor.worker import DTensorPolicyWorker

    worker = DTensorPolicyWorker(make_config(model_name=str(cached_tiny_model("llama", "small", pad_token_id=None)),
                                             reward_model_cfg={"enabled": True}), 0, 1)
    assert worker.hf_config.pad_token_id == PAD  # the tokenizer's <pad>
    batch = preference_batch(pairs(4, seed=5), PAD)
    worker.export_hf(str(tmp_path / "rm"))
    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm")).eval()
    assert hf.config.pad_token_id == PAD
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids).logits.squeeze(-1)
    assert torch.allclose(logits, last_token_values(worker.get_values(batch).values, batch.input_lengths), atol=1e-5)


def test_a_value_model_has_no_logprobs(value_worker):
    with pytest.raises(NrlError, match="has a value head"):
        value_worker.get_logprobs(preference_batch(pairs(2), PAD))


def test_a_language_model_loss_on_a_value_model_is_refused_by_the_driver():
    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.algorithms.policy import Policy
    from nrl_core.errors import PluginError

    policy = Policy.__new__(Policy)  # the check reads only the spec and the head
    policy.value_head, policy.name = True, "policy"
    policy.spec = type("Spec", (), {"capabilities": frozenset({"value_head"}), "name": "dtensor",
                                    "distribution": "nrl-backend-dtensor"})()
    with pytest.raises(PluginError, match="reads logprobs but the policy model has a value head"):
        policy._check_loss(NLLLoss())
    policy.value_head = False
    with pytest.raises(PluginError, match="reads values but the policy model has an LM head"):
        policy._check_loss(BradleyTerryLoss())


# ---------------------------------------------------------------------------------------- config


@pytest.fixture(scope="module")
def model() -> str:
    return str(cached_tiny_model("llama", "small"))


def refusal(path: str, algorithm: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_and_validate(path, list(overrides), algorithm=algorithm)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_the_recipe_passes_with_a_value_head(model):
    config = load_and_validate(RECIPE, [f"policy.model_name={model}"], algorithm="rm")
    assert config["policy"]["reward_model_cfg"] == {"enabled": True, "reward_model_type": "bradley_terry"}
    assert config["rm"]["max_num_steps"] == 40


@pytest.mark.parametrize("override, start", [
    ("policy.reward_model_cfg.enabled=false", "policy.reward_model_cfg.enabled: reward-model training builds"),
    ("policy.reward_model_cfg.reward_model_type=regression", "policy.reward_model_cfg.reward_model_type: rm trains"),
    ("policy.sequence_packing.enabled=true", "policy.sequence_packing.enabled: a reward model compares"),
])
def test_what_rm_cannot_train_is_refused(model, override, start):
    assert refusal(RECIPE, "rm", f"policy.model_name={model}", override,
                   "policy.sequence_packing.train_mb_tokens=128").startswith(start)


def test_a_value_head_where_the_algorithm_reads_none_is_refused(model):
    message = refusal("examples/configs/dpo_tiny_cpu.yaml", "dpo", f"policy.model_name={model}",
                      "policy.reward_model_cfg.enabled=true")
    assert message.startswith("policy.reward_model_cfg.enabled: dpo does not train or read a value head")


def test_a_backend_without_value_head_is_refused(model):
    from nrl_core.plugins import get_plugin_manager

    dtensor = get_plugin_manager().training_backends().get("dtensor", "policy")
    object.__setattr__(dtensor, "capabilities", dtensor.capabilities - {"value_head"})
    try:
        assert refusal(RECIPE, "rm", f"policy.model_name={model}").startswith(
            "policy.reward_model_cfg.enabled: the dtensor training backend (nrl-backend-dtensor) does not declare "
            "value_head")
    finally:
        object.__setattr__(dtensor, "capabilities", dtensor.capabilities | {"value_head"})


# ---------------------------------------------------------------------------------------- env.reward_model


def env_section(**overrides) -> dict:
    from nrl_reward_model.env_config import REWARD_MODEL_ENV_SCHEMA

    return REWARD_MODEL_ENV_SCHEMA.validate({"model_name": str(cached_tiny_model("llama", "small")),
                                             "dtensor_cfg": {"enabled": True}, **overrides}, "env.reward_model")


def test_the_environment_scores_the_ids_rm_training_read():
    """A rollout's prompt text and response, tokenized for the reward model, are exactly the ids of
    the same pair side in nrl train rm's batches (the demo's template closes a turn with EOS)."""
    from transformers import AutoTokenizer

    from nrl_core.contracts import EnvSample
    from nrl_core.data.preference import arithmetic_preference_splits, parse_preference, tokenize_preference
    from nrl_reward_model.environment import score_ids

    tokenizer = AutoTokenizer.from_pretrained(str(cached_tiny_model("llama", "small")))
    train, _ = arithmetic_preference_splits(distractor="operand", num_train=8, num_val=2, min_operand=0,
                                            max_operand=19, ops=["+", "-"], seed=0)
    for i, record in enumerate(train):
        pair = tokenize_preference(i, *parse_preference(record, "train"), tokenizer, use_chat_template=True)
        for side in (pair.chosen, pair.rejected):
            # the text an engine returns for those response tokens (the template's " " after "A:" included)
            response = tokenizer.decode(side.response_ids, skip_special_tokens=True)
            sample = EnvSample(prompt=side.prompt_text, response=response)
            assert score_ids(tokenizer, sample, 64) == side.prompt_ids + side.response_ids
    assert score_ids(tokenizer, EnvSample(prompt="Q: 1 + 1?\nA:", response=" 2"), 3)[-1] == tokenizer.eos_token_id


@pytest.mark.parametrize("overrides, start", [
    ({"model_name": None}, "env.reward_model.model_name: is required"),
    ({"dtensor_cfg": {"enabled": True, "tensor_parallel_size": 3}},
     "env.reward_model.dtensor_cfg.tensor_parallel_size:"),  # the spelling the section used
    ({"resources": {"gpus_per_node": 1, "num_nodes": 1}, "dtensor_cfg": {"enabled": True, "tensor_parallel_size": 2}},
     "env.reward_model.dtensor_cfg.tensor_parallel_size: one model replica needs 2 ranks"),
])
def test_a_bad_reward_model_section_is_one_line_naming_its_key(overrides, start):
    from nrl_reward_model.environment import scorer_config

    with pytest.raises(ConfigError) as caught:
        scorer_config(env_section(**overrides))
    assert str(caught.value).startswith(start) and "\n" not in str(caught.value), str(caught.value)


def test_the_reward_model_section_becomes_a_value_model_config_of_its_own():
    from nrl_reward_model.environment import scorer_config

    config = scorer_config(env_section(batch_size=4, max_model_len=48, resources={"gpus_per_node": 2, "num_nodes": 1}))
    policy = config["policy"]
    assert policy["reward_model_cfg"]["enabled"] and policy["generation"] is None
    assert (policy["logprob_batch_size"], policy["max_total_sequence_length"]) == (4, 48)
    assert config["cluster"]["gpus_per_node"] == 2 and policy["dtensor_config"]["enabled"]


def test_the_reward_model_takes_its_devices_from_the_cluster(model):
    """NeMo RL's split: env.reward_model.resources come out of cluster.gpus_per_node, training gets
    the rest; a reward model that leaves nothing is refused in one line."""
    from nrl_core.algorithms.installed import cluster_topology

    recipe, rm = "examples/configs/grpo_rm_tiny_cpu.yaml", f"env.reward_model.model_name={model}"
    config = load_and_validate(recipe, [f"policy.model_name={model}", rm], algorithm="grpo")
    assert config["cluster"]["gpus_per_node"] == 2 and cluster_topology(config).train_world == 1
    assert refusal(recipe, "grpo", f"policy.model_name={model}", rm, "cluster.gpus_per_node=1").startswith(
        "env.reward_model.resources.gpus_per_node: 1 leaves nothing of cluster.gpus_per_node=1")
