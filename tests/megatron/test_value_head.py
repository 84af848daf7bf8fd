"""The Megatron backend with a value head (capability ``value_head``, contract 11).

A Megatron value model equals, position by position, the DTensor backend's and Hugging Face's own
classifier loaded from the same ``LlamaForSequenceClassification`` checkpoint, at TP=1, TP=2 and
PP=2; one started from a causal LM gets a fresh, seeded head, learns pairs with the Bradley-Terry
loss, and exports a classifier HF loads with the scores the worker gives. What it does not do is
refused in one line. Every worker of a world is built in one spawned run: starting Megatron costs
most of the time.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="nrl-backend-megatron's engine is not installed")
pytest.importorskip("nrl_backend_megatron")
pytest.importorskip("nrl_reward_model")

from _helpers import make_batch, make_config, run_world  # noqa: E402

from nrl_core.data.preference import PreferencePair, preference_batch  # noqa: E402
from nrl_core.errors import ConfigError  # noqa: E402
from nrl_core.sdk.value_head import last_token_values  # noqa: E402
from nrl_core.testing.distributed import gather_shards  # noqa: E402
from nrl_core.testing.preference import random_pairs  # noqa: E402
from nrl_core.testing.tiny_models import cached_tiny_model, model_config  # noqa: E402

PAD = 3  # the tiny models' pad id: make_batch and preference_batch pad with it
RM = {"enabled": True, "reward_model_type": "bradley_terry"}
STEPS = 4
TP2 = {"tensor_model_parallel_size": 2}


def pairs(count: int, seed: int = 0) -> list[PreferencePair]:
    return random_pairs(count, seed)


def value_config(path: str, megatron: dict | None = None, kind: str = "bradley_terry", **policy: Any) -> dict:
    return make_config(path, megatron=megatron, reward_model_cfg={**RM, "reward_model_type": kind},
                       train_global_batch_size=8, **policy)


def head_of(worker: Any) -> torch.Tensor:
    return worker.model.output_layer.weight.detach().float().clone()


# ------------------------------------------------------------------ the checkpoints
@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny causal LM as an HF sequence classifier of one label, its head drawn at five times
    HF's scale (std 0.1: values of order 1, so a wrong head shows and float32 sums stay within 1e-5)."""
    import shutil

    from transformers import AutoModelForSequenceClassification

    causal = cached_tiny_model("llama")
    model = AutoModelForSequenceClassification.from_pretrained(str(causal), num_labels=1, pad_token_id=PAD,
                                                               dtype=torch.float32)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(7)
        model.score.weight.copy_(0.1 * torch.randn(model.score.weight.shape, generator=generator))
    out = tmp_path_factory.mktemp("classifier") / "llama-rm"
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(causal / name, out / name)
    return str(out)


