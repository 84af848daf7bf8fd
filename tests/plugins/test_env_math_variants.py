"""The ``dapo`` and ``math_multi_reward`` environments of nrl-env-math: NeMo RL's DAPO verifier
(``math_verify_impl: dapo_math_verify``) and its three named rewards for GDPO, on hand-written
responses."""

from __future__ import annotations

import pytest

pytest.importorskip("nrl_env_math")

from nrl_core.contracts import EnvSample  # noqa: E402
from nrl_core.plugins import get_plugin_manager  # noqa: E402
from nrl_env_math.dapo import normalize_answer, stated_answer, verify_response  # noqa: E402
from nrl_env_math.multi_reward import MathMultiRewardEnvironment, answer_of, is_formatted  # noqa: E402


@pytest.mark.parametrize("answer, normal", [
    ("x = 12", "12"), ("$\\frac{1}{2}$", "\\frac{1}{2}"), ("\\fracab", "\\frac{a}{b}"), ("1,000", "1000"),
    ("12 degrees", "12"), ("\\text{(A)}", "(A)"), ("\\boxed{7}", "7"), ("5 dollars", "5"), ("\\sqrt2", "\\sqrt{2}"),
])
def test_dapo_normalisation(answer, normal):
    assert normalize_answer(answer) == normal


@pytest.mark.parametrize("response, truth, correct", [
    ("so the total is 4.\nAnswer: 12", "12", True),
    ("Answer: 3\nwait, no.\nAnswer: $1,000$", "1000", True),
    ("answer : x = 7 ", "7", True),
    ("The answer is \\boxed{12}", "12", False),  # no 'Answer:' line: DAPO's rule is strict
    ("Answer: 13", "12", False),
    ("Answer: 12" + " padding" * 100, "12", False),  # the answer line fell out of the last 300 characters
])
def test_dapo_verifier(response, truth, correct):
    assert verify_response(response, truth) is correct


def test_dapo_reads_only_the_tail():
    assert stated_answer("Answer: 1\n" + "x" * 400) is None


def test_dapo_and_multi_reward_environments_are_registered():
    environments = get_plugin_manager().environments()
    assert environments.owner("dapo") == environments.owner("math_multi_reward") == environments.owner("math")


@pytest.mark.parametrize("response, correctness, integer, formatted", [
    ("<think>2+2</think>\n<answer>4</answer>", 1.0, 1.0, 1.0),
    ("<think>hmm</think>\n<answer> 4 </answer>", 1.0, 1.0, 1.0),
    ("<think>a</think><answer>4</answer>", 1.0, 1.0, 0.0),  # no newline between the blocks
    ("<think>a</think>\n<answer>four</answer>", 0.0, 0.0, 1.0),
    ("<think>a</think>\n<answer>4</answer><answer>4</answer>", 1.0, 1.0, 0.0),  # two answers
    ("<think>a</think>\n<answer>4</answer> trailing", 1.0, 1.0, 0.0),
    ("4", 1.0, 1.0, 0.0),  # no tags: the whole response is the answer (NeMo RL's split)
    ("<answer>-4</answer>", 0.0, 0.0, 0.0),
])
def test_multi_reward_components(response, correctness, integer, formatted):
    result = MathMultiRewardEnvironment({}).score([EnvSample(prompt="", response=response,
                                                              metadata={"ground_truth": "4"})])
    assert result.components == {"correctness": [correctness], "integer": [integer], "format": [formatted]}
    assert result.rewards == [correctness + integer + formatted]


def test_multi_reward_metrics_and_the_think_prefix_rule():
    assert answer_of("<answer>1</answer> and <answer>2</answer>") == "2"
    assert not is_formatted("<think></think>\n<answer>1</answer>"[7:])
    assert is_formatted("<think></think>\n<answer>1</answer>")
    result = MathMultiRewardEnvironment({"num_workers": 8}).score(
        [EnvSample(prompt="", response=r, metadata={"ground_truth": "1"}) for r in ("<answer>1</answer>", "2")])
    assert result.metrics["accuracy"] == 0.5 and result.metrics["reward/integer"] == 1.0
