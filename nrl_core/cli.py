"""The ``nrl`` command.

``nrl plugins [--json]``, ``nrl config check|show CONFIG [overrides...]``,
``nrl train ALGORITHM --config CONFIG [overrides...]`` and ``nrl stacks LOG_DIR`` (every stack of
a running run, written into its log directory). User errors (:class:`NrlError`), also
those raised inside a Ray worker, print one line, ``error: <key.path>: <what and how to fix>``, on
stderr and exit 2; there is no traceback unless ``NRL_DEBUG=1``. Anything else a worker raises is
a bug: its remote traceback is printed, then the line naming the worker, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import yaml

from nrl_core.errors import NrlError, WorkerRaisedError
from nrl_core.long_lived import freeze_at_exit, long_lived_objects

if TYPE_CHECKING:
    from nrl_core.plugins import PluginManager

EXIT_USAGE = 2
EXIT_BUG = 1


def _cmd_plugins(args: argparse.Namespace) -> int:
    from nrl_core.plugins import get_plugin_manager

    pm = get_plugin_manager()
    infos = pm.list_plugins()
    if args.json:
        print(json.dumps([{"name": i.name, "distribution": i.distribution, "version": i.version, "contract": i.contract,
                           "hooks": i.hooks} for i in infos], indent=2))
        return _refuse_clashes(pm)
    for info in infos:
        contract = f"contract {info.contract}" if info.contract is not None else "-"
        print(f"{info.name:<24} {info.distribution or '-':<24} {info.version or '-':<10} {contract:<11} "
              f"{', '.join(info.hooks)}")
    for name, message in pm.failed.items():
        print(f"{name:<24} FAILED: {message}")
    return _refuse_clashes(pm)


def _refuse_clashes(pm: PluginManager) -> int:
    """After the listing, one line for each name two plugins register, and the usage exit status."""
    clashes = pm.clashes()
    for message in clashes:
        print(f"error: {message}", file=sys.stderr)
    return EXIT_USAGE if clashes else 0


def _cmd_config_check(args: argparse.Namespace) -> int:
    from nrl_core.config import choose_backends, load_and_validate
    from nrl_core.plugins import get_plugin_manager

    plugins = get_plugin_manager()
    config = load_and_validate(args.config, args.overrides, plugins, algorithm=args.algorithm)
    choice = choose_backends(config, plugins, generation=args.algorithm not in ("sft", "dpo"))
    notes = _check_contracts(config, choice, plugins, first_party=True)
    print(f"ok: {args.config}")
    print(f"training backend: {choice.training.name} ({choice.training.distribution})")
    if choice.generation is not None:
        print(f"generation backend: {choice.generation.name} ({choice.generation.distribution})")
    else:
        print("generation backend: none (policy.generation is null)")
    for note in notes:
        print(f"contract: {note}")
    for line in _describe_data(config["data"], plugins):
        print(line)
    from nrl_core.plan import check_plan

    plan = check_plan(config, plugins, device_gib=args.device_memory,  # raises the one-line refusal
                      algorithms=_algorithms_of(args, plugins))
    print(plan if isinstance(plan, str) else plan.table())
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from nrl_core.config import load_and_validate
    from nrl_core.plan import plan_memory, refusal
    from nrl_core.plugins import get_plugin_manager

    plugins = get_plugin_manager()
    config = load_and_validate(args.config, args.overrides, plugins, algorithm=args.algorithm)
    plan = plan_memory(config, plugins, device_gib=args.device_memory, model_config=args.model_config,
                       algorithms=_algorithms_of(args, plugins))
    print(plan.table())
    problem = refusal(plan)
    if problem is not None:
        print(f"error: memory: {problem}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _algorithms_of(args: argparse.Namespace, plugins: Any) -> list[str]:
    """The algorithm a command names, else those whose sections the config file sets."""
    if args.algorithm:
        return [args.algorithm]
    from nrl_core.config.loader import load_config
    from nrl_core.config.validate import algorithm_sections

    raw = load_config(args.config, args.overrides)
    return [name for section, name in algorithm_sections(plugins).items() if section in raw]


def _describe_data(data: dict[str, Any], plugins: Any) -> list[str]:
    """Where each dataset of NeMo RL's layout would load from (nothing is loaded)."""
    from nrl_core.data.sources import describe_datasets, resolve_datasets, uses_dataset_layout

    if not uses_dataset_layout(data):
        where = data.get("train_data_path") or data.get("dataset_name")
        if not where:
            return []
        kind = "generator" if where in plugins.dataset_generators() else "local"
        validation = f", validation local {data['val_data_path']}" if data.get("val_data_path") else ""
        return [f"data: train {kind} {where}{validation}; processor {data['processor']}"]
    train, val = resolve_datasets(data, None, plugins.datasets(), warn=False)
    prompts = any(source.spec.kind == "prompt" for source in (*train, *val))
    return describe_datasets(train, val, data["processor"] if prompts else None)