def hf_scores(path: str, batch: Any) -> torch.Tensor:
    """HF's classifier head at every position, zero past each row's length (the worker's layout)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        values = model.score(model.model(input_ids=batch.input_ids).last_hidden_state).squeeze(-1)
    return values * (torch.arange(values.shape[1])[None] < batch.input_lengths[:, None])


# ------------------------------------------------------------------ world of 1
def world1(rank: int, world: int, classifier_dir: str, causal_dir: str, export_dir: str) -> dict[str, Any]:
    from nrl_backend_megatron.worker import MegatronPolicyWorker
    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.errors import NrlError
    from nrl_reward_model.loss import BradleyTerryLoss

    out: dict[str, Any] = {}
    batch = make_batch()
    out["dtensor"] = dtensor_values(classifier_dir, batch)

    loaded = MegatronPolicyWorker(value_config(classifier_dir), rank, world)
    out["loaded"] = gather_shards(loaded.get_values(batch), batch)
    for name, call in (("get_logprobs", lambda: loaded.get_logprobs(batch)),
                       ("get_reference_logprobs", lambda: loaded.get_reference_logprobs(batch)),
                       ("nll", lambda: loaded.train(batch, NLLLoss()))):
        try:
            call()
        except NrlError as exc:
            out[f"error/{name}"] = str(exc)
    out["loaded/reference"] = loaded.reference
    packing = {"enabled": True, "logprob_mb_tokens": 64, "train_mb_tokens": 64, "sequence_length_round": 1}
    packed = MegatronPolicyWorker(value_config(classifier_dir, sequence_packing=packing), rank, world)
    out["packed"] = gather_shards(packed.get_values(batch), batch)

    fresh = MegatronPolicyWorker(value_config(causal_dir), rank, world)
    out["fresh/head"] = head_of(fresh)
    out["again/head"] = head_of(MegatronPolicyWorker(value_config(causal_dir), rank, world))
    train, held_out = preference_batch(pairs(4, seed=1), PAD), preference_batch(pairs(4, seed=2), PAD)
    out["losses"] = [fresh.train(train, BradleyTerryLoss())["loss"] for _ in range(STEPS)]
    out["held_out"] = gather_shards(fresh.get_values(held_out), held_out)
    out["manifest"] = [(s.name, s.shape) for s in fresh.weight_manifest("float32")]
    fresh.export_hf(export_dir)

    critic = MegatronPolicyWorker(value_config(causal_dir, kind="regression"), rank, world)
    with torch.no_grad():
        critic.model.output_layer.bias.fill_(0.5)  # a bias that shows in the export
    out["critic"] = gather_shards(critic.get_values(batch), batch)
    critic.export_hf(f"{export_dir}-critic")
    return out


def dtensor_values(classifier_dir: str, batch: Any) -> torch.Tensor:
    """The DTensor backend's values for ``batch`` from the same classifier checkpoint."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "dtensor"))
    from common import make_config as dtensor_config

    from nrl_backend_dtensor.worker import DTensorPolicyWorker

    worker = DTensorPolicyWorker(dtensor_config(model_name=classifier_dir, reward_model_cfg=RM), 0, 1)
    return gather_shards(worker.get_values(batch), batch)


