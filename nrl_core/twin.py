"""A CPU twin of a recipe: the same algorithm, backends and features, at a size a laptop runs.

``nrl twin RECIPE`` writes ``twin.yaml``, which inherits the recipe (``defaults:``) and sets only
the scale-down keys of :data:`SCALE_DOWN`, and a stand-in of the recipe's data with its dataset's
columns; then it trains the twin for a few steps. A recipe that passes its twin has had its
config, data path, processor, environment, backends and every parallelism kind it uses exercised
end to end before it waits in a GPU queue.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from nrl_core.errors import ConfigError

if TYPE_CHECKING:
    from nrl_core.data.sources import DatasetSource
    from nrl_core.plugins import PluginManager

#: Every key a twin may set, as a pattern over dotted paths (``*`` spans one or more characters,
#: dots included; ``[i]`` is any list item), with why; docs/twin.md shows this table. ``S`` stands
#: for a policy-shaped section (``policy``, an algorithm's model section: distillation's
#: ``teacher``, PPO's ``value``, or an environment's model: ``env.reward_model``), ``A`` for the
#: algorithm's own section.
SCALE_DOWN: dict[str, str] = {
    "S.model_name": "a tiny random-init model of the recipe's family, built here (after a short SFT warm start when "
                    "dynamic sampling needs rewards that differ: nrl_core/twin_warm_start.py)",
    "S.tokenizer.name": "that model's tokenizer",
    "S.precision": "float32: the CPU's kernels",
    "S.*.*_parallel_size": "each parallelism kind the recipe uses, at 2",
    "S.*.sequence_parallel": "the training backend's CPU twin keys, where a backend cannot split the sequence on a "
                             "CPU (Megatron's can since nrl-backend-megatron 0.11.0, and keeps the recipe's)",
    "S.*.moe_token_dispatcher_type": "the training backend's CPU twin keys: Megatron's alltoall and flex "
                                     "dispatchers need CUDA streams; unset, it is allgather on a CPU and "
                                     "alltoall on GPUs",
    "S.*.moe_enable_deepep": "the training backend's CPU twin keys: DeepEP's dispatcher needs CUDA",
    "S.*.num_layers_in_first_pipeline_stage": "the recipe's uneven split of its model's layers; the tiny model's "
                                              "split evenly",
    "S.*.num_layers_in_last_pipeline_stage": "the recipe's uneven split of its model's layers; the tiny model's "
                                             "split evenly",
    "policy.generation.*_kwargs.*": "the generation backend's CPU twin keys (engine arguments that pick GPU "
                                    "kernels, left to the engine's own choice; speculative decoding, whose "
                                    "logprobs vLLM's CPU build returns as NaN, off)",
    "S.*.optimizer.*": "the training backend's CPU twin keys (what a CPU lacks, such as a mixed-precision "
                           "optimizer that keeps CUDA tensors)",
    "S.train_global_batch_size": "8 sequences a step",
    "S.train_micro_batch_size": "2 sequences a micro-batch",
    "S.logprob_batch_size": "2 sequences a micro-batch",
    "S.max_total_sequence_length": "at most 1024 tokens, the tiny models' context",
    "data.max_input_seq_length": "the twin's sequence length less its responses: the tiny tokenizer spends a "
                                 "token on most letters, so a recipe's prompt template takes many more tokens",
    "S.max_model_len": "the model's context, at most the twin's sequence length",
    "env.*.resources.*": "the environment's model on ranks of its own on this machine",
    "policy.generation.*.max_model_len": "the engine's context, at most the twin's sequence length",
    "policy.generation.max_new_tokens": "16 new tokens",
    "policy.generation.stop_token_ids": "none: they are ids of the recipe's vocabulary; the tiny model stops at its end "
                                        "token",
    "policy.generation.*_cfg.*_parallel_size": "each parallelism kind the engine uses, at 2",
    "policy.generation.colocated.resources.*": "one engine on this node, when not colocated",
    "cluster.gpus_per_node": "the twin's ranks, all on this machine",
    "cluster.num_nodes": "one node",
    "A.max_num_steps": "a few steps (--steps)",
    "A.val_period": "validation once, at the last step",
    "A.val_at_start": "no validation before training",
    "A.val_at_end": "no second validation at the end",
    "A.max_val_samples": "8 validation samples",
    "A.val_batch_size": "8 validation samples a batch",
    "A.val_batches": "one validation batch",
    "A.val_global_batch_size": "8 validation samples a batch",
    "A.dynamic_sampling_max_gen_batches": "at least 40 generation batches, with dynamic sampling: the recipe's limit "
                                          "counts batches of its many prompts, the twin's batches have a few",
    "A.*": "the algorithm's own CPU twin keys (AlgorithmSpec.twin), such as prompts a step",
    "data.train_data_path": "the stand-in of the recipe's data",
    "data.val_data_path": "the stand-in of the recipe's validation data",
    "data.train.data_path": "the stand-in of the recipe's dataset, with its columns",
    "data.train[i].data_path": "the stand-in of each of the recipe's datasets",
    "data.validation.data_path": "the stand-in of the recipe's validation dataset",
    "data.validation[i].data_path": "the stand-in of each validation dataset",
    "data.generate.num_train": "64 generated training examples",
    "data.generate.num_val": "8 generated validation examples",
    "env.*.num_workers": "one environment worker",
    "logger.log_dir": "under the twin's directory",
    "logger.wandb_enabled": "no remote logger",
    "logger.mlflow_enabled": "no remote logger",
    "checkpointing.checkpoint_dir": "under the twin's directory",
}

STEPS = 2
WORLD_LIMIT = 4
DYNAMIC_SAMPLING_BATCHES = 40  # of the twin's few prompts each: enough for the warm-started tiny model's groups
NEW_TOKENS = 16  # a twin's responses: enough to be scored, few enough to be quick
SEQUENCE_LENGTH = 1024  # the tiny models' context; long prompt templates need most of it (a token for most letters)
BATCH = {"train_global_batch_size": 8, "train_micro_batch_size": 2, "logprob_batch_size": 2}
VALIDATION = {"max_val_samples": 8, "val_batch_size": 8, "val_batches": 1, "val_global_batch_size": 8}
#: Tiny families by the name fragments of their hub ids; the first match wins.
FAMILY_NAMES = (("qwen3_moe", r"qwen3(?!\.\d|-?next).*(moe|-a\d+b|\d+ba\d+b)"), ("qwen2_moe", r"qwen(1\.5|2)[-_]?moe"),
                ("qwen3", r"qwen3(?!\.\d|-?next)"), ("qwen2", r"qwen2|distill-qwen"), ("llama", r"llama"),
                ("gemma3", r"gemma-?3(?!n)"), ("gemma4", r"gemma-?4"), ("mistral", r"mistral-(7b|nemo)"),
                ("gpt_oss", r"gpt-oss"), ("nemotron_h_moe", r"nemotron-3(\.5)?-(nano|super|lightning)"),
                ("nemotron_h", r"nemotron-(h|nano-\d+b-v2)\b"),
                # NeMo RL's DeepSeek recipes name its guide, which converts DeepSeek-V3, as their model
                ("deepseek_v3", r"moonlight|deepseek-v3(?!\.[2-9])|nvidia-nemo/rl/.*docs/guides/deepseek\.md"),
                ("glm4_moe_lite", r"glm-4\.7-flash"))


@dataclass(frozen=True)
class Twin:
    """A written twin: its config, the algorithm it runs, the keys it sets (dotted: value) and the
    policy-shaped sections it scaled (``S`` of :data:`SCALE_DOWN`)."""

    config: Path
    algorithm: str
    overrides: dict[str, Any]
    sections: tuple[str, ...] = ("policy",)


MISMATCH_LIMIT = 1.05  # train/token_mult_prob_error above this: the engine samples from other weights than training's


def mismatch_note(log_dir: Path) -> str | None:
    """A one-line warning when the twin's engine and trainer disagreed on the logprobs of what the
    engine sampled (``train/token_mult_prob_error`` near 1 when a refit carried every weight and
    both compute the same model, in the twin's float32); None when they agreed. The twin still
    trained, so it is a warning: sampling cut by top_p or top_k raises the metric too."""
    metrics = log_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    errors = [(float(r["train/token_mult_prob_error"]), r.get("step")) for r in rows if "train/token_mult_prob_error" in r]
    worst = max(errors, default=None, key=lambda e: (e[0] != e[0], e[0]))  # a NaN is the worst of all
    if worst is None or worst[0] <= MISMATCH_LIMIT:
        return None
    return (f"twin: the engine's logprobs are not the trainer's: train/token_mult_prob_error {worst[0]:.3g} at step "
            f"{worst[1]} (about 1 when the refit carried every weight and both compute the same model; top_p or top_k "
            "below their neutral values raise it too)")


def documented(key: str, *, algorithm: str, model_sections: tuple[str, ...] = ()) -> str | None:
    """Why a twin may set ``key`` (a dotted path, list items as ``[i]``), or None if it may not."""
    key = re.sub(r"\[\d+\]", "[i]", key)
    for pattern, why in SCALE_DOWN.items():
        for section in ("policy", *model_sections):
            named = pattern.replace("S.", f"{section}.", 1) if pattern.startswith("S.") else pattern
            named = named.replace("A.", f"{algorithm}.", 1) if named.startswith("A.") else named
            if re.fullmatch(re.escape(named).replace(r"\*", ".+"), key):
                return why
    return None


def tiny_family(model_name: str) -> str | None:
    """The tiny family (nrl_core.testing.tiny_models) of ``model_name``: a local model's
    ``model_type``, or a hub id's name."""
    config = Path(model_name).expanduser() / "config.json"
    if config.is_file():
        from nrl_core.testing.tiny_models import FAMILIES, MODEL_TYPES

        raw = json.loads(config.read_text())
        model_type = MODEL_TYPES.get(raw.get("model_type"), raw.get("model_type"))
        if model_type == "nemotron_h" and ("moe" in (raw.get("layers_block_type") or [])
                                           or "E" in str(raw.get("hybrid_override_pattern") or "")):
            model_type = "nemotron_h_moe"  # Nemotron 3: the same model type, with experts
        return model_type if model_type in FAMILIES else None
    lowered = model_name.lower()
    return next((family for family, pattern in FAMILY_NAMES if re.search(pattern, lowered)), None)


def recipe_algorithm(raw: Mapping[str, Any], path: Path, pm: PluginManager) -> str:
    """The installed algorithm whose section the recipe at ``path`` (``raw``: as read, its
    defaults merged) sets; one line when none or several do."""
    specs = pm.algorithms()
    found = [name for name in specs.names() if specs.get(name, "algorithm").section in raw]
    if len(found) > 1 and "grpo" in found:  # PPO and distillation recipes inherit GRPO's section
        found.remove("grpo")
    if len(found) != 1:
        what = "none" if not found else ", ".join(found)
        raise ConfigError("twin", f"{path.name} sets the section of {what} of the installed algorithms "
                                  f"({', '.join(specs.names())}); pass --algorithm NAME")
    return found[0]


def write_twin(recipe: Path, out: Path, pm: PluginManager, *, algorithm: str | None = None, model: Path | None = None,
               steps: int = STEPS) -> Twin:
    """Write ``out/twin.yaml`` and its data stand-ins for ``recipe``; raises a one-line
    :class:`ConfigError` for a recipe nrl refuses or cannot scale down."""
    from nrl_core.config import choose_backends, load_and_validate
    from nrl_core.config.loader import load_with_defaults

    recipe = recipe.expanduser().resolve()
    raw = load_with_defaults(recipe)
    algorithm = algorithm or recipe_algorithm(raw, recipe, pm)
    spec = pm.algorithms().get(algorithm, "algorithm")
    config = load_and_validate(str(recipe), [], pm, algorithm=algorithm, backend_checks=False)
    out.mkdir(parents=True, exist_ok=True)
    choice = choose_backends(config, pm, generation=spec.generates, warn=False)
    sets: dict[str, Any] = {}
    world = 0
    for section in ("policy", *spec.model_sections):
        if isinstance(config.get(section), Mapping):
            world = max(world, _scale_model(sets, section, config[section], raw.get(section) or {}, choice.training,
                                            model))
    env_models = [name for name, env in (raw.get("env") or {}).items()  # a scorer an environment runs
                  if isinstance(env, Mapping) and "model_name" in env and name in (config.get("env") or {})]
    for name in env_models:
        ranks = _scale_model(sets, f"env.{name}", config["env"][name], raw["env"][name], choice.training, model,
                             data_parallel=False)
        if isinstance(config["env"][name].get("resources"), Mapping):
            sets[f"env.{name}.resources.gpus_per_node"] = ranks
            sets[f"env.{name}.resources.num_nodes"] = 1
            world += ranks
    sections = ("policy", *spec.model_sections, *(f"env.{name}" for name in env_models))
    sets[f"{spec.section}.max_num_steps"] = steps
    algo_cfg = config[spec.section]
    for key, value in {"val_period": steps, "val_at_start": False, "val_at_end": False, **VALIDATION}.items():
        if key in algo_cfg:
            sets[f"{spec.section}.{key}"] = value
    for key, value in spec.twin.items():
        sets[f"{spec.section}.{key}"] = value
    if algo_cfg.get("use_dynamic_sampling"):
        limit = int(algo_cfg.get("dynamic_sampling_max_gen_batches") or 0)
        sets[f"{spec.section}.dynamic_sampling_max_gen_batches"] = max(limit, DYNAMIC_SAMPLING_BATCHES)
    engine = _scale_generation(sets, config, raw, choice.generation) if spec.generates else 0
    sets["cluster.num_nodes"] = 1
    sets["cluster.gpus_per_node"] = world + engine
    _scale_data(sets, config, raw, out, pm)
    prompt_room = min(int(config["policy"].get("max_total_sequence_length") or 0), SEQUENCE_LENGTH) - NEW_TOKENS
    limit = config["data"].get("max_input_seq_length")
    if isinstance(limit, int) and spec.generates and limit < prompt_room:
        sets["data.max_input_seq_length"] = prompt_room
    for name, env in (raw.get("env") or {}).items():  # the recipe's environments, not every installed one
        if isinstance(env, Mapping) and "num_workers" in env:
            sets[f"env.{name}.num_workers"] = 1
    sets["logger.log_dir"] = str(out / "logs")
    for key in ("wandb_enabled", "mlflow_enabled"):
        if key in config.get("logger", {}):
            sets[f"logger.{key}"] = False
    if "checkpoint_dir" in config.get("checkpointing", {}):
        sets["checkpointing.checkpoint_dir"] = str(out / "checkpoints")
    sets = {key: value for key, value in sets.items() if _current(raw, config, key) != value}  # only what changes
    for key in sets:
        if documented(key, algorithm=spec.section, model_sections=sections[1:]) is None:
            raise AssertionError(f"twin key {key} is not in SCALE_DOWN")  # a bug here, not the user's
    path = out / "twin.yaml"
    path.write_text(_yaml(recipe, sets, raw, spec.section, sections[1:]))
    load_and_validate(str(path), [], pm, algorithm=algorithm)
    return Twin(path, algorithm, sets, sections)


def _current(raw: Mapping[str, Any], config: Mapping[str, Any], key: str) -> Any:
    """The recipe's value at ``key``: as it spells it, else the validated default."""
    value = _value(raw, key)
    return _value(config, key) if value is _MISSING else value


_MISSING = object()


def _value(config: Mapping[str, Any], key: str) -> Any:
    """The value at a dotted ``key`` (list items as ``[i]``), or :data:`_MISSING`."""
    node: Any = config
    for part in re.split(r"\.|(?=\[)", key):
        index = re.fullmatch(r"\[(\d+)\]", part)
        try:
            node = node[int(index.group(1))] if index else node[part]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return node


def _scale_model(sets: dict[str, Any], section: str, cfg: Mapping[str, Any], raw_section: Mapping[str, Any],
                 training: Any, model: Path | None, *, data_parallel: bool = True) -> int:
    """Set a policy-shaped section's model, precision, sizes and parallelism; its ranks."""
    if model is None:
        family = tiny_family(str(cfg["model_name"]))
        if family is None:
            from nrl_core.testing.tiny_models import FAMILIES

            raise ConfigError(f"{section}.model_name", f"no tiny model of {cfg['model_name']}'s family here (nrl "
                                                       f"builds {', '.join(FAMILIES)}); pass --model DIR, a small "
                                                       "Hugging Face model of that family")
        from nrl_core.testing.tiny_models import cached_tiny_model

        model = cached_tiny_model(family, size="small", **_prediction_layers(cfg, family), **_latent_experts(cfg))
    sets[f"{section}.model_name"] = str(model)
    if (cfg.get("tokenizer") or {}).get("name"):
        sets[f"{section}.tokenizer.name"] = str(model)
    sets[f"{section}.precision"] = "float32"
    for key, value in BATCH.items():
        if key in cfg:
            sets[f"{section}.{key}"] = value
    if "max_total_sequence_length" in cfg:
        sets[f"{section}.max_total_sequence_length"] = min(int(cfg["max_total_sequence_length"]), SEQUENCE_LENGTH)
    backend = cfg.get(training.config_key) or {}
    spelled = next((name for name in (*training.config_aliases, training.config_key) if name in raw_section),
                   training.config_key)  # the recipe's spelling (dtensor_cfg), so the twin overrides it
    scaled = dict(backend)
    written = raw_section.get(spelled) if isinstance(raw_section.get(spelled), Mapping) else {}
    for key, value in {**written, **backend}.items():  # a size the backend accepts without effect is scaled too
        if key.endswith("_parallel_size") and isinstance(value, int) and value > 1:
            sets[f"{section}.{spelled}.{key}"] = 2
            if key in scaled:
                scaled[key] = 2
        if key.startswith("num_layers_in_") and key.endswith("_pipeline_stage") and value is not None:
            sets[f"{section}.{spelled}.{key}"] = None
    for key, value in training.twin.items():
        sets[f"{section}.{spelled}.{key}"] = value
    replica = training.model_parallel_size(scaled)
    experts = max([v for k, v in scaled.items() if k.startswith("expert") and k.endswith("_parallel_size")] or [1])
    if isinstance(raw_section.get("max_model_len"), int) and raw_section["max_model_len"] > SEQUENCE_LENGTH:
        sets[f"{section}.max_model_len"] = SEQUENCE_LENGTH
    groups = 2 if data_parallel and 2 * replica <= WORLD_LIMIT else 1
    return max(replica * groups, experts)


#: Hub models whose experts compute in a latent space: Nemotron 3 Super (hidden 4096 to 1024,
#: NVIDIA's deployment guide). Their tiny model's experts read half its hidden width.
LATENT_EXPERT_MODELS = re.compile(r"nemotron-3-super", re.IGNORECASE)


def _latent_experts(cfg: Mapping[str, Any]) -> dict[str, int]:
    """The tiny model's latent expert width (``moe_latent_size``) when the recipe's model has one."""
    return {"moe_latent_size": 64} if LATENT_EXPERT_MODELS.search(str(cfg["model_name"])) else {}


def _prediction_layers(cfg: Mapping[str, Any], family: str) -> dict[str, int]:
    """The tiny model's multi-token-prediction layers: one when the recipe drafts with them
    (vLLM's ``deepseek_mtp`` speculative decoding), since vLLM refuses to draft with none."""
    generation = cfg.get("generation") or {}
    method = str(((generation.get("vllm_kwargs") or {}).get("speculative_config") or {}).get("method") or "")
    from nrl_core.testing.tiny_models import LATENT_FAMILIES

    return {"num_nextn_predict_layers": 1} if method.endswith("mtp") and family in LATENT_FAMILIES else {}


def _scale_generation(sets: dict[str, Any], config: Mapping[str, Any], raw: Mapping[str, Any], generation: Any) -> int:
    """Set the engine's sizes and parallelism; the ranks it adds (none when colocated)."""
    gen = config["policy"].get("generation")
    if not gen or generation is None:
        return 0
    if "max_new_tokens" in gen:
        sets["policy.generation.max_new_tokens"] = NEW_TOKENS
    if gen.get("stop_token_ids"):  # ids of the recipe's vocabulary: the tiny model stops at its own end token
        sets["policy.generation.stop_token_ids"] = None
    for key, value in generation.twin.items():
        if _value(raw, f"policy.generation.{key}") not in (_MISSING, None, value):
            sets[f"policy.generation.{key}"] = value
    section = dict(gen.get(generation.config_key) or {})
    length = min(int(config["policy"]["max_total_sequence_length"]), SEQUENCE_LENGTH)
    written = _value(raw, f"policy.generation.{generation.config_key}.max_model_len")  # not a ${...} that follows
    if isinstance(written, int) and written > length:
        sets[f"policy.generation.{generation.config_key}.max_model_len"] = length
    for key, value in list(section.items()):
        if key.endswith("_parallel_size") and isinstance(value, int) and value > 1:
            sets[f"policy.generation.{generation.config_key}.{key}"] = section[key] = 2
    if (gen.get("colocated") or {}).get("enabled", True):
        return 0
    size = generation.engine_size(section)
    sets["policy.generation.colocated.resources.gpus_per_node"] = size
    sets["policy.generation.colocated.resources.num_nodes"] = 1
    return size


def _scale_data(sets: dict[str, Any], config: Mapping[str, Any], raw: Mapping[str, Any], out: Path,
                pm: PluginManager) -> None:
    """Stand-ins of the recipe's data under ``out/data``: a named dataset's rows in its hub columns,
    a local file's in its configured columns; generated data, fewer examples."""
    from nrl_core.data.sources import resolve_datasets, uses_dataset_layout

    data = config["data"]
    train, val = resolve_datasets(data, None, pm.datasets(), warn=False)  # data.default filled in
    for source in (*train, *val):
        part, index = re.fullmatch(r"data\.(train|validation)\[(\d+)\]", source.key_path).groups()  # type: ignore[union-attr]
        listed = isinstance((raw.get("data") or {}).get(part), list)  # as the recipe writes it
        key = f"{source.key_path}.data_path" if listed else f"data.{part}.data_path"
        sets[key] = str(_dataset_stand_in(source, out / "data" / f"{part}{index}.parquet"))
    if not uses_dataset_layout(data):
        for key, part in (("train_data_path", "train"), ("val_data_path", "validation")):
            if data.get(key):
                path = out / "data" / f"{part}.jsonl"
                _write_jsonl(path, [{data.get("input_key") or "input": p, data.get("output_key") or "output": a}
                                    for p, a, _ in _problems(part)])
                sets[f"data.{key}"] = str(path)
        generate = data.get("generate") or {}
        for key, count in (("num_train", 64), ("num_val", 8)):
            if key in generate:
                sets[f"data.generate.{key}"] = count


def _dataset_stand_in(source: DatasetSource, path: Path) -> Path:
    from nrl_core.contracts import import_object

    if not source.spec.stand_in:
        raise ConfigError(f"{source.key_path}.dataset_name",
                          f"dataset '{source.name}' ({source.spec.distribution}) gives no stand-in rows "
                          "(DatasetSpec.stand_in); point data_path at a small local file with its columns")
    row = import_object(source.spec.stand_in)
    rows = [row(problem, answer, wrong, source.entry) for problem, answer, wrong in _problems(path.stem)]
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).to_parquet(path)
    return path