def _check_contracts(config: dict, choice: object, plugins: Any, *, first_party: bool) -> list[str]:
    """The selected backends' worker classes against their plugins' contract versions: a one-line
    ``PluginError`` for what cannot be adapted, notes on what is. ``first_party=False`` skips the
    core's own distributions (the conformance kit holds them to the contract; importing their
    workers in the driver would only slow ``nrl train``'s start)."""
    from nrl_core.contract_adapters import check_selected
    from nrl_core.plugins import FIRST_PARTY_DISTRIBUTIONS

    generation = (config.get("policy") or {}).get("generation") or {}
    colocated = bool((generation.get("colocated") or {}).get("enabled", True))
    if not first_party and all(getattr(spec, "distribution", None) in FIRST_PARTY_DISTRIBUTIONS.values()
                               for spec in (choice.training, choice.generation) if spec is not None):
        return []
    return check_selected(choice, plugins, colocated=colocated)


def _cmd_config_show(args: argparse.Namespace) -> int:
    from nrl_core.config import load_and_validate
    from nrl_core.plugins import get_plugin_manager

    config = load_and_validate(args.config, args.overrides, get_plugin_manager(), algorithm=args.algorithm)
    sys.stdout.write(yaml.safe_dump(config, sort_keys=False, default_flow_style=False))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from nrl_core.algorithms.runtime import Runtime, call_with_runtime
    from nrl_core.config import check_selected_backends, choose_backends, load_and_validate
    from nrl_core.contracts import import_object
    from nrl_core.plugins import get_plugin_manager
    from nrl_core.timeline import mark

    mark("cli_start")
    runtime = Runtime(get_plugin_manager())
    spec = runtime.plugins.algorithms().get(args.algorithm, "algorithm")
    config = load_and_validate(args.config, args.overrides, runtime.plugins, algorithm=args.algorithm,
                               backend_checks=False)
    choice = choose_backends(config, runtime.plugins, generation=spec.generates, warn=False)  # the run warns
    from nrl_core.plan import check_plan

    # a run on this machine that cannot fit: one line before anything starts, not an out-of-memory
    # minutes in (torch is imported by now; a cluster's devices are not the driver's to measure)
    check_plan(config, runtime.plugins, here_only=True, algorithms=[args.algorithm])
    with runtime.policy_launched_early(config, spec, choice.training, choice.generation):  # they import meanwhile
        with long_lived_objects(freeze=False):  # imports torch and transformers: no collection while they load
            check_selected_backends(config, runtime.plugins, algorithm=args.algorithm)
            for note in _check_contracts(config, choice, runtime.plugins, first_party=False):
                logging.getLogger("nrl_core.contract_adapters").warning("%s", note)
            run = import_object(spec.entry)
        mark("config_validated")
        runtime.start_generation_early(config)
        return int(call_with_runtime(run, config, runtime) or 0)