@pytest.fixture(scope="module")
def w1(classifier: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    export = tmp_path_factory.mktemp("rm-export") / "hf"
    (result,) = run_world(world1, 1, classifier, str(cached_tiny_model("llama")), str(export))
    result["export"] = str(export)
    return result


# ------------------------------------------------------------------ world of 2
def world2(rank: int, world: int, classifier_dir: str, causal_dir: str, ckpt: str) -> dict[str, Any]:
    from nrl_backend_megatron.worker import MegatronPolicyWorker
    from nrl_reward_model.loss import BradleyTerryLoss

    out: dict[str, Any] = {}
    batch = make_batch()
    for tag, megatron in (("tp2", TP2), ("pp2", {"pipeline_model_parallel_size": 2})):
        w = MegatronPolicyWorker(value_config(classifier_dir, megatron), rank, world)
        out[f"{tag}/values"] = gather_shards(w.get_values(batch), batch)

    # sequence parallelism: the head gathers the sequence, its gradient is each rank's own slice
    w = MegatronPolicyWorker(value_config(causal_dir, {**TP2, "sequence_parallel": True}), rank, world)
    train = preference_batch(pairs(4, seed=1), PAD)
    out["sp/values"] = gather_shards(w.get_values(batch), batch)
    out["sp/metrics"] = [w.train(train, BradleyTerryLoss()) for _ in range(STEPS)]
    out["sp/head"] = head_of(w)

    w = MegatronPolicyWorker(value_config(causal_dir, TP2), rank, world)
    out["fresh/head"] = head_of(w)
    out["fresh/values"] = gather_shards(w.get_values(batch), batch)
    metrics = [w.train(train, BradleyTerryLoss()) for _ in range(STEPS)]
    out["losses"], out["grad_norms"] = [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]
    out["head"] = head_of(w)
    w.save_checkpoint(ckpt)
    saved = head_of(w)
    w.train(train, BradleyTerryLoss())
    out["head_moved"] = not torch.equal(head_of(w), saved)
    w.load_checkpoint(ckpt)
    out["head_restored"] = torch.equal(head_of(w), saved)
    return out


@pytest.fixture(scope="module")
def w2(classifier: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    ckpt = tmp_path_factory.mktemp("rm-ckpt") / "step"
    return run_world(world2, 2, classifier, str(cached_tiny_model("llama")), str(ckpt))


# ------------------------------------------------------------------ the tests
def test_values_equal_the_dtensor_backends_and_hfs_from_one_classifier_checkpoint(w1, classifier) -> None:
    batch = make_batch()
    assert w1["loaded"].shape == batch.input_ids.shape and w1["loaded"].dtype == torch.float32
    assert w1["loaded"].abs().max() > 0.5  # a head of std 0.1: values far from zero
    assert (w1["loaded"] - w1["dtensor"]).abs().max() < 1e-5
    assert (w1["loaded"] - hf_scores(classifier, batch)).abs().max() < 1e-5


def test_packed_sequences_get_the_same_values_their_first_position_included(w1) -> None:
    assert (w1["packed"] - w1["loaded"]).abs().max() < 1e-5
    assert bool((w1["packed"][:, 0] != 0).all())


def test_tensor_and_pipeline_parallel_values_equal_one_rank(w1, w2) -> None:
    for tag in ("tp2", "pp2"):
        assert (w2[0][f"{tag}/values"] - w1["loaded"]).abs().max() < 1e-5, tag


def test_a_head_on_a_causal_lm_starts_fresh_seeded_and_the_same_on_every_rank_and_layout(w1, w2) -> None:
    head = w1["fresh/head"]
    assert head.shape == (1, 64) and torch.equal(head, w1["again/head"])
    assert 0.01 < float(head.std()) < 0.04  # normal(0, initializer_range = 0.02)
    assert all(torch.equal(r["fresh/head"], head) for r in w2)


def test_bradley_terry_training_lowers_the_loss_and_tensor_parallel_training_matches(w1, w2) -> None:
    losses = w1["losses"]
    assert losses[-1] < losses[0]
    assert w2[0]["losses"] == pytest.approx(losses, abs=1e-5)


def test_sequence_parallel_values_and_training_equal_tensor_parallel_alone(w2) -> None:
    for rank in w2:
        assert (rank["sp/values"] - rank["fresh/values"]).abs().max() < 1e-5
        assert [m["loss"] for m in rank["sp/metrics"]] == pytest.approx(rank["losses"], abs=1e-5)
        assert [m["grad_norm"] for m in rank["sp/metrics"]] == pytest.approx(rank["grad_norms"], abs=1e-5)
        assert (rank["sp/head"] - rank["head"]).abs().max() < 1e-5


def test_a_checkpoint_holds_the_head(w2) -> None:
    assert all(r["head_moved"] and r["head_restored"] for r in w2)


def test_the_export_is_an_hf_sequence_classifier_scoring_as_the_worker(w1) -> None:
    from transformers import AutoModelForSequenceClassification

    names = {name for name, _ in w1["manifest"]}
    assert ("score.weight", (1, 64)) in w1["manifest"] and "lm_head.weight" not in names
    hf = AutoModelForSequenceClassification.from_pretrained(w1["export"]).eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.num_labels == 1
    held_out = preference_batch(pairs(4, seed=2), PAD)
    with torch.no_grad():  # HF pools at each row's last non-pad token
        logits = hf(input_ids=held_out.input_ids).logits.squeeze(-1)
    assert (logits - last_token_values(w1["held_out"], held_out.input_lengths)).abs().max() < 1e-5


def test_a_regression_head_has_a_bias_and_exports_an_hf_token_classifier(w1) -> None:
    from transformers import AutoModelForTokenClassification

    hf = AutoModelForTokenClassification.from_pretrained(f"{w1['export']}-critic").eval()
    assert type(hf).__name__ == "LlamaForTokenClassification" and float(hf.score.bias.detach()) == 0.5
    batch = make_batch()
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids).logits.squeeze(-1)
    valid = torch.arange(logits.shape[1])[None] < batch.input_lengths[:, None]
    assert (logits * valid - w1["critic"]).abs().max() < 1e-5


def test_logprobs_of_a_value_model_are_refused_in_one_line(w1) -> None:
    for name in ("get_logprobs", "get_reference_logprobs", "nll"):
        message = w1[f"error/{name}"]
        assert "has a value head" in message and "\n" not in message, name
    assert w1["loaded/reference"] is None  # no reference copy of a value model's weights


# ------------------------------------------------------------------ in this process: mapping and checks
def test_the_value_model_maps_score_where_a_causal_lm_maps_lm_head(classifier) -> None:
    from transformers import AutoConfig

    from nrl_backend_megatron.convert import canonical_shapes, family_of, megatron_to_hf
    from nrl_backend_megatron.value_head import model_config as value_model

    causal = AutoConfig.from_pretrained(str(cached_tiny_model("llama")))
    for kind, names in (("bradley_terry", {"score.weight": (1, 64)}),
                        ("regression", {"score.weight": (1, 64), "score.bias": (1,)})):
        cfg = value_model(causal, kind, str(cached_tiny_model("llama")))
        shapes = canonical_shapes(cfg)
        assert "output_layer.weight" in shapes and family_of(cfg).name == "llama"
        hf = megatron_to_hf({k: torch.zeros(v) for k, v in shapes.items() if k.startswith("output_layer.")}, cfg)
        assert {k: tuple(v.shape) for k, v in hf.items()} == names
    assert canonical_shapes(causal)["output_layer.weight"] == (512, 64)
    assert canonical_shapes(AutoConfig.from_pretrained(classifier))["output_layer.weight"] == (1, 64)


def policy_of(model: str, megatron: dict | None = None, **policy: Any) -> tuple[dict, dict]:
    config = make_config(model, megatron=megatron, **policy)["policy"]
    return config, config["megatron_cfg"]


@pytest.mark.parametrize("megatron, key", [
    ({"peft": {"enabled": True}}, "policy.megatron_cfg.peft.enabled"),
    ({"pretrained_checkpoint": "/nowhere"}, "policy.megatron_cfg.pretrained_checkpoint"),
])
def test_what_a_value_head_does_not_support_is_refused_in_one_line(megatron: dict, key: str) -> None:
    from transformers import AutoConfig

    from nrl_backend_megatron.checks import check_value_head

    model = str(cached_tiny_model("llama"))
    policy, section = policy_of(model, megatron, reward_model_cfg=RM)
    with pytest.raises(ConfigError) as caught:
        check_value_head(policy, section, AutoConfig.from_pretrained(model))
    assert str(caught.value).startswith(key) and "\n" not in str(caught.value)
    policy, section = policy_of(model, megatron)
    check_value_head(policy, section, AutoConfig.from_pretrained(model))  # a language model: not this check's


def test_a_moe_value_model_and_mismatched_classifiers_are_refused_in_one_line(classifier) -> None:
    from transformers import AutoConfig

    from nrl_backend_megatron.checks import check_value_head

    moe = model_config("qwen3_moe")
    moe.architectures = ["Qwen3MoeForCausalLM"]
    cases = [(moe, RM, "policy.model_name: a mixture-of-experts model"),
             (AutoConfig.from_pretrained(classifier), None, "policy.model_name: "),
             (AutoConfig.from_pretrained(classifier), {**RM, "reward_model_type": "regression"},
              "policy.reward_model_cfg.reward_model_type: is regression")]
    for hf_config, rm, start in cases:
        policy, section = policy_of(classifier, **({"reward_model_cfg": rm} if rm else {}))
        with pytest.raises(ConfigError) as caught:
            check_value_head(policy, section, hf_config)
        assert str(caught.value).startswith(start) and "\n" not in str(caught.value), str(caught.value)
