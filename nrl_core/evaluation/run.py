"""``nrl eval``: a model's answers to a dataset, scored by an environment, as pass@k and majority vote.

The engines are the generation backend's (vLLM's), built on every device of ``cluster`` in their
own actors and reading the model's weights themselves; the prompts are processed and the answers
scored exactly as GRPO's validation does (same data section, processor, chat template and
environment, decoding as validation does: greedily when ``policy.generation.val_temperature`` is 0,
else at ``temperature``), so ``nrl eval`` of a run's exported model on the run's config gives the
run's last ``val/accuracy``. Each problem is sampled ``eval.num_tests_per_prompt`` times.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nrl_core.errors import ConfigError

__all__ = ["EvalReport", "ProblemResult", "evaluate", "format_report", "summarize"]

logger = logging.getLogger(__name__)


@dataclass
class ProblemResult:
    """One problem's samples: their responses, rewards and, where the environment states it, the
    answer each gave (what the majority vote counts)."""

    prompt: str
    rewards: list[float]
    responses: list[str]
    answers: list[Any] | None = None

    @property
    def correct(self) -> list[bool]:
        return [r > 0 for r in self.rewards]  # as val/accuracy counts


@dataclass
class EvalReport:
    model: str
    samples_per_problem: int
    temperature: float
    metric: str
    k: int
    scores: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def headline(self) -> str:
        return f"{'pass' if self.metric == 'pass@k' else 'maj'}@{self.k}"


def summarize(problems: Sequence[ProblemResult], *, model: str, eval_cfg: Mapping[str, Any],
              temperature: float) -> EvalReport:
    """pass@k for k = 1, 2, 4, ... up to the samples per problem and ``k_value``; majority vote at
    ``k_value`` and at n when every sample's answer is known; the mean reward and the fraction of
    correct samples. Each a mean over problems with its standard error."""
    from nrl_core.evaluation.metrics import Score, majority_at_k, pass_at_k

    n, k = int(eval_cfg["num_tests_per_prompt"]), int(eval_cfg["k_value"])
    report = EvalReport(model=model, samples_per_problem=n, temperature=temperature, metric=eval_cfg["metric"], k=k)

    def put(name: str, score: Score) -> None:
        report.scores[name] = {"value": score.value, "stderr": score.stderr, "problems": score.problems}

    put("accuracy", Score.of([sum(p.correct) / n for p in problems]))
    put("reward", Score.of([sum(p.rewards) / n for p in problems]))
    ks = sorted({*(2 ** i for i in range(n.bit_length()) if 2 ** i <= n), k, n})
    for each in ks:
        put(f"pass@{each}", pass_at_k([p.correct for p in problems], each))
    if all(p.answers is not None for p in problems):
        for each in sorted({k, n}):
            put(f"maj@{each}", majority_at_k([p.answers for p in problems],  # type: ignore[misc]
                                             [p.rewards for p in problems], each))
    elif eval_cfg["metric"] == "cons@k":
        raise ConfigError("eval.metric", "cons@k needs each sample's answer, which this environment does not report "
                                         "(EnvResult.sample_metadata 'answer'); use pass@k")
    return report


def format_report(report: EvalReport) -> str:
    """A table of the scores, the headline first."""
    order = sorted(report.scores, key=lambda name: (not name.startswith("pass@"), not name.startswith("maj@"),
                                                     int(name.split("@")[1]) if "@" in name else 0))
    names = [report.headline, *(name for name in order if name != report.headline)]
    width = max(len(name) for name in names)
    lines = [f"model {report.model}: {report.samples_per_problem} sample(s) per problem at temperature "
             f"{report.temperature:g}, {report.scores['accuracy']['problems']} problems"]
    for name in names:
        score = report.scores[name]
        lines.append(f"  {name:<{width}}  {score['value']:.4f} ± {score['stderr']:.4f}")
    return "\n".join(lines)


def evaluate(config: Mapping[str, Any], eval_cfg: Mapping[str, Any]) -> EvalReport:
    """Run the evaluation of the validated ``config`` and ``eval_cfg``
    (:func:`nrl_core.evaluation.config.load_eval_config`); writes ``results.json`` and
    ``samples.jsonl`` under ``eval.save_path`` when it is set."""
    import ray

    from nrl_core.algorithms.generation import generate_on_engines
    from nrl_core.algorithms.grpo import prompt_limits
    from nrl_core.algorithms.installed import prepare_data
    from nrl_core.algorithms.rollout_sources import validates_greedily
    from nrl_core.algorithms.rollouts import repeat_prompts
    from nrl_core.algorithms.scoring import Scorer
    from nrl_core.algorithms.setup import build_environment, load_tokenizer, seed_everything
    from nrl_core.cluster import init_ray, shutdown_ray

    seed_everything(int(eval_cfg["seed"]))
    tokenizer = load_tokenizer(config)
    data = prepare_data(config["data"], tokenizer, limits=prompt_limits(config))
    problems = _split(data, eval_cfg["split"])[: eval_cfg["max_problems"]]
    n = int(eval_cfg["num_tests_per_prompt"])
    generation = config["policy"]["generation"]
    greedy = validates_greedily(generation) or float(generation["temperature"]) == 0
    temperature = 0.0 if greedy else float(generation["temperature"])
    started_ray = not ray.is_initialized()
    env = build_environment(config)
    try:
        init_ray(config["cluster"])
        scorer = Scorer(config, tokenizer, env)
        with EvalEngines(config) as engines:
            out = generate_on_engines(engines.hosts, repeat_prompts([d.prompt_ids for d in problems], n),
                                      engines.num_engines, engines.engine_size, greedy=greedy)
        result, texts = scorer.rewards([d for d in problems for _ in range(n)], out.token_ids)
    finally:
        env.shutdown()
        if started_ray:
            shutdown_ray()
    metadata = result.sample_metadata or []
    stated = len(metadata) == len(result.rewards) and all(m is not None and "answer" in m for m in metadata)
    answers = [m["answer"] for m in metadata] if stated else None
    results = [ProblemResult(prompt=d.prompt_text, rewards=result.rewards[i * n:(i + 1) * n],
                             responses=texts[i * n:(i + 1) * n],
                             answers=answers[i * n:(i + 1) * n] if answers is not None else None)
               for i, d in enumerate(problems)]
    report = summarize(results, model=str(config["policy"]["model_name"]), eval_cfg=eval_cfg, temperature=temperature)
    if eval_cfg["save_path"]:
        _save(Path(eval_cfg["save_path"]), report, results, problems, out.token_ids, n)
    return report


class EvalEngines:
    """The generation backend's engines on every device of the cluster, each reading the model."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        from nrl_core.algorithms.installed import choose_backends
        from nrl_core.algorithms.policy_launch import launch_engines
        from nrl_core.process_groups import distributed_timeout_s

        choice = choose_backends(config, generation=True, warn=False)
        spec = choice.generation
        assert spec is not None
        cluster = config["cluster"]
        world = int(cluster["gpus_per_node"]) * int(cluster["num_nodes"])
        self.engine_size = spec.engine_size(config["policy"]["generation"].get(spec.config_key) or {})
        if world % self.engine_size:
            raise ConfigError("cluster.gpus_per_node", f"{world} devices do not hold whole engines of "
                                                       f"{self.engine_size}; use a multiple of it")
        self.num_engines = world // self.engine_size
        self.launched = launch_engines(config, spec, world, name="eval",
                                       collective_timeout_s=distributed_timeout_s(config, choice.training.config_key))
        self.hosts = self.launched.group
        try:
            self.launched.finish_start({"config": dict(config)})
        except BaseException:
            self.launched.discard()
            raise

    def __enter__(self) -> EvalEngines:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.launched.discard()


