"""One row of each NeMo RL dataset's hub columns around a given problem and answer.

``nrl twin`` writes a recipe's data as such rows (arithmetic problems a tiny model can learn), so
its twin reads the recipe's dataset through the same format and processor the recipe would. The
columns and types are the hub datasets' (their cards) as NeMo RL reads them at commit 7ea279a;
tests/plugins/test_data_nemo_rl.py reads each one back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Row = dict[str, Any]
Entry = Mapping[str, Any]


def open_math_instruct_2(problem: str, answer: str, wrong: str, entry: Entry) -> Row:
    """nvidia/OpenMathInstruct-2."""
    return {"problem": problem, "generated_solution": f"{problem} = {answer}, so \\boxed{{{answer}}}.",
            "expected_answer": answer, "problem_source": "augmented_math"}


def dapo_math(problem: str, answer: str, wrong: str, entry: Entry) -> Row:
    """BytedTsinghua-SIA/DAPO-Math-17k and AIME-2024."""
    return {"data_source": "math_dapo", "prompt": [{"content": problem, "role": "user"}], "ability": "MATH",
            "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": problem}}


def aime(problem: str, answer: str, wrong: str, entry: Entry) -> Row:
    """HuggingFaceH4/aime_2024 (the other years name the problem ``question`` or carry fewer columns;
    the format reads either)."""
    return {"id": 0, "problem": problem, "solution": f"{problem} = {answer}", "answer": answer,
            "url": "https://artofproblemsolving.com/wiki", "year": "2024"}


def gsm8k(problem: str, answer: str, wrong: str, entry: Entry) -> Row:
    """openai/gsm8k (config main): the solution ends in ``#### answer``."""
    return {"question": problem, "answer": f"{problem} = <<{problem}={answer}>>{answer}\n#### {answer}"}


def problem_and_answer(problem: str, answer: str, wrong: str, entry: Entry) -> Row:
    """agentica-org/DeepScaleR-Preview-Dataset (OpenR1-Math-220k reads the same two columns)."""
    return {"problem": problem, "answer": answer, "solution": f"{problem} = {answer}"}


def response_dataset(problem: str, answer: str, wrong: str, entry: Entry) -> Row:
    """A user's file: the ``input_key`` and ``output_key`` columns (NeMo RL's defaults ``input``, ``output``)."""
    return {entry.get("input_key") or "input": problem, entry.get("output_key") or "output": answer}


def squad(problem: str, answer: str, wrong: str, entry: Entry) -> Row:
    """rajpurkar/squad: a passage, a question, and answers with their offsets."""
    context = f"Arithmetic: {problem} = {answer}."
    return {"id": problem, "title": "arithmetic", "context": context, "question": f"What is {problem}?",
            "answers": {"text": [answer], "answer_start": [context.rindex(answer)]}}


def tulu3_sft(problem: str, answer: str, wrong: str, entry: Entry) -> Row:
    """allenai/tulu-3-sft-mixture (Nemotron-Cascade 2's math SFT data has the same ``messages``)."""
    return {"id": problem, "messages": [{"content": problem, "role": "user"}, {"content": answer, "role": "assistant"}],
            "source": "arithmetic"}


def helpsteer3(problem: str, answer: str, wrong: str, entry: Entry) -> Row:
    """nvidia/HelpSteer3 (preference): ``overall_preference`` below 0 prefers ``response1``."""
    return {"domain": "general", "language": "english", "context": [{"role": "user", "content": problem}],
            "response1": answer, "response2": wrong, "overall_preference": -2,
            "individual_preference": [{"score": -2, "reasoning": f"{problem} = {answer}", "feedback1": "",
                                       "feedback2": ""}]}


def tulu3_preference(problem: str, answer: str, wrong: str, entry: Entry) -> Row:
    """allenai/llama-3.1-tulu-3-8b-preference-mixture: two conversations differing in the last turn."""
    user = {"content": problem, "role": "user"}
    return {"id": problem, "source": "arithmetic", "prompt": problem,
            "chosen": [user, {"content": answer, "role": "assistant"}],
            "rejected": [user, {"content": wrong, "role": "assistant"}]}


def preference_dataset(problem: str, answer: str, wrong: str, entry: Entry) -> Row:
    """NeMo RL's own pair form: a context and ranked completions."""
    return {"context": [{"role": "user", "content": problem}],
            "completions": [{"rank": 0, "completion": [{"role": "assistant", "content": answer}]},
                            {"rank": 1, "completion": [{"role": "assistant", "content": wrong}]}]}


def binary_preference(problem: str, answer: str, wrong: str, entry: Entry) -> Row:
    """The ``prompt_key``, ``chosen_key`` and ``rejected_key`` columns."""
    return {entry.get("prompt_key") or "prompt": problem, entry.get("chosen_key") or "chosen": answer,
            entry.get("rejected_key") or "rejected": wrong}