def _warm_start(twin: Any, recipe: Any, out: Any, args: argparse.Namespace) -> tuple[int, Any]:
    """A twin whose rewards must differ starts from its tiny model after a short SFT
    (nrl_core/twin_warm_start.py), run in a process of its own; the exit code and the twin."""
    import subprocess

    from nrl_core.cluster import shutdown_ray
    from nrl_core.config import load_and_validate
    from nrl_core.plugins import get_plugin_manager
    from nrl_core.twin import write_twin
    from nrl_core.twin_warm_start import exported, needs_warm_start, warm_start

    pm = get_plugin_manager()
    config = load_and_validate(str(twin.config), [], pm, algorithm=twin.algorithm)
    if not needs_warm_start(config):
        return 0, twin
    sft = warm_start(config, twin.config, out / "warm_start", pm)
    shutdown_ray()  # the environment's workers, which picked the answer format; the SFT starts its own cluster
    print(f"warm start: {sft} (dynamic sampling keeps only prompts whose rewards differ; a random-init model's "
          "never do)")
    code = subprocess.run([sys.executable, "-m", "nrl_core.cli", "train", "sft", "--config", str(sft)]).returncode
    if code:
        return code, twin
    return 0, write_twin(recipe, out, pm, algorithm=args.algorithm, model=exported(out / "warm_start"),
                         steps=args.steps)


def _cmd_twin(args: argparse.Namespace) -> int:
    from pathlib import Path

    from nrl_core.plugins import get_plugin_manager
    from nrl_core.twin import mismatch_note, write_twin

    recipe = Path(args.config)
    out = Path(args.out or Path("twins") / recipe.stem)
    twin = write_twin(recipe, out, get_plugin_manager(), algorithm=args.algorithm,
                      model=Path(args.model) if args.model else None, steps=args.steps)
    print(f"twin: {twin.config} ({twin.algorithm}, {len(twin.overrides)} scale-down keys, each with its reason there)")
    if args.write_only:
        return 0
    if not args.model:
        code, twin = _warm_start(twin, recipe, out, args)
        if code:
            return code
    code = _cmd_train(argparse.Namespace(algorithm=twin.algorithm, config=str(twin.config), overrides=[]))
    note = mismatch_note(out / "logs") if code == 0 else None
    if note:
        print(f"warning: {note}", file=sys.stderr)
    return code


def _cmd_eval(args: argparse.Namespace) -> int:
    from nrl_core.evaluation.config import load_eval_config
    from nrl_core.evaluation.run import evaluate, format_report
    from nrl_core.plugins import get_plugin_manager

    config, eval_cfg = load_eval_config(args.config, args.overrides)
    if args.check:
        print(f"ok: {args.config}")
        print(f"model: {config['policy']['model_name']}")
        print(f"generation backend: {config['policy']['generation']['backend']}")
        for line in _describe_data(config["data"], get_plugin_manager()):
            print(line)
        print(f"eval: {eval_cfg['metric']} with k={eval_cfg['k_value']} of {eval_cfg['num_tests_per_prompt']} samples "
              "per problem")
        return 0
    report = evaluate(config, eval_cfg)
    print(format_report(report))
    if eval_cfg["save_path"]:
        print(f"results: {eval_cfg['save_path']}/results.json, samples: {eval_cfg['save_path']}/samples.jsonl")
    return 0


def _cmd_convert_checkpoint(args: argparse.Namespace) -> int:
    from nrl_core.algorithms.checkpoint_to_hf import checkpoint_to_hf

    report = checkpoint_to_hf(args.checkpoint, args.out, args.overrides)
    print(f"wrote {report.output} from {report.source} (step {report.step}); its logprobs are within "
          f"{report.max_logprob_error:.2g} of the checkpoint's (tolerance {report.tolerance:g})")
    return 0


def _cmd_stacks(args: argparse.Namespace) -> int:
    from pathlib import Path

    from nrl_core.watchdog import request_stacks

    print(request_stacks(Path(args.log_dir), timeout_s=args.timeout))
    return 0


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from nrl_core.testing.tiny_models import build_tiny_model

    layers = {} if args.layers is None else {"num_hidden_layers": args.layers}
    path = build_tiny_model(args.out, family=args.family, size=args.size, seed=args.seed, **layers)
    print(f"wrote a random-init {args.family} ({args.size}) model and its tokenizer to {path}")
    return 0


