"""nrl-algo-distillation without a run: the top-k KL losses against their definitions, and the
config rules (a teacher that shares the student's tokenizer, NeMo RL's cross-tokenizer recipes,
the losses nrl cannot compute) refused in one line naming the key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("nrl_algo_distillation")

from nrl_algo_distillation.loss import TEACHER_IDS, TEACHER_LOGPROBS, TopkDistillationLoss  # noqa: E402
from nrl_core.algorithms.installed import load_and_validate  # noqa: E402
from nrl_core.contracts import TokenBatch  # noqa: E402
from nrl_core.errors import ConfigError  # noqa: E402
from nrl_core.testing.tiny_models import cached_tiny_model  # noqa: E402

RECIPE = "examples/configs/distillation_tiny_cpu.yaml"
MEGATRON = "examples/configs/recipes/llm/distillation-tinyllama-1n2cpu-megatron.yaml"
B, T, K = 4, 6, 3


def batch(seed: int = 0) -> tuple[torch.Tensor, TokenBatch]:
    """Student logprobs at the teacher's ids and a batch holding the teacher's (full-vocabulary
    logprobs, so each row's k values sum to less than 1)."""
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(B, T, 8, generator=g).log_softmax(-1)[..., :K]
    teacher = torch.randn(B, T, 8, generator=g).log_softmax(-1)[..., :K]
    mask = torch.ones(B, T)
    mask[:, 0] = 0
    mask[1, 4:] = 0
    fields = {"token_mask": mask, "sample_mask": torch.tensor([1.0, 1.0, 0.0, 1.0]), TEACHER_LOGPROBS: teacher,
              TEACHER_IDS: torch.zeros(B, T, K, dtype=torch.long)}
    return student, TokenBatch(input_ids=torch.zeros(B, T, dtype=torch.long), input_lengths=torch.full((B,), T),
                               fields=fields)


def by_definition(student: torch.Tensor, teacher: torch.Tensor, kind: str, weight: float = 0.5,
                  renormalise_student: bool = True) -> torch.Tensor:
    p = teacher.log_softmax(-1)
    q = student.log_softmax(-1) if renormalise_student else student
    forward = (p.exp() * (p - q)).sum(-1)
    reverse = (q.exp() * (q - p)).sum(-1)
    return {"forward": forward, "reverse": reverse, "mixed": weight * forward + (1 - weight) * reverse}[kind]


@pytest.mark.parametrize("kind", ["forward", "reverse", "mixed"])
def test_the_kl_is_the_masked_token_mean_of_its_definition(kind):
    student, data = batch()
    mask = data.fields["token_mask"] * data.fields["sample_mask"][:, None]
    loss, metrics = TopkDistillationLoss(kind, 0.3)(student, data, global_valid_tokens=float(mask.sum()),
                                                    global_valid_seqs=3.0)
    expected = (by_definition(student, data.fields[TEACHER_LOGPROBS], kind, 0.3) * mask).sum() / mask.sum()
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    assert metrics["loss"] == pytest.approx(float(expected), rel=1e-6) and metrics["num_valid_samples"] == 3


def test_zero_outside_topk_keeps_the_students_full_vocabulary_probabilities():
    student, data = batch()
    mask = data.fields["token_mask"] * data.fields["sample_mask"][:, None]
    loss, _ = TopkDistillationLoss("forward", zero_outside_topk=True)(
        student, data, global_valid_tokens=float(mask.sum()), global_valid_seqs=3.0)
    expected = (by_definition(student, data.fields[TEACHER_LOGPROBS], "forward", renormalise_student=False)
                * mask).sum() / mask.sum()
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    assert float(loss) != pytest.approx(float(TopkDistillationLoss("forward")(
        student, data, global_valid_tokens=float(mask.sum()), global_valid_seqs=3.0)[0]))


def test_a_student_equal_to_its_teacher_has_zero_loss_and_gradient():
    _, data = batch()
    student = data.fields[TEACHER_LOGPROBS].clone().requires_grad_()
    loss, _ = TopkDistillationLoss("mixed")(student, data, global_valid_tokens=10.0, global_valid_seqs=3.0)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-7)
    assert float(student.grad.abs().max()) < 1e-7


def test_micro_batch_losses_add_up_to_the_global_batch_loss():
    student, data = batch()
    loss_fn = TopkDistillationLoss("mixed")
    tokens = float((data.fields["token_mask"] * data.fields["sample_mask"][:, None]).sum())
    whole, _ = loss_fn(student, data, global_valid_tokens=tokens, global_valid_seqs=3.0)
    halves = [loss_fn(student[rows], data.select(rows), global_valid_tokens=tokens, global_valid_seqs=3.0)[0]
              for rows in ([0, 1], [2, 3])]
    assert float(sum(halves)) == pytest.approx(float(whole), rel=1e-6)


