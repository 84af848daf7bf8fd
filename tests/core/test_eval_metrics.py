"""pass@k and majority vote (nrl_core/evaluation/metrics.py) against their definitions."""

from __future__ import annotations

import math
import random
from itertools import combinations

import pytest

from nrl_core.evaluation.metrics import (
    MAX_SUBSETS,
    Score,
    majority_at_k,
    pass_at_k,
    problem_majority_at_k,
    problem_pass_at_k,
)


def test_pass_at_k_is_the_chance_a_k_subset_holds_a_correct_sample():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 9)
        correct = [rng.random() < 0.4 for _ in range(n)]
        k = rng.randint(1, n)
        subsets = list(combinations(range(n), k))
        by_definition = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
        assert problem_pass_at_k(correct, k) == pytest.approx(by_definition, abs=1e-12)


def test_pass_at_1_is_the_fraction_correct_and_pass_at_n_any_correct():
    assert problem_pass_at_k([True, False, False, True], 1) == 0.5
    assert problem_pass_at_k([False, False, True], 3) == 1.0
    assert problem_pass_at_k([False, False, False], 3) == 0.0


def test_the_standard_error_is_over_problems():
    score = pass_at_k([[True], [False], [True], [True]], 1)
    assert score.value == 0.75 and score.problems == 4
    assert score.stderr == pytest.approx(math.sqrt(0.25 / 4))  # sample variance 1/4 of 0,1 values with mean 3/4
    assert Score.of([0.5]).stderr == 0.0


def test_majority_vote_counts_no_answer_as_a_vote_and_breaks_ties_by_the_first_answer():
    answers, rewards = ["7", "5", "7", None, None, None], [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert problem_majority_at_k(answers, rewards, 6) == 0.0  # None has three votes, "7" two
    assert problem_majority_at_k(["5", "7"], [0.0, 1.0], 2) == 0.0  # a tie: the first answer
    assert problem_majority_at_k(["7", "5"], [1.0, 0.0], 2) == 1.0
    assert problem_majority_at_k(["7", "5", "7"], [1.0, 0.0, 1.0], 1) == pytest.approx(2 / 3)  # k=1: mean reward


def test_majority_vote_over_subsets_by_definition():
    answers, rewards = ["a", "b", "a", "c", "b"], [1.0, 0.0, 1.0, 0.0, 0.0]
    subsets = list(combinations(range(5), 3))
    expected = 0.0
    for s in subsets:
        picked = [answers[i] for i in s]
        winner = max(picked, key=lambda a: (picked.count(a), -picked.index(a)))
        expected += rewards[s[picked.index(winner)]]
    assert problem_majority_at_k(answers, rewards, 3) == pytest.approx(expected / len(subsets))
    assert majority_at_k([answers, answers], [rewards, rewards], 3).value == pytest.approx(expected / len(subsets))


def test_bad_k_and_too_many_subsets_are_one_line():
    with pytest.raises(ValueError, match="k must be between 1 and the samples per problem"):
        problem_pass_at_k([True, False], 3)
    n = 40
    assert math.comb(n, 20) > MAX_SUBSETS
    with pytest.raises(ValueError, match="lower k or the samples per problem"):
        problem_majority_at_k(["x"] * n, [1.0] * n, 20)