def _problems(part: str) -> Iterator[tuple[str, str, str]]:
    """Sums (what the tiny models' tokenizer was trained on), with a wrong answer: enough rows that
    a dataset's held-out share fills a validation batch on either data-parallel rank."""
    train = part.startswith("train")
    for i in range(0, 160) if train else range(160, 168):  # validation's problems are not training's
        a, b = i // 10, (i * 7) % 10
        yield f"{a}+{b}", str(a + b), str(a + b + 1)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _yaml(recipe: Path, sets: Mapping[str, Any], raw: Mapping[str, Any], algorithm: str,
          model_sections: tuple[str, ...]) -> str:
    """The twin's config: ``defaults:`` the recipe, then each set key nested, a list of datasets
    whole (with its stand-in paths), and a comment per key saying why."""
    nested: dict[str, Any] = {"defaults": str(recipe)}
    for key, value in sets.items():
        match = re.fullmatch(r"data\.(train|validation)\[(\d+)\]\.data_path", key)
        if match:
            part, index = match.group(1), int(match.group(2))
            listed = nested.setdefault("data", {}).setdefault(part, [dict(e) for e in raw["data"][part]])
            listed[index]["data_path"] = value
            continue
        node = nested
        *parents, last = key.split(".")
        for parent in parents:
            node = node.setdefault(parent, {})
        node[last] = value
    why = "\n".join(f"#   {key}: {documented(key, algorithm=algorithm, model_sections=model_sections)}" for key in sets)
    return (f"# The CPU twin of {recipe.name}, written by `nrl twin`. It differs from the recipe only in:\n{why}\n"
            + yaml.safe_dump(nested, sort_keys=False))