# ---------------------------------------------------------------------------------------- config


@pytest.fixture(scope="module")
def models() -> tuple[str, str]:
    return str(cached_tiny_model("llama", "small", seed=1, num_hidden_layers=2)), str(cached_tiny_model("llama", "small"))


def checked(models: tuple[str, str], *overrides: str, path: str = RECIPE) -> dict:
    student, teacher = models
    return load_and_validate(path, [f"policy.model_name={student}", f"teacher.model_name={teacher}", *overrides],
                             algorithm="distillation")


def refusal(models: tuple[str, str], *overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        checked(models, *overrides)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_the_teacher_is_a_policy_shaped_section_with_its_own_backend(models):
    config = checked(models, path=MEGATRON)
    teacher = config["teacher"]
    assert teacher["model_name"] == models[1] and teacher["megatron_cfg"]["enabled"] is True
    assert teacher["tokenizer"]["name"] == models[1]  # short forms expanded as the policy's
    assert teacher["generation"] == config["policy"]["generation"]  # placed as the policy is
    assert config["loss_fn"]["kl_type"] == "mixed" and config["distillation"]["topk_logits_k"] == 16


def test_a_bad_teacher_key_is_named_under_teacher(models):
    assert refusal(models, "teacher.dtensor_config.tensor_parallel_size=3").startswith(
        "teacher.dtensor_config.tensor_parallel_size:")
    assert refusal(models, "teacher.max_total_sequence_lenght=64").startswith("teacher.max_total_sequence_lenght:")


def test_distillation_without_a_teacher_is_one_line(models):
    assert refusal(models, "teacher=null").startswith("teacher: distillation needs a teacher")


def test_cross_tokenizer_teachers_are_refused(models):
    assert refusal(models, "teachers=[{model_name: x}]").startswith(
        "teachers: cross-tokenizer distillation (NeMo RL's xtoken recipes")


def test_a_teacher_with_another_tokenizer_is_refused(models, tmp_path):
    other = tmp_path / "other_teacher"
    shutil.copytree(models[1], other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert refusal(models, f"teacher.model_name={other}").startswith(
        f"teacher.tokenizer.name: '{other}' is not the student's tokenizer")


@pytest.mark.parametrize("overrides, start", [
    (("loss_fn.kl_type=reverse", "loss_fn.zero_outside_topk=true"), "loss_fn.zero_outside_topk: with a reverse or"),
    (("loss_fn.mixed_kl_weight=1.5",), "loss_fn.mixed_kl_weight: must be within [0, 1]"),
    (("loss_fn.kl_type=jensen",), "loss_fn.kl_type:"),
    (("distillation.max_rollout_turns=2",), "distillation.max_rollout_turns: nrl distils single responses"),
])
def test_what_the_loss_cannot_compute_is_one_line(models, overrides, start):
    assert refusal(models, *overrides).startswith(start)


def test_a_gathering_loss_on_a_backend_without_topk_logprobs_is_refused_before_any_worker_runs():
    """A backend that does not declare the capability would hand the loss ``[b, t]`` logprobs,
    which broadcast silently against the teacher's ``[b, t, k]``: the driver refuses in one line."""
    from nrl_core.algorithms.policy import Policy
    from nrl_core.contracts import TrainingBackendSpec
    from nrl_core.errors import PluginError
    from nrl_core.schema import Section

    policy = Policy.__new__(Policy)  # no workers: the refusal comes first
    policy.spec = TrainingBackendSpec(name="plain", config_key="plain_cfg", priority=0, worker="x:Y",
                                      config_schema=Section(), distribution="nrl-backend-plain",
                                      capabilities=frozenset({"data_parallel"}))
    _, data = batch()
    with pytest.raises(PluginError, match=r"^the plain training backend \(nrl-backend-plain\) does not declare "
                                          r"topk_logprobs, which the loss TopkDistillationLoss needs"):
        policy.train(data, TopkDistillationLoss())


def test_responses_that_do_not_split_into_optimizer_batches_are_one_line(models):
    assert refusal(models, "policy.train_global_batch_size=48", "policy.train_micro_batch_size=16").startswith(
        "policy.train_global_batch_size: 48 does not divide the 64 responses of a step")


def test_a_worker_returning_the_wrong_top_k_type_is_one_line():
    from nrl_core.contract_versions import check_result
    from nrl_core.errors import PluginError

    with pytest.raises(PluginError, match=r"^get_topk_logprobs returned torch\.Tensor; contract 10 and later require a "
                                          r"TopkShard or None \(nrl_core\.contracts\.TopkShard\(rows=\.\.\., "
                                          r"logprobs=\.\.\., ids=\.\.\.\)"):
        check_result("get_topk_logprobs", torch.zeros(1), "TopkShard", since=10)
