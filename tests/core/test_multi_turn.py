"""Multi-turn episodes on a real engine (nrl-gen-hf on the tiny Llama, in process): the tokens
trained on are exactly the tokens sampled plus the environment's, token by token; the loss mask
is 1 on sampled tokens only; episodes end when the environment says so, at the context limit (the
last observation cut to fit) or after the turn limit; rewards add up over turns; stop strings end
a turn; observations given as messages go through the chat template."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("nrl_gen_hf")

from nrl_core.algorithms.multi_turn import MultiTurnSampler, cut_at_stop  # noqa: E402
from nrl_core.algorithms.rollout_sources import SingleTurnSampler, validates_greedily  # noqa: E402
from nrl_core.algorithms.rollouts import rollout_batch  # noqa: E402
from nrl_core.algorithms.scoring import Scorer, merge_groups, merged_loss_masks  # noqa: E402
from nrl_core.contracts import EnvResult, EnvSample, EnvStep, Episode, GenerationOutput  # noqa: E402
from nrl_core.data import DatumSpec  # noqa: E402
from nrl_core.errors import NrlError  # noqa: E402
from nrl_core.testing.conformance import scenarios  # noqa: E402
from nrl_core.testing.tiny_models import cached_tiny_model  # noqa: E402

MAX_NEW = 6


@pytest.fixture(scope="module")
def setup() -> tuple[Any, Any, dict[str, Any]]:
    from transformers import AutoTokenizer

    from nrl_gen_hf.worker import HFGenerationWorker

    model = cached_tiny_model("llama", "small")
    config = scenarios.conformance_config(
        "dtensor", str(model), overrides=["policy.generation.backend=hf", f"policy.generation.max_new_tokens={MAX_NEW}",
                                          "policy.max_total_sequence_length=96", "policy.generation.temperature=1.0"])
    if "grpo" not in config:
        from nrl_core.algorithms.grpo_config import GRPO

        config["grpo"] = GRPO.validate({}, "grpo")
    config["grpo"].update(num_generations_per_prompt=2, max_rollout_turns=3, val_batch_size=4)
    return HFGenerationWorker(config), AutoTokenizer.from_pretrained(str(model)), config


class RecordingEngine:
    """The real engine, with every call's inputs and outputs kept for the test to compare."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: list[tuple[list[list[int]], Any]] = []
        self.greedy: list[bool] = []

    def generate(self, prompts: list[list[int]], greedy: bool = False) -> Any:
        out = self.engine.generate(prompts, greedy=greedy)
        self.calls.append(([list(p) for p in prompts], out))
        self.greedy.append(greedy)
        return out

    def prepare(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def sampling_states(self) -> list[dict[str, int]]:
        return [self.engine.sampling_state()]

    def load_sampling_states(self, states: list[dict[str, int]]) -> None:
        self.engine.load_sampling_state(states[0])


class TalkingEnvironment:
    """Answers every turn with ``obs<turn>;``, 0.25 per turn, done after ``done_at`` turns."""

    def __init__(self, done_at: int = 2, messages: bool = False) -> None:
        self.done_at = done_at
        self.messages = messages
        self.seen: list[list[Episode]] = []

    def step(self, episodes: list[Episode]) -> list[EnvStep]:
        self.seen.append(episodes)
        steps = []
        for e in episodes:
            text = f"obs{e.turn};"
            observation: Any = [{"role": "user", "content": text}] if self.messages else text
            steps.append(EnvStep(observation=observation, reward=0.25, done=e.turn >= self.done_at,
                                 metadata={**e.metadata, "turns_seen": e.turn}, components={"step": 1.0},
                                 metrics={"calls": 1.0}))
        return steps

    def shutdown(self) -> None:
        pass


def prompts(tokenizer: Any, n: int = 2) -> list[DatumSpec]:
    texts = ["Q: What is 3 + 4?\nA:", "Q: What is 40 - 2?\nA:", "Q: What is 9 + 9?\nA:"][:n]
    return [DatumSpec(idx=i, prompt_text=t, prompt_ids=tokenizer(t).input_ids, metadata={"k": i})
            for i, t in enumerate(texts)]


def sampler(setup: Any, env: Any, max_length: int = 96, **grpo: Any) -> tuple[MultiTurnSampler, RecordingEngine]:
    engine, tokenizer, config = setup
    config = {**config, "grpo": {**config["grpo"], **grpo}}
    recording = RecordingEngine(engine)
    return MultiTurnSampler(config, recording, Scorer(config, tokenizer, env), tokenizer, env, max_length), recording


@pytest.mark.parametrize("val_temperature, greedy", [(None, False), (1.0, False), (0.0, True)])
def test_validation_samples_as_training_does_unless_val_temperature_is_zero(setup, val_temperature, greedy):
    engine, tokenizer, config = setup
    generation = {**config["policy"]["generation"], "val_temperature": val_temperature}
    config = {**config, "policy": {**config["policy"], "generation": generation}}
    assert validates_greedily(generation) is greedy
    recording = RecordingEngine(engine)
    env = TalkingEnvironment(done_at=2)
    mt = MultiTurnSampler(config, recording, Scorer(config, tokenizer, env), tokenizer, env, 96)
    rewards, records = mt.validate(prompts(tokenizer))
    assert recording.greedy == [greedy, greedy] and rewards == [0.5, 0.5] and len(records) == 2


@pytest.mark.parametrize("turns", [1, 2])
def test_validation_leaves_the_samples_training_draws_next_as_they_were(setup, turns):
    """A validation between two training calls (sampled, multi-turn or single-turn) leaves the
    engine's sampling position where it was, so the next training call samples the same tokens as
    without it: a run extended after its end-of-run validation continues as the unbroken run."""
    engine, tokenizer, config = setup
    env = TalkingEnvironment(done_at=turns)
    train = [d.prompt_ids for d in prompts(tokenizer, 3)]
    position = engine.sampling_state()
    unvalidated = engine.generate(train).token_ids
    engine.load_sampling_state(position)
    if turns == 1:
        scored = SimpleNamespace(score=lambda samples: EnvResult(rewards=[0.5] * len(samples)))
        validation = SingleTurnSampler(RecordingEngine(engine), Scorer(config, tokenizer, scored), 1, 2)
    else:
        validation, _ = sampler(setup, env)
    rewards, _ = validation.validate(prompts(tokenizer))
    assert len(rewards) == 2
    assert engine.sampling_state() == position
    assert engine.generate(train).token_ids == unvalidated


def test_tokens_in_tokens_out_and_the_loss_mask_token_by_token(setup):
    _, tokenizer, _ = setup
    env = TalkingEnvironment(done_at=2)
    mt, recording = sampler(setup, env)
    data = prompts(tokenizer)
    episodes = mt.play(data)
    assert len(recording.calls) == 2  # one generate call per turn, every live episode in it
    for i, episode in enumerate(episodes):
        expected, mask, logprobs, context = [], [], [], list(data[i].prompt_ids)
        for turn, (inputs, out) in enumerate(recording.calls):
            assert inputs[i] == context  # the engine saw exactly what was sampled and observed so far
            sampled = list(out.token_ids[i])
            expected += sampled
            mask += [1.0] * len(sampled)
            logprobs += list(out.logprobs[i])
            context += sampled
            if turn + 1 < env.done_at:
                observed = tokenizer(f"obs{turn + 1};", add_special_tokens=False).input_ids
                expected += observed
                mask += [0.0] * len(observed)
                logprobs += [0.0] * len(observed)
                context += observed
        assert episode.tokens == expected and episode.loss_mask == mask and episode.logprobs == logprobs
        assert episode.ended_by == "environment" and episode.turns == 2
        assert episode.reward == pytest.approx(0.5) and episode.components == {"step": 2.0}
        assert episode.metadata == {"k": i, "turns_seen": 2}
    # the environment saw the decoded responses and its own observations, in order
    last = env.seen[-1][0]
    assert [m["role"] for m in last.messages] == ["assistant", "environment", "assistant"]
    assert last.last_response == tokenizer.decode(recording.calls[1][1].token_ids[0], skip_special_tokens=True)

    # the training batch: environment tokens in the context, never in the loss
    batch = rollout_batch([d.prompt_ids for d in data], merge_output(episodes), pad_token_id=0,
                          loss_masks=[e.loss_mask for e in episodes])
    for row, (d, episode) in enumerate(zip(data, episodes)):
        width = len(d.prompt_ids) + len(episode.tokens)
        assert batch.input_ids[row, :width].tolist() == d.prompt_ids + episode.tokens
        assert batch.fields["token_mask"][row, :width].tolist() == [0.0] * len(d.prompt_ids) + episode.loss_mask


def merge_output(episodes: list[Any]) -> Any:
    from nrl_core.contracts import GenerationOutput

    return GenerationOutput(token_ids=[e.tokens for e in episodes], logprobs=[e.logprobs for e in episodes],
                            finish_reasons=["stop"] * len(episodes), weight_version=0)


def test_groups_sum_rewards_and_carry_masks_and_turn_metrics(setup):
    _, tokenizer, _ = setup
    mt, _ = sampler(setup, TalkingEnvironment(done_at=5), max_rollout_turns=3)
    data = prompts(tokenizer)
    groups, result = mt.groups(data, mt.play([p for p in data for _ in range(2)]))
    assert [g.size for g in groups] == [2, 2] and [g.turns for g in groups] == [[3, 3], [3, 3]]
    assert all(r == pytest.approx(0.75) for g in groups for r in g.task_rewards)  # three turns of 0.25
    assert merged_loss_masks(groups) == [m for g in groups for m in g.loss_masks]
    assert merge_groups(groups).token_ids == [t for g in groups for t in g.output.token_ids]
    assert result.metrics["multi_turn/max_turns_reached_rate"] == 1.0
    assert result.metrics["multi_turn/avg_turns_per_sample"] == 3.0 and result.metrics["calls"] == 1.0
    assert result.metrics["multi_turn/mean_env_tokens_per_sample"] > 0


def test_the_context_limit_cuts_the_last_observation_and_ends_the_episode(setup):
    _, tokenizer, _ = setup
    data = prompts(tokenizer, 1)
    limit = len(data[0].prompt_ids) + MAX_NEW + 2  # one full response, then two tokens of room
    mt, recording = sampler(setup, TalkingEnvironment(done_at=9), max_length=limit, max_rollout_turns=5)
    (episode,) = mt.play(data, greedy=True)
    sampled = len(recording.calls[0][1].token_ids[0])
    if sampled == MAX_NEW:  # the greedy response used its whole budget: the observation must be cut
        assert episode.ended_by == "length" and episode.truncated
        assert episode.context_length == limit and episode.loss_mask[-2:] == [0.0, 0.0]
    assert episode.context_length <= limit and len(recording.calls) <= 2


def test_messages_go_through_the_chat_template_and_stop_strings_end_a_turn(setup):
    _, tokenizer, _ = setup
    mt, recording = sampler(setup, TalkingEnvironment(done_at=2, messages=True))
    (episode, _) = mt.play(prompts(tokenizer, 2))
    sampled = list(recording.calls[0][1].token_ids[0])
    observed = episode.tokens[len(sampled):len(episode.tokens) - len(recording.calls[1][1].token_ids[0])]
    assert tokenizer.decode(observed) == "Q: obs1;\nA:"  # the template's user turn and generation prompt
    tokens = tokenizer("A: 7</action> and more", add_special_tokens=False).input_ids
    cut, lps, found = cut_at_stop(tokenizer, tokens, [0.0] * len(tokens), ["</action>"])
    assert found and tokenizer.decode(cut).endswith("</action>") and len(lps) == len(cut) < len(tokens)
    assert cut_at_stop(tokenizer, tokens, [0.0] * len(tokens), ["<never>"])[0] == tokens


def test_an_environment_that_answers_the_wrong_number_of_episodes_is_one_line(setup):
    _, tokenizer, _ = setup

    class Short(TalkingEnvironment):
        def step(self, episodes):
            return super().step(episodes)[:-1]

    mt, _ = sampler(setup, Short())
    with pytest.raises(NrlError, match=r"Short.step returned 1 results for 2 episodes; it must answer each episode once"):
        mt.play(prompts(tokenizer))
    with pytest.raises(NrlError, match="has no step\\(episodes\\) method"):
        sampler(setup, object())


class LogRecorder:
    """Stands in for the run's logger: keeps the rows ``log_samples`` would write."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def log_samples(self, name: str, step: int, rows: list[dict[str, Any]]) -> None:
        self.rows.extend(json.loads(json.dumps(row, default=str)) for row in rows)


def logged_rows(groups: list[Any]) -> list[dict[str, Any]]:
    from nrl_core.algorithms.grpo import GRPO

    log = LogRecorder()
    GRPO.log_rollouts(SimpleNamespace(state=SimpleNamespace(step=0), log=log), groups)  # type: ignore[arg-type]
    return log.rows


def test_what_the_environment_says_about_each_sample_is_logged_beside_its_rollout(setup):
    """Contract 7: single-turn ``EnvResult.sample_metadata`` and, multi-turn, what the episode's steps
    added to the prompt's metadata reach each rollout's row (the prompt's own keys are not repeated)."""
    _, tokenizer, _ = setup
    mt, _ = sampler(setup, TalkingEnvironment(done_at=2))
    data = prompts(tokenizer)
    groups, _ = mt.groups(data, mt.play([p for p in data for _ in range(2)]))
    assert [g.metadata for g in groups] == [[{"turns_seen": 2}] * 2] * 2
    assert [row["metadata"] for row in logged_rows(groups)] == [{"turns_seen": 2}] * 4

    class Described:
        def score(self, samples: list[EnvSample]) -> EnvResult:
            return EnvResult(rewards=[1.0] * len(samples),
                             sample_metadata=[{"chars": len(s.response), "k": s.metadata["k"]} for s in samples])

    _, _, config = setup
    output = GenerationOutput(token_ids=[[5], [5, 6], [7], [7, 8]], logprobs=[[0.0], [0.0] * 2, [0.0], [0.0] * 2],
                              finish_reasons=["stop"] * 4, weight_version=0)
    groups, result = Scorer(config, tokenizer, Described()).score(data, output, 2)
    expected = [{"chars": len(tokenizer.decode(ids, skip_special_tokens=True)), "k": i // 2}
                for i, ids in enumerate(output.token_ids)]
    assert result.sample_metadata == expected and groups[1].metadata == expected[2:]
    assert [row["metadata"] for row in logged_rows(groups)] == expected
    parts = [result.slice(0, 2), EnvResult(rewards=[0.0])]  # a part without metadata gets empty ones
    assert EnvResult.combine(parts).sample_metadata == expected[:2] + [{}]
    assert EnvResult.combine([EnvResult(rewards=[0.0])]).sample_metadata is None