def _add_plugin_commands(groups: dict[str, argparse._SubParsersAction]) -> None:
    """The subcommands installed plugins add (``nrl_commands``): each one's arguments now, its
    code when it runs. A command that names an unknown group, or a name already taken, is skipped
    with a warning: one plugin's mistake never breaks ``nrl``."""
    from nrl_core.contracts import import_object
    from nrl_core.plugins import get_plugin_manager

    registry = get_plugin_manager().commands()
    for spec in registry:
        where = f"command '{spec.name}' of {spec.distribution}"
        group = groups.get(spec.group)
        if group is None or spec.name in group.choices or spec.name in registry.clashes:
            why = (f"its group '{spec.group}' is not one of {', '.join(sorted(groups))}" if group is None
                   else registry.clashes.get(spec.name, f"nrl {spec.group} {spec.name} exists already"))
            logging.getLogger(__name__).warning("%s is not added: %s", where, why)
            continue
        parser = group.add_parser(spec.name, help=spec.help)
        try:
            import_object(spec.arguments)(parser)
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not take nrl down
            group.choices.pop(spec.name, None)
            logging.getLogger(__name__).warning("%s is not added: its arguments (%s) failed: %s: %s", where,
                                                spec.arguments, type(exc).__name__, exc)
            continue
        parser.set_defaults(func=_plugin_command(spec.entry))


