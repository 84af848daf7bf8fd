"""The math environment (distribution nrl-env-math), installed and discovered through its entry point.

One local Ray per module and two environments (a healthy one with two workers, and one whose
verifier misbehaves on marker responses) keep the Ray start-up cost paid once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

pytest.importorskip("nrl_env_math")

from nrl_core.contracts import EnvironmentSpec, EnvSample, import_object  # noqa: E402
from nrl_core.errors import ConfigError, WorkerError  # noqa: E402
from nrl_env_math.verify import extract_answer, verify_response  # noqa: E402
from tests.launch import driving_the_shared_ray  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def samples(*pairs: tuple[str, str]) -> list[EnvSample]:
    return [EnvSample(prompt="What is it?", response=r, metadata={"ground_truth": g}) for r, g in pairs]


@pytest.fixture(scope="module")
def ray_session():
    from nrl_core.cluster import init_ray

    with driving_the_shared_ray():
        init_ray({})  # forwards the repo root on PYTHONPATH, so workers import tests.plugins
        yield


@pytest.fixture(scope="module")
def env(ray_session):
    from nrl_env_math.environment import MathEnvironment

    e = MathEnvironment({"num_workers": 2, "timeout_seconds": 2.0})
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def faulty_env(ray_session):
    from nrl_env_math.environment import MathEnvironment

    e = MathEnvironment({"num_workers": 1, "timeout_seconds": 0.5, "hang_grace_seconds": 2.0,
                         "verifier": "tests.plugins.math_verifiers:misbehave_on_marker"})
    yield e
    e.shutdown()


# ---------------------------------------------------------------- extraction (no Ray)


@pytest.mark.parametrize("response, answer", [
    ("19", "19"),
    ("12 + 7 = 19", "19"),
    ("The answer is \\boxed{19}.", "19"),
    ("first \\boxed{3} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{12} and later 99", "12"),
    ("about 1,234 apples", "1234"),
    ("it is -5", "-5"),
    ("no digits here", None),
])
def test_extract_answer(response, answer):
    assert extract_answer(response) == answer


def test_verify_is_mathematical_not_textual():
    assert verify_response("\\boxed{\\frac{1}{2}}", "0.5")
    assert verify_response("so 0.5", "1/2")
    assert verify_response("\\boxed{19}", "\\boxed{19}")  # an SFT-style ground truth
    assert not verify_response("20", "19")
    assert not verify_response("", "19")


# ---------------------------------------------------------------- discovery


def test_entry_point_lists_math():
    proc = subprocess.run([sys.executable, "-m", "nrl_core.cli", "plugins", "--json"], capture_output=True, text=True,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    plugins = {p["name"]: p for p in json.loads(proc.stdout)}
    assert plugins["math"] == {"name": "math", "distribution": "nrl-env-math", "version": version("nrl-env-math"),
                               "hooks": ["nrl_environments"], "contract": 14}


def test_spec_and_schema_reach_the_config():
    from nrl_core.config.validate import build_schema
    from nrl_core.plugins import get_plugin_manager

    spec = get_plugin_manager().environments().get("math", "env.math")
    assert isinstance(spec, EnvironmentSpec) and spec.distribution == "nrl-env-math"
    assert import_object(spec.environment).__name__ == "MathEnvironment"
    env_section = build_schema(get_plugin_manager()).subsection("env")
    assert env_section.validate({"math": {"num_workers": 4}}, "env")["math"]["num_workers"] == 4
    with pytest.raises(ConfigError, match=r"^env\.math\.num_workrs: unknown key; did you mean 'num_workers'\?"):
        env_section.validate({"math": {"num_workrs": 4}}, "env")


def test_bad_values_are_one_line_config_errors():
    from nrl_env_math.environment import MathEnvironment

    with pytest.raises(ConfigError, match=r"^env\.math\.num_workers: must be > 0, got 0$"):
        MathEnvironment({"num_workers": 0})


# ---------------------------------------------------------------- scoring in Ray workers


def test_scores_correct_incorrect_boxed_and_last_number(env):
    result = env.score(samples(
        ("19", "19"),
        ("The answer is \\boxed{19}", "19"),
        ("12 + 7 = 19", "19"),
        ("\\boxed{20}", "19"),
        ("I think 19, no wait, 18", "19"),
        ("no idea", "19"),
        ("-5", "-5"),
    ))
    assert result.rewards == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert result.metrics["accuracy"] == pytest.approx(4 / 7)
    assert result.metrics["no_answer"] == 1.0
    assert result.metrics["timeouts"] == 0.0 and result.metrics["num_samples"] == 7.0


def test_rewards_come_from_the_config(ray_session):
    from nrl_env_math.environment import MathEnvironment

    e = MathEnvironment({"reward_correct": 2.0, "reward_incorrect": -1.0})
    try:
        assert e.score(samples(("7", "7"), ("8", "7"))).rewards == [2.0, -1.0]
        assert e.score([]).rewards == []
    finally:
        e.shutdown()


def test_model_output_is_never_executed(env, tmp_path):
    target = tmp_path / "pwned"
    code = f"__import__('os').system('touch {target}')"
    result = env.score(samples(
        (code, "42"),
        (f"\\boxed{{{code}}}", "42"),
        (f"eval(\"{code}\")", "42"),
        (f"exec(\"import os; os.system('touch {target}')\")", "42"),
    ))
    assert not target.exists()
    assert result.rewards == [0.0, 0.0, 0.0, 0.0]


def test_a_slow_sample_times_out_alone(env):
    # Really slow in sympy: the alarm interrupts it, the sample scores as incorrect and is counted.
    result = env.score(samples(("\\boxed{9^{9^{9}}}", "1"), ("3", "3"), ("4", "4")))
    assert result.rewards == [0.0, 1.0, 1.0]
    assert result.metrics["timeouts"] == 1.0


def test_a_crashed_worker_is_named_and_replaced(faulty_env):
    with pytest.raises(WorkerError, match=r"^env\.math: verifier worker math-verifier\[0\] pid \d+ died while scoring "
                                          r"2 samples") as info:
        faulty_env.score(samples(("1", "1"), ("CRASH", "1")))
    assert "\n" not in str(info.value)
    assert faulty_env.score(samples(("1", "1"))).rewards == [1.0]  # a fresh worker took its place


def test_a_hung_worker_is_named_killed_and_replaced(faulty_env):
    with pytest.raises(WorkerError, match=r"^env\.math: verifier worker math-verifier\[0\] pid \d+ hung: no answer "
                                          r"for 1 samples within 2\.5 s"):
        faulty_env.score(samples(("HANG", "1")))
    assert faulty_env.score(samples(("2", "2"))).rewards == [1.0]


def test_the_dapo_environment_scores_with_dapo_s_verifier_in_its_workers(ray_session):
    from nrl_env_math.environment import DapoMathEnvironment

    env = DapoMathEnvironment({"num_workers": 1})
    try:
        result = env.score(samples(("Answer: 1,000", "1000"), ("\\boxed{1000}", "1000")))
    finally:
        env.shutdown()
    assert env.config["verifier"] == "nrl_env_math.dapo:verify_response"
    assert result.rewards == [1.0, 0.0]  # math-verify would accept the boxed answer; DAPO's rule does not
