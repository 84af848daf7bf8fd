"""Reward scaling, DAPO's overlong shaping and the stop-properly penalty against NeMo RL's own
cases (tests/unit/algorithms/test_reward_functions.py at 7ea279a: their numbers, not their code),
and dynamic sampling's selection rule."""

from __future__ import annotations

import re

import pytest

from nrl_core.algorithms.rewards import has_spread, scale_rewards, shape_rewards, shaping_problem

SCALING_OFF = {"enabled": False, "source_min": 0.0, "source_max": 1.0, "target_min": 0.0, "target_max": 1.0}


def scaling(**keys):
    return {**SCALING_OFF, "enabled": True, **keys}


def shaping(**keys):
    return {"enabled": True, "overlong_buffer_length": 128, "overlong_buffer_penalty": 1.0,
            "stop_properly_penalty_coef": None, **keys}


@pytest.mark.parametrize("rewards, keys, expected", [
    ([1.0, 0.5, 0.8], None, [1.0, 0.5, 0.8]),  # test_reward_scaling_disabled
    ([1.0, 0.5, 0.8], {"target_max": 0.7}, [0.7, 0.35, 0.56]),  # test_reward_scaling_base
    ([1.0, 0.0, 0.0, 1.0, 0.0], {"target_min": -1.0}, [1.0, -1.0, -1.0, 1.0, -1.0]),  # test_reward_scaling_dapo
    ([-2.8, -0.25, 1.5, 0.5, 2.0, 2.5], {"source_min": -2.0, "source_max": 2.0, "target_min": -1.0},
     [-1.0, -0.125, 0.75, 0.25, 1.0, 1.0]),  # test_reward_scaling_clipping
])
def test_reward_scaling(rewards, keys, expected):
    cfg = SCALING_OFF if keys is None else scaling(**keys)
    assert scale_rewards(rewards, cfg) == pytest.approx(expected)


@pytest.mark.parametrize("lengths, rewards, penalty, expected", [
    ([10, 15, 18], [1.0, 0.5, 0.8], 1.0, [1.0, 0.5, 0.8]),  # test_reward_shaping_no_penalties
    ([10, 22, 25, 30], [1.0, 0.8, 0.6, 0.4], 0.5, [1.0, 0.6, 0.1, -0.6]),  # test_reward_shaping_with_penalties
])
def test_dapo_overlong_shaping(lengths, rewards, penalty, expected):
    # max_response_length 25, buffer 5: responses over 20 tokens lose penalty x excess / 5
    cfg = shaping(overlong_buffer_length=5, overlong_buffer_penalty=penalty)
    assert shape_rewards(rewards, lengths, [False] * len(rewards), cfg, 25) == pytest.approx(expected)


def test_shaping_disabled_changes_nothing():
    # test_reward_shaping_disabled
    cfg = shaping(enabled=False, overlong_buffer_length=5, overlong_buffer_penalty=0.1)
    assert shape_rewards([1.0, 0.5, 0.8], [10, 20, 30], [False] * 3, cfg, 25) == [1.0, 0.5, 0.8]


@pytest.mark.parametrize("coef, expected", [(0.5, [1.0, 0.25, 0.8]), (0.0, [1.0, 0.0, 0.8]), (1.0, [1.0, 0.5, 0.8])])
def test_stop_properly_penalty_scales_truncated_rewards_and_ignores_the_overlong_keys(coef, expected):
    # test_stop_properly_penalty, test_stop_properly_penalty_boundary_coefs
    cfg = shaping(stop_properly_penalty_coef=coef, overlong_buffer_length=1)
    assert shape_rewards([1.0, 0.5, 0.8], [100, 100, 100], [False, True, False], cfg, 10) == pytest.approx(expected)


@pytest.mark.parametrize("keys, message", [
    ({"stop_properly_penalty_coef": 1.5}, "grpo.reward_shaping.stop_properly_penalty_coef: must be in \\[0, 1\\]"),
    ({"stop_properly_penalty_coef": -0.1}, "grpo.reward_shaping.stop_properly_penalty_coef"),
    ({"overlong_buffer_length": None}, "grpo.reward_shaping.overlong_buffer_length: must be a positive number"),
])
def test_inconsistent_shaping_is_one_line(keys, message):
    # test_stop_properly_penalty_error_cases, test_reward_shaping_missing_config_values
    problem = shaping_problem({"reward_shaping": shaping(**keys), "reward_scaling": SCALING_OFF})
    assert problem is not None and re.match(message, ": ".join(problem))


def test_scaling_needs_a_source_range():
    problem = shaping_problem({"reward_shaping": {**shaping(), "enabled": False},
                               "reward_scaling": scaling(source_min=1.0, source_max=1.0)})
    assert problem == ("grpo.reward_scaling.source_max", "1.0 must exceed source_min 1.0")


def test_dynamic_sampling_keeps_groups_whose_rewards_differ():
    assert has_spread([0.0, 1.0, 0.0]) and not has_spread([1.0, 1.0]) and not has_spread([0.5])


def test_dynamic_sampling_filters_on_the_reward_before_shaping():
    # test_dapo_dynamic_sampling_filters_on_raw_metric_after_overlong_shaping: all answers wrong,
    # different lengths; shaping makes the rewards differ, the task metric does not.
    task = [0.0, 0.0, 0.0, 0.0]
    shaped = shape_rewards(task, [10, 22, 25, 30], [False] * 4, shaping(overlong_buffer_length=5), 25)
    assert has_spread(shaped) and not has_spread(task)
