"""The code environment (nrl-env-code) on the real sandbox: extraction, rewards (fraction and
all-or-nothing), per-test timeouts, results in the metadata, hostile programs scoring 0 while the
batch goes on, the multi-turn protocol (step by step and through the core's episode player), the
Ray pool, one-line errors for bad configs and a missing layer, the generated tasks and their SFT
targets. Nothing is skipped: a machine without a sandbox layer fails here."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from nrl_core.contracts import EnvSample, Episode
from nrl_core.errors import ConfigError, NrlError, WorkerError
from nrl_env_code.data import code_processor, code_sft_processor, code_splits, fenced
from nrl_env_code.environment import CodeEnvironment, CodeMultiTurnEnvironment, observation
from nrl_env_code.extract import extract_code
from nrl_env_code.sandbox import SandboxUnavailable

UID = 1999994 - int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)  # one per worker, apart from the other sandbox modules
SANDBOX = {"uid": UID, "cpu_seconds": 5, "memory_mb": 256}
ADD = "a, b = map(int, input().split())\nprint(a + b)"
STDIO = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -14\n", "output": "-4"}, {"input": "0 0", "output": "0\n"}]
ASSERTS = [{"assert": "assert f(1) == 3"}, {"assert": "assert f(5) == 15"}]


def block(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```\n"


@pytest.fixture(scope="module")
def env() -> Any:
    e = CodeEnvironment({"num_workers": 0, "timeout_seconds": 3.0, "sandbox": SANDBOX})
    yield e
    e.shutdown()


def scores(env: CodeEnvironment, *pairs: tuple[str, Any]) -> list[float]:
    return env.score([EnvSample(prompt="p", response=r, metadata={"tests": t}) for r, t in pairs]).rewards


# --------------------------------------------------------------------------- extraction


def test_the_last_python_block_is_the_program():
    assert extract_code("```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("```python\nprint(4)\n```\n```bash\nrm -rf /\n```") == "print(4)\n"  # not Python
    assert extract_code("<code>print(5)</code> then ```python\nprint(6)\n```") == "print(6)\n"
    assert extract_code("```python\nprint(7)\n``` then <code>print(8)</code>") == "print(8)\n"  # NeMo RL's tags
    assert extract_code("```python\nprint(9)\n") == "print(9)\n"  # cut off inside its block
    assert extract_code("print(10)") is None and extract_code("```python\n\n```") is None


# --------------------------------------------------------------------------- rewards


def test_correct_wrong_and_partial_programs_get_their_fraction(env):
    wrong_sign = "a, b = map(int, input().split())\nprint(abs(a + b))"  # passes 2 of 3
    assert scores(env, (block(ADD), STDIO), (block("print(3)"), STDIO), (block(wrong_sign), STDIO),
                  ("no code at all", STDIO), (block("def f(x):\n    return 3 * x"), ASSERTS),
                  (block("def f(x):\n    return x + 2"), ASSERTS)) == [1.0, 1 / 3, 2 / 3, 0.0, 1.0, 0.5]


def test_all_or_nothing_pays_only_when_every_test_passes():
    strict = CodeEnvironment({"num_workers": 0, "reward_mode": "all_or_nothing", "sandbox": SANDBOX})
    wrong_sign = "a, b = map(int, input().split())\nprint(abs(a + b))"
    assert scores(strict, (block(ADD), STDIO), (block(wrong_sign), STDIO)) == [1.0, 0.0]


def test_exiting_before_the_assertions_is_not_a_pass(env):
    tests = [{"assert": "assert f(1) == 99"}]
    assert scores(env, (block("import sys\nsys.exit(0)"), tests), (block("import os\nos._exit(0)"), tests),
                  (block("raise SystemExit(0)"), tests), (block("print('ok')\nimport os\nos._exit(0)"), tests)) == [0.0] * 4


def test_other_test_shapes_mbpp_and_apps(env):
    mbpp = {"test_list": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"], "test_setup_code": "import math"}
    apps = {"input_output": json.dumps({"inputs": ["2 3\n", "4 4\n"], "outputs": ["5\n", "8\n"]})}
    rewards = env.score([EnvSample(prompt="p", response=block("def add(a, b):\n    return a + b"), metadata=mbpp),
                         EnvSample(prompt="p", response=block(ADD), metadata=apps)]).rewards
    assert rewards == [1.0, 1.0]


def test_each_test_has_its_own_timeout_and_results_keep_stderr(env):
    code = "n = int(input())\nif n == 0:\n    while True:\n        pass\nprint(10 // n)"
    tests = [{"input": "5", "output": "2"}, {"input": "0", "output": "0", "timeout": 0.5}, {"input": "x", "output": "1"}]
    [evaluation] = env.evaluate([block(code)], [{"tests": tests}])
    assert [r.status for r in evaluation.results] == ["passed", "wall_time", "error"]
    assert evaluation.score == pytest.approx(1 / 3)
    assert "ValueError: invalid literal for int()" in evaluation.results[2].stderr
    assert evaluation.results[1].seconds < 3.0  # its own 0.5 s, not the environment's 3 s
    assert json.dumps(evaluation.metadata())  # the episode's state must stay JSON


def test_hostile_programs_score_zero_and_the_batch_goes_on(env):
    hostile = ["while True:\n    pass", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
               "x = bytearray(1 << 34)", "open('/etc/passwd', 'a').write('x')",
               "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
               "import os\nos.kill(os.getppid(), 9)\nprint(3)"]
    tests = [{"input": "1 2", "output": "3", "timeout": 1.0}]
    result = env.score([EnvSample(prompt="p", response=block(c), metadata={"tests": tests}) for c in hostile]
                       + [EnvSample(prompt="p", response=block(ADD), metadata={"tests": tests})])
    verdicts = result.sample_metadata  # contract 7: logged beside each rollout
    seen = [(m["results"][0]["status"], m["results"][0].get("seconds")) for m in verdicts]  # said when a check fails
    assert result.rewards == [0.0] * len(hostile) + [1.0], seen
    assert result.metrics["limits_hit"] == 2.0 and result.metrics["accuracy"] == pytest.approx(1 / 7), seen
    assert [m["results"][0]["status"] for m in verdicts][:1] == ["wall_time"] and verdicts[-1]["tests_passed"] == 1
    assert "MemoryError" in verdicts[2]["results"][0]["stderr"]


# --------------------------------------------------------------------------- multi-turn


def episode(response: str, turn: int, state: dict[str, Any]) -> Episode:
    return Episode(prompt="p", messages=[{"role": "assistant", "content": response}], metadata=state, turn=turn)


def test_multi_turn_shows_the_interpreter_output_and_ends_when_the_tests_pass():
    env = CodeMultiTurnEnvironment({"num_workers": 0, "max_turns": 4, "sandbox": SANDBOX})
    state: dict[str, Any] = {"tests": STDIO}
    first = env.step([episode(block("a, b = map(int, input().split())\nprint(a + b + 1)"), 1, state)])[0]
    assert not first.done and first.reward == 0.0 and "0/3 tests passed" in first.observation
    assert "expected" not in first.observation and "3\n" not in first.observation.split("stdout:")[0]
    no_code = env.step([episode("let me think", 2, first.metadata)])[0]
    assert (no_code.reward, no_code.done, no_code.metadata) == (0.0, False, None) and "No code block" in no_code.observation
    partial = env.step([episode(block("a, b = map(int, input().split())\nprint(abs(a + b))"), 3, first.metadata)])[0]
    assert partial.reward == pytest.approx(2 / 3) and not partial.done and "stdout:\n4" in partial.observation
    solved = env.step([episode(block(ADD), 4, partial.metadata)])[0]
    assert solved.done and solved.reward == pytest.approx(1 / 3) and solved.metrics["solved"] == 1.0
    assert first.reward + no_code.reward + partial.reward + solved.reward == pytest.approx(1.0)  # the last score


def test_multi_turn_ends_after_max_turns_or_on_evaluation():
    wrong = block("print(0)")
    capped = CodeMultiTurnEnvironment({"num_workers": 0, "max_turns": 2, "sandbox": SANDBOX})
    assert capped.step([episode(wrong, 1, {"tests": STDIO})])[0].done is False
    last = capped.step([episode(wrong, 2, {"tests": STDIO})])[0]
    assert last.done and last.metrics["solved"] == 0.0 and last.observation == ""
    once = CodeMultiTurnEnvironment({"num_workers": 0, "terminate_on_evaluation": True, "sandbox": SANDBOX})
    assert once.step([episode(wrong, 1, {"tests": STDIO})])[0].done


def test_episodes_through_the_core_s_episode_player():
    """``MultiTurnSampler.play`` with an engine that writes a wrong program, then the right one: the
    interpreter's output is appended between the turns and the episode's reward is 1."""
    from transformers import AutoTokenizer

    from nrl_core.algorithms.grpo_config import GRPO
    from nrl_core.algorithms.multi_turn import MultiTurnSampler
    from nrl_core.algorithms.scoring import Scorer
    from nrl_core.contracts import GenerationOutput
    from nrl_core.data.processors import PromptConfig
    from nrl_core.testing.tiny_models import cached_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(str(cached_tiny_model("llama", "small")))
    turns = [block("print(0)"), block(ADD)]

    class ScriptedEngine:
        def generate(self, prompts: list[list[int]], greedy: bool = False) -> GenerationOutput:
            ids = [tokenizer(turns.pop(0), add_special_tokens=False)["input_ids"] for _ in prompts]
            return GenerationOutput(token_ids=ids, logprobs=[[0.0] * len(i) for i in ids],
                                    finish_reasons=["stop"] * len(ids), weight_version=0)

    grpo = GRPO.validate({"max_rollout_turns": 3, "num_generations_per_prompt": 1}, "grpo")
    config = {"grpo": grpo, "policy": {"generation": {"stop_strings": None}, "max_total_sequence_length": 1024}}
    env = CodeMultiTurnEnvironment({"num_workers": 0, "sandbox": SANDBOX})
    sampler = MultiTurnSampler(config, ScriptedEngine(), Scorer(config, tokenizer, env), tokenizer, env, 1024)
    prompt = code_processor({"problem": "add", "tests": json.dumps(STDIO)}, 0, tokenizer, PromptConfig())
    [played] = sampler.play([prompt])
    assert (played.turns, played.ended_by) == (2, "environment") and played.reward == pytest.approx(1.0)
    assert [m["role"] for m in played.messages] == ["assistant", "environment", "assistant"]
    assert "1/3 tests passed" in played.messages[1]["content"]  # print(0) passes "0 0"


# --------------------------------------------------------------------------- the pool


def test_the_ray_pool_gives_the_same_results_replaces_a_dead_worker_and_passes_errors_on():
    import ray

    from nrl_core.cluster import init_ray, shutdown_ray

    started = not ray.is_initialized()
    init_ray({"num_cpus": 2})
    pooled = CodeEnvironment({"num_workers": 2, "timeout_seconds": 10.0, "sandbox": SANDBOX})  # a loaded host
    try:
        loop = [{"input": "", "output": "", "timeout": 0.5}]
        pairs = [pair for i in range(4) for pair in ((block(f"{ADD}  # {i}"), STDIO), (block(f"print(3)  # {i}"), STDIO),
                                                     (block(f"while True:  # {i}\n    pass"), loop))]
        samples = [EnvSample(prompt="p", response=r, metadata={"tests": t}) for r, t in pairs]
        first = pooled.score(samples)
        assert first.rewards == [1.0, 1 / 3, 0.0] * 4 and first.metrics["test_runs"] == 28
        ray.kill(pooled.runner._slots[0].actor, no_restart=True)
        with pytest.raises(WorkerError, match=r"code-sandbox\[0\] pid \d+ failed.*replaced"):
            pooled.score(samples)
        assert pooled.score(samples).rewards == [1.0, 1 / 3, 0.0] * 4  # the fresh worker runs
        with pytest.raises(SandboxUnavailable) as caught:  # raised in a worker, it arrives as the same one line
            CodeEnvironment({"num_workers": 1, "sandbox": {**SANDBOX, "python": "/nonexistent/bin/python3"}})
        assert str(caught.value).startswith("env.code.sandbox: the sandbox layer 'interpreter'")
        assert "\n" not in str(caught.value)
    finally:
        pooled.shutdown()
        if started:
            shutdown_ray()


def test_a_program_repeated_in_a_batch_runs_once_per_test(env):
    result = env.score([EnvSample(prompt="p", response=block(ADD), metadata={"tests": STDIO})] * 8)
    assert result.rewards == [1.0] * 8 and result.metrics["test_runs"] == 3


# --------------------------------------------------------------------------- one-line errors


@pytest.mark.parametrize("section, key", [
    ({"reward_mode": "partial"}, "env.code.reward_mode"),
    ({"timeout_seconds": 0}, "env.code.timeout_seconds"),
    ({"sandbox": {"memroy_mb": 64}}, "env.code.sandbox"),
    ({"num_workers": -1}, "env.code.num_workers"),
])
def test_a_bad_config_is_one_line_naming_the_key(section, key):
    with pytest.raises(ConfigError) as caught:
        CodeEnvironment({**section, "num_workers": section.get("num_workers", 0)})
    assert str(caught.value).startswith(key) and "\n" not in str(caught.value)


def test_a_layer_the_machine_cannot_provide_is_one_line_naming_it():
    with pytest.raises(SandboxUnavailable) as caught:
        CodeEnvironment({"num_workers": 0, "sandbox": {**SANDBOX, "python": "/nonexistent/bin/python3"}})
    message = str(caught.value)
    assert "layer 'interpreter'" in message and "sandbox.python" in message and "\n" not in message
    assert isinstance(caught.value, NrlError)  # the CLI prints it as one line, exit 2


# --------------------------------------------------------------------------- the tasks


def test_generated_tasks_are_seeded_and_their_solutions_pass_in_the_sandbox(env):
    train, val = code_splits(num_train=15, num_val=5, seed=3)
    assert (len(train), len(val)) == (15, 5) and code_splits(num_train=15, num_val=5, seed=3)[0] == train
    assert {r["family"] for r in train} == {"pair", "scale", "string", "series", "function"}
    result = env.score([EnvSample(prompt=r["problem"], response=r["expected_answer"],
                                  metadata={"tests": r["tests"]}) for r in train])
    assert result.rewards == [1.0] * len(train)
    constant = env.score([EnvSample(prompt="p", response=block("print(42)"), metadata={"tests": r["tests"]})
                          for r in train if r["family"] != "function"])
    assert max(constant.rewards) < 1.0  # tests draw their numbers, so no constant passes them all
    with pytest.raises(ConfigError, match="data.generate.families"):
        code_splits(families=["sorting"])


def test_processors_put_the_tests_in_metadata_and_the_solution_in_the_sft_target():
    from transformers import AutoTokenizer

    from nrl_core.data.processors import PromptConfig
    from nrl_core.testing.tiny_models import cached_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(str(cached_tiny_model("llama", "small")))
    record = code_splits(num_train=1, num_val=0, seed=1)[0][0]
    prompt = code_processor(record, 0, tokenizer, PromptConfig())
    sft = code_sft_processor(record, 0, tokenizer, PromptConfig())
    assert prompt.metadata["tests"] == json.loads(record["tests"]) and sft.metadata["tests"] == prompt.metadata["tests"]
    assert sft.prompt_ids == prompt.prompt_ids and record["problem"] in prompt.prompt_text
    target = tokenizer.decode(sft.response_ids, skip_special_tokens=True).strip()
    assert target == record["expected_answer"] and target.startswith("```python\n") and fenced("x") == "```python\nx\n```"
    assert extract_code(target) is not None


def test_the_observation_lists_each_test_and_the_first_failure():
    from nrl_env_code.checks import TestResult
    from nrl_env_code.environment import Evaluation

    failing = TestResult(kind="stdio", passed=False, status="error", exit_code=1, stdout="", stderr="Boom", seconds=0.1)
    passing = TestResult(kind="stdio", passed=True, status="passed", exit_code=0, stdout="3", stderr="", seconds=0.1)
    text = observation(Evaluation(code="x", results=[passing, failing], score=0.5))
    assert text == "\n<output>\n1/2 tests passed\ntest 1: passed\ntest 2: error\nstderr:\nBoom\n</output>\n"