def _split(data: Any, split: str) -> list[Any]:
    if split == "train":
        return list(data.train)
    if data.val:
        return list(data.val)
    if split == "val":
        raise ConfigError("eval.split", "the config has no validation data; set data.val_data_path or eval.split: train")
    return list(data.train)


def _save(directory: Path, report: EvalReport, results: Sequence[ProblemResult], problems: Sequence[Any],
          token_ids: Sequence[Sequence[int]], n: int) -> None:
    """``results.json`` (the report) and ``samples.jsonl`` (one line per sample), each written to a
    temporary name first and renamed, so an interrupted write never leaves a partial file."""
    from nrl_core.data.datasets import write_jsonl

    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / ".results.json.tmp"
    temporary.write_text(json.dumps(asdict(report), indent=2) + "\n", encoding="utf-8")
    temporary.replace(directory / "results.json")
    write_jsonl([{"problem": i, "sample": j, "prompt": problem.prompt, "response": problem.responses[j],
                  "reward": problem.rewards[j], "answer": problem.answers[j] if problem.answers is not None else None,
                  "prompt_token_ids": list(datum.prompt_ids), "response_token_ids": list(token_ids[i * n + j])}
                 for i, (problem, datum) in enumerate(zip(results, problems)) for j in range(n)],
                directory / "samples.jsonl")
