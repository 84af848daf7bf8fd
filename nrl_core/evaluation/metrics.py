"""Scores of n samples per problem: pass@k and majority-vote accuracy, each with its standard error.

pass@k is the unbiased estimator of Chen et al. (2021): from n samples of which c are correct, the
chance that k drawn without replacement hold a correct one, ``1 - C(n-c, k) / C(n, k)``. Majority
vote at k (NeMo RL's ``cons@k``) averages, over every k-subset of the n samples, the reward of the
answer most of the subset gave (ties go to the answer given first; no answer, ``None``, is a vote
like any other, as in NeMo RL), so it too uses all n samples.
Both are means over problems; the standard error is the problems' standard deviation over the
square root of their number, the uncertainty from which problems were drawn.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import combinations

__all__ = ["MAX_SUBSETS", "Score", "majority_at_k", "pass_at_k", "problem_pass_at_k", "problem_majority_at_k"]

MAX_SUBSETS = 200_000
"""Most k-subsets one problem's majority vote enumerates; more is refused (lower k or n)."""


@dataclass(frozen=True)
class Score:
    """A mean over problems with its standard error (0 for a single problem)."""

    value: float
    stderr: float
    problems: int

    @staticmethod
    def of(per_problem: Sequence[float]) -> Score:
        n = len(per_problem)
        if n == 0:
            raise ValueError("no problems to score")
        mean = sum(per_problem) / n
        if n == 1:
            return Score(mean, 0.0, 1)
        variance = sum((x - mean) ** 2 for x in per_problem) / (n - 1)
        return Score(mean, math.sqrt(variance / n), n)


def problem_pass_at_k(correct: Sequence[bool], k: int) -> float:
    """One problem's unbiased pass@k from its samples' correctness."""
    n, c = len(correct), sum(bool(x) for x in correct)
    _check_k(n, k)
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def problem_majority_at_k(answers: Sequence[Hashable | None], rewards: Sequence[float], k: int) -> float:
    """One problem's majority vote at k: over every k-subset, the reward of the subset's most
    frequent answer."""
    n = len(answers)
    _check_k(n, k)
    if len(rewards) != n:
        raise ValueError(f"{n} answers but {len(rewards)} rewards")
    subsets = math.comb(n, k)
    if subsets > MAX_SUBSETS:
        raise ValueError(f"majority vote at k={k} of n={n} samples enumerates {subsets} subsets "
                         f"(at most {MAX_SUBSETS}); lower k or the samples per problem")
    total = 0.0
    for subset in combinations(range(n), k):
        total += rewards[_majority(answers, subset)]
    return total / subsets


def _majority(answers: Sequence[Hashable | None], subset: Sequence[int]) -> int:
    """The index in ``subset`` of the first sample that gave the subset's most frequent answer."""
    votes = Counter(answers[i] for i in subset)
    top = max(votes.values())
    return next(i for i in subset if votes[answers[i]] == top)


def pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> Score:
    """pass@k over problems, each a sequence of its samples' correctness."""
    return Score.of([problem_pass_at_k(c, k) for c in correct])


def majority_at_k(answers: Sequence[Sequence[Hashable | None]], rewards: Sequence[Sequence[float]], k: int) -> Score:
    """Majority-vote accuracy at k over problems."""
    if len(answers) != len(rewards):
        raise ValueError(f"{len(answers)} problems of answers but {len(rewards)} of rewards")
    return Score.of([problem_majority_at_k(a, r, k) for a, r in zip(answers, rewards)])


def _check_k(n: int, k: int) -> None:
    if k < 1 or k > n:
        raise ValueError(f"k must be between 1 and the samples per problem ({n}), got {k}")
