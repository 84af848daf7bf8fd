"""The log-likelihood a model gives the right answers of held-out problems: the teacher-forced
counterpart of greedy accuracy, for learning tests that must hold on any host's float path
(docs/testing.md). Greedy accuracy on a few dozen problems moves by whole answers when a run's
sampled tokens differ; this moves by the run's effect, with a margin."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from nrl_core.data.arithmetic import arithmetic_splits
from nrl_core.data.processors import PromptConfig, sft_processor


def held_out_problems(recipe: Path, num_val: int | None = None) -> list[dict[str, str]]:
    """The validation problems of ``recipe``'s arithmetic generator (``num_val`` of them if given):
    none of the runs train on them."""
    generate = dict(yaml.safe_load(recipe.read_text())["data"]["generate"])
    if num_val is not None:
        generate["num_val"] = num_val
    return arithmetic_splits(**generate)[1]


@dataclass(frozen=True)
class AnswerScores:
    """How well a model knows the right answers: ``log_likelihood`` is the mean log-probability per
    answer token (every problem counts by its answer's length), ``probability`` the mean over
    problems of the probability of the whole answer and the end of the turn, which is the reward
    expected from one sample at temperature 1 when a reward needs that exact answer."""

    log_likelihood: float
    probability: float


def answer_scores(model: Path, records: list[dict[str, str]], recipe: Path) -> AnswerScores:
    """``model``'s (an HF directory, in float32) :class:`AnswerScores` on ``records``, with the
    prompt and the right answer of each rendered as ``recipe``'s data section renders them (the
    answer, then the end of the turn)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = PromptConfig.from_data_config(yaml.safe_load(recipe.read_text())["data"])
    tokenizer = AutoTokenizer.from_pretrained(model)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    total, count, probability = 0.0, 0, 0.0
    with torch.no_grad():
        for idx, record in enumerate(records):
            datum = sft_processor(record, idx, tokenizer, prompts)
            ids = torch.tensor([datum.prompt_ids + datum.response_ids])
            logprobs = torch.log_softmax(net(ids).logits[0, :-1].double(), dim=-1)
            answer = torch.arange(len(datum.prompt_ids) - 1, ids.shape[1] - 1)
            answer_logprob = logprobs[answer, ids[0, answer + 1]].sum().item()
            total, count = total + answer_logprob, count + len(answer)
            probability += math.exp(answer_logprob)
    return AnswerScores(log_likelihood=total / count, probability=probability / len(records))