def _plugin_command(entry: str):  # noqa: ANN202 - an argparse handler
    def run(args: argparse.Namespace) -> int:
        from nrl_core.contracts import import_object

        return int(import_object(entry)(args) or 0)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nrl", description="Reinforcement-learning post-training for language models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    plugins = sub.add_parser("plugins", help="list installed plugins and the hooks they implement")
    plugins.add_argument("--json", action="store_true", help="JSON list of {name, distribution, version, hooks}")
    plugins.set_defaults(func=_cmd_plugins)

    config = sub.add_parser("config", help="check or show a config")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    for name, func, text in (("check", _cmd_config_check, "validate and print the selected backends"),
                             ("show", _cmd_config_show, "print the resolved config with every default")):
        p = config_sub.add_parser(name, help=text)
        p.add_argument("config", help="YAML config file")
        p.add_argument("overrides", nargs="*", help="key.path=value, +key.path=value, ~key.path")
        p.add_argument("--algorithm", default=None,
                       help="check the sections of this algorithm (default: those the config sets)")
        if name == "check":
            p.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                           help="memory of each device the run will use (default: detected where known)")
        p.set_defaults(func=func)

    plan = sub.add_parser("plan", help="predict each role's peak memory per device (from the model's config alone)")
    plan.add_argument("config", help="YAML config file")
    plan.add_argument("overrides", nargs="*", help="key.path=value, +key.path=value, ~key.path")
    plan.add_argument("--algorithm", default=None, help="plan the sections of this algorithm")
    plan.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                      help="memory of each device the run will use (default: detected where known)")
    plan.add_argument("--model-config", default=None, metavar="DIR",
                      help="a directory holding the model's config.json (when policy.model_name is a hub name "
                           "this machine has not cached)")
    plan.set_defaults(func=_cmd_plan)

    from nrl_core.testing.tiny_models import FAMILIES

    tiny = sub.add_parser("tiny-model", help="write a tiny random-init HF model with a locally trained tokenizer")
    tiny.add_argument("out", help="output directory")
    tiny.add_argument("--family", default="llama", choices=FAMILIES)
    tiny.add_argument("--size", default="small", choices=("tiny", "small", "bench", "gpu"),
                      help="llama: tiny 0.14M parameters (16-wide heads: vLLM on CPU refuses it), "
                           "small 0.92M, bench 25.7M, gpu 0.69B (the GPU acceptance run, memory benchmarks); "
                           "gemma4, gpt_oss and nemotron_h*: tiny and small only")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--layers", type=int, default=None,
                      help="decoder layers instead of the size's (a shallower student for distillation)")
    tiny.set_defaults(func=_cmd_tiny_model)

    stacks = sub.add_parser("stacks", help="write every stack of a running run into its log directory")
    stacks.add_argument("log_dir", help="the run's logger.log_dir")
    stacks.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the dump")
    stacks.set_defaults(func=_cmd_stacks)

    evaluation = sub.add_parser("eval", help="score a model on a dataset: pass@k and majority vote (docs/evaluation.md)")
    evaluation.add_argument("--config", required=True,
                            help="an nrl config (its validation data) or NeMo RL's eval layout, with an eval section")
    evaluation.add_argument("--check", action="store_true",
                            help="validate the config and say what would run, without starting anything")
    evaluation.add_argument("overrides", nargs="*", help="key.path=value, +key.path=value, ~key.path")
    evaluation.set_defaults(func=_cmd_eval)

    convert = sub.add_parser("convert", help="convert checkpoints")
    convert_sub = convert.add_subparsers(dest="convert_command", required=True)
    to_hf = convert_sub.add_parser("checkpoint", help="an nrl training checkpoint (either backend) to a Hugging "
                                                       "Face model, checked against the checkpoint's logprobs")
    to_hf.add_argument("checkpoint", help="a step directory, or a run's checkpoint directory (its latest step)")
    to_hf.add_argument("--out", required=True, help="the Hugging Face model directory to write (new or empty)")
    to_hf.add_argument("overrides", nargs="*", help="changes to the saved config, e.g. policy.model_name=PATH")
    to_hf.set_defaults(func=_cmd_convert_checkpoint)
    _add_plugin_commands({"convert": convert_sub})

    twin = sub.add_parser("twin", help="write and train the CPU twin of a recipe: its algorithm, backends, data "
                                       "and parallelism kinds on a tiny model, for a few steps (docs/twin.md)")
    twin.add_argument("config", help="the recipe (YAML)")
    twin.add_argument("--out", default=None, help="directory for twin.yaml, its data and its run (default: twins/NAME)")
    twin.add_argument("--steps", type=int, default=2, help="training steps (default: 2)")
    twin.add_argument("--model", default=None, metavar="DIR",
                      help="a small Hugging Face model of the recipe's family (default: nrl's tiny one)")
    twin.add_argument("--algorithm", default=None, help="the algorithm (default: the one whose section the recipe sets)")
    twin.add_argument("--write-only", action="store_true", help="write the twin and check it; do not train")
    twin.set_defaults(func=_cmd_twin)

    train = sub.add_parser("train", help="run an algorithm")
    train.add_argument("algorithm", help="algorithm name (grpo, sft, ...)")
    train.add_argument("--config", required=True, help="YAML config file")
    train.add_argument("overrides", nargs="*", help="key.path=value, +key.path=value, ~key.path")
    train.set_defaults(func=_cmd_train)
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    # Overrides may follow options (``train grpo --config c.yaml a.b=1``), which argparse's
    # positional matching does not collect; take them from the leftovers.
    args, extra = parser.parse_known_args(argv)
    unknown_options = [e for e in extra if e.startswith("-") and not e.startswith("~")]
    if unknown_options or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    freeze_at_exit()
    try:
        args = _parse(argv)  # loads the plugins, whose subcommands join the parser
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                            format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
        return args.func(args)
    except WorkerRaisedError as exc:
        if os.environ.get("NRL_DEBUG"):
            raise
        print(exc.remote_traceback.rstrip(), file=sys.stderr)
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_BUG
    except NrlError as exc:
        if os.environ.get("NRL_DEBUG"):
            raise
        message = " ".join(str(exc).split())
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        failure = _take_cluster_failure()
        if failure is None:
            print("error: interrupted", file=sys.stderr)
            return 130
        print(f"error: {failure}", file=sys.stderr)
        from nrl_core.cluster.ray_cluster import shutdown_ray

        shutdown_ray()  # kills what is left of the local Ray, so nothing outlives this command
        return EXIT_USAGE


def _take_cluster_failure() -> str | None:
    """Why the local Ray died under the run (its GCS watcher interrupts the main thread), if it did,
    acknowledging the interrupt so the watcher does not end the process itself; looked up only when
    the cluster code was loaded, so the CLI itself never imports Ray."""
    watch = sys.modules.get("nrl_core.cluster.gcs_watch")
    if watch is None:
        return None
    watch.stop_watching()
    return watch.cluster_failure()


if __name__ == "__main__":
    sys.exit(main())
