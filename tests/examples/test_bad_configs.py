"""Bad configs fail in one line before any worker is built, or, when only a run can tell, at run time.

Each case is a tiny CPU recipe with overrides. ``check`` cases must fail ``nrl config check`` with
exactly one ``error:`` line naming the key (and ``nrl train`` with the same line, leaving no Ray
running: the backends' own checks run while the policy's workers import, which a failure stops
with the Ray it started); ``run`` cases pass the check, because only the run can tell (the data is read, the model
loaded, the engine started), and then fail ``nrl train`` with one line and exit 2.
docs/configuration.md ("What `nrl config check` catches") lists every case; a test keeps it so.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import ray

from nrl_core.cli import main
from nrl_core.data import write_jsonl
from nrl_core.testing.tiny_models import cached_tiny_model
from tests.launch import nrl, shared_ray

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "examples" / "configs" / "grpo_tiny_cpu.yaml"
SFT = REPO / "examples" / "configs" / "sft_tiny_cpu.yaml"
DOC = REPO / "docs" / "configuration.md"
MEG = ["policy.dtensor_config.enabled=false", "policy.megatron_cfg.enabled=true", "policy.optimizer=null"]
VLLM = "policy.generation.vllm_cfg"

# (id, recipe, overrides, key the error line names, phrase in it); {file}, {broken_model},
# {odd_experts_model} and {long_prompts} are replaced by paths the fixtures make.
CHECK_CASES = [
    ("dtensor-negative-lr", GRPO, ["policy.optimizer.kwargs.lr=-0.1"], "policy.optimizer.kwargs",
     "Invalid learning rate: -0.1"),
    ("megatron-negative-lr", GRPO, [*MEG, "policy.megatron_cfg.optimizer.lr=-0.0001"],
     "policy.megatron_cfg.optimizer.lr", "must be non-negative"),
    ("dtensor-unknown-optimizer", GRPO, ["policy.optimizer.name=torch.optim.Adamm"], "policy.optimizer.name",
     "cannot import 'torch.optim.Adamm'"),
    ("dtensor-optimizer-not-a-path", GRPO, ["policy.optimizer.name=AdamW"], "policy.optimizer.name",
     "cannot import 'AdamW'"),
    ("dtensor-unknown-optimizer-keyword", GRPO, ["+policy.optimizer.kwargs.momentumm=0.9"], "policy.optimizer.kwargs",
     "unexpected keyword argument 'momentumm'"),
    ("megatron-unknown-optimizer", GRPO, [*MEG, "policy.megatron_cfg.optimizer.optimizer=lion"],
     "policy.megatron_cfg.optimizer.optimizer", "must be one of 'adam', 'sgd'"),
    ("unknown-scheduler", GRPO, ["policy.scheduler=[{name: torch.optim.lr_scheduler.Nope}]"],
     "policy.scheduler[0].name", "cannot import"),
    ("bad-scheduler-argument", GRPO,
     ["policy.scheduler=[{name: torch.optim.lr_scheduler.LinearLR, kwargs: {start_factor: 5.0}}]"],
     "policy.scheduler[0].kwargs", "factor"),
    ("megatron-decay-without-iterations", GRPO, [*MEG, "policy.megatron_cfg.scheduler.lr_decay_style=cosine"],
     "policy.megatron_cfg.scheduler.lr_decay_iters", "is required"),
    ("megatron-min-lr-above-lr", GRPO, [*MEG, "policy.megatron_cfg.optimizer.min_lr=0.1"],
     "policy.megatron_cfg.optimizer.min_lr", "exceeds optimizer.lr"),
    ("dtensor-tp-larger-than-world", GRPO, ["policy.dtensor_config.tensor_parallel_size=4"],
     "policy.dtensor_config.tensor_parallel_size", "needs 4 ranks"),
    ("megatron-tp-larger-than-world", GRPO, [*MEG, "policy.megatron_cfg.tensor_model_parallel_size=2"],
     "policy.megatron_cfg.tensor_model_parallel_size", "needs 2 ranks"),
    ("tp-does-not-divide-world", GRPO, ["policy.dtensor_config.tensor_parallel_size=2", "cluster.gpus_per_node=3"],
     "policy.dtensor_config.tensor_parallel_size", "does not divide the 3 training workers"),
    ("dtensor-tp-vs-heads", GRPO, ["policy.dtensor_config.tensor_parallel_size=3", "cluster.gpus_per_node=3"],
     "policy.dtensor_config.tensor_parallel_size", "does not divide the model's num_attention_heads=4"),
    ("megatron-tp-vs-kv-heads", GRPO, [*MEG, "policy.megatron_cfg.tensor_model_parallel_size=4",
                                       "cluster.gpus_per_node=4"],
     "policy.megatron_cfg.tensor_model_parallel_size", "does not divide the 2 key/value heads"),
    ("megatron-pp-vs-layers", GRPO, [*MEG, "policy.megatron_cfg.pipeline_model_parallel_size=3",
                                     "cluster.gpus_per_node=3"],
     "policy.megatron_cfg.pipeline_model_parallel_size", "does not divide the 4 layers"),
    ("megatron-cp-without-transformer-engine", GRPO, [*MEG, "policy.megatron_cfg.context_parallel_size=2",
                                                      "cluster.gpus_per_node=2"],
     "policy.megatron_cfg.context_parallel_size", "needs Transformer Engine"),
    ("dtensor-context-parallel", GRPO, ["policy.dtensor_config.context_parallel_size=2", "cluster.gpus_per_node=2"],
     "policy.dtensor_config.context_parallel_size", "not supported"),
    ("vllm-tp-vs-heads", GRPO, ["policy.generation.colocated.enabled=false", "cluster.gpus_per_node=4",
                                "policy.generation.colocated.resources.gpus_per_node=3", f"{VLLM}.tensor_parallel_size=3"],
     f"{VLLM}.tensor_parallel_size", "does not divide the model's 4 attention heads"),
    ("vllm-expert-parallel-beyond-the-engine", GRPO, [f"{VLLM}.expert_parallel_size=2"],
     f"{VLLM}.expert_parallel_size", "is 1 or tensor_parallel_size (1)"),
    ("vllm-expert-parallel-on-a-dense-model", GRPO, ["policy.generation.colocated.enabled=false",
                                                     "cluster.gpus_per_node=3",
                                                     "policy.generation.colocated.resources.gpus_per_node=2",
                                                     f"{VLLM}.tensor_parallel_size=2", f"{VLLM}.expert_parallel_size=2"],
     f"{VLLM}.expert_parallel_size", "on a dense model: it has no experts to split"),
    ("vllm-expert-parallel-not-dividing-the-experts", GRPO, ["policy.model_name={odd_experts_model}",
                                                             "policy.generation.colocated.enabled=false",
                                                             "cluster.gpus_per_node=3",
                                                             "policy.generation.colocated.resources.gpus_per_node=2",
                                                             f"{VLLM}.tensor_parallel_size=2",
                                                             f"{VLLM}.expert_parallel_size=2"],
     f"{VLLM}.expert_parallel_size", "2 does not divide the model's 7 experts"),
    ("vllm-fp8-rollouts", GRPO, [f"{VLLM}.precision=fp8"], f"{VLLM}.precision", "fp8 rollouts"),
    ("vllm-colocated-engine-larger-than-world", GRPO, [f"{VLLM}.tensor_parallel_size=2"],
     f"{VLLM}.tensor_parallel_size", "does not divide the 1 training workers that host the engines"),
    ("noncolocated-without-resources", GRPO, ["policy.generation.colocated.enabled=false", "cluster.gpus_per_node=2"],
     "policy.generation.colocated.resources.gpus_per_node", "training gets cluster.gpus_per_node minus these"),
    ("noncolocated-takes-every-worker", GRPO, ["policy.generation.colocated.enabled=false", "cluster.gpus_per_node=2",
                                               "policy.generation.colocated.resources.gpus_per_node=2"],
     "policy.generation.colocated.resources.gpus_per_node", "leaves no training workers"),
    ("noncolocated-multinode-partial-nodes", GRPO, ["policy.generation.colocated.enabled=false", "cluster.num_nodes=2",
                                                    "policy.generation.colocated.resources.gpus_per_node=1",
                                                    "policy.generation.colocated.resources.num_nodes=1",
                                                    "cluster.gpus_per_node=2"],
     "policy.generation.colocated.resources.gpus_per_node", "generation takes whole nodes"),
    ("vllm-max-model-len-above-training-length", GRPO, [f"{VLLM}.max_model_len=128"], f"{VLLM}.max_model_len",
     "exceeds policy.max_total_sequence_length=64"),
    ("vllm-max-model-len-above-model", GRPO, ["policy.max_total_sequence_length=2048", f"{VLLM}.max_model_len=2048"],
     f"{VLLM}.max_model_len", "exceeds the model's maximum length 1024"),
    ("sequence-length-above-model", GRPO, ["policy.max_total_sequence_length=4096", f"{VLLM}.max_model_len=null"],
     "policy.max_total_sequence_length", "exceeds the model's maximum length 1024"),
    ("sequence-length-one", SFT, ["policy.max_total_sequence_length=1"], "policy.max_total_sequence_length",
     "must be at least 2"),
    ("global-batch-vs-micro-batch", GRPO, ["policy.train_micro_batch_size=96"], "policy.train_global_batch_size",
     "not a multiple of policy.train_micro_batch_size"),
    ("global-batch-vs-data-parallel", GRPO, ["cluster.gpus_per_node=3"], "policy.train_global_batch_size",
     "does not split over the 3 data-parallel ranks"),
    ("megatron-micro-batch-vs-shard", GRPO, [*MEG, "cluster.gpus_per_node=4"], "policy.train_micro_batch_size",
     "does not divide the 64 sequences of each of the 4 data-parallel ranks"),
    ("rollouts-vs-global-batch", GRPO, ["policy.train_global_batch_size=96", "policy.train_micro_batch_size=32"],
     "policy.train_global_batch_size", "does not divide the 256 rollouts per step"),
    ("one-generation-with-leave-one-out", GRPO, ["grpo.num_generations_per_prompt=1",
                                                "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16"],
     "grpo.num_generations_per_prompt", "leave-one-out baseline"),
    ("zero-generations-per-prompt", GRPO, ["grpo.num_generations_per_prompt=0"], "grpo.num_generations_per_prompt",
     "must be positive"),
    ("zero-prompts-per-step", GRPO, ["grpo.num_prompts_per_step=0"], "grpo.num_prompts_per_step", "must be positive"),
    ("grpo-zero-steps", GRPO, ["grpo.max_num_steps=0"], "grpo.max_num_steps", "must be positive"),
    ("grpo-negative-steps", GRPO, ["grpo.max_num_steps=-5"], "grpo.max_num_steps", "must be positive"),
    ("sft-zero-steps", SFT, ["sft.max_num_steps=0"], "sft.max_num_steps", "must be positive"),
    ("zero-epochs", GRPO, ["grpo.max_num_epochs=0"], "grpo.max_num_epochs", "must be positive"),
    ("keep-top-k-negative", GRPO, ["checkpointing.keep_top_k=-1"], "checkpointing.keep_top_k", "must be positive"),
    ("keep-top-k-zero", SFT, ["checkpointing.keep_top_k=0"], "checkpointing.keep_top_k", "must be positive"),
    ("save-period-negative", GRPO, ["checkpointing.save_period=-1"], "checkpointing.save_period",
     "must be non-negative"),
    ("val-batches-zero", SFT, ["sft.val_batches=0"], "sft.val_batches", "must be positive"),
    ("max-new-tokens-zero", GRPO, ["policy.generation.max_new_tokens=0"], "policy.generation.max_new_tokens",
     "must be positive"),
    ("negative-temperature", GRPO, ["policy.generation.temperature=-1.0"], "policy.generation.temperature",
     "must be non-negative"),
    ("zero-micro-batch", SFT, ["policy.train_micro_batch_size=0"], "policy.train_micro_batch_size",
     "must be positive"),
    ("log-dir-under-a-file", GRPO, ["logger.log_dir={file}/logs"], "logger.log_dir", "is a file"),
    ("checkpoint-dir-is-a-file", SFT, ["checkpointing.checkpoint_dir={file}"], "checkpointing.checkpoint_dir",
     "is a file, not a directory"),
    ("packing-and-dynamic-batching", SFT, ["policy.sequence_packing.enabled=true",
                                          "policy.sequence_packing.train_mb_tokens=256",
                                          "policy.dynamic_batching.enabled=true",
                                          "policy.dynamic_batching.train_mb_tokens=256"],
     "policy.sequence_packing.enabled", "cannot both be enabled"),
    ("packing-without-token-budget", SFT, ["policy.sequence_packing.enabled=true"],
     "policy.sequence_packing.train_mb_tokens", "is required"),
    ("vllm-kv-cache-zero", GRPO, [f"{VLLM}.kv_cache_space_gb=0"], f"{VLLM}.kv_cache_space_gb", "must be positive"),
    ("vllm-memory-fraction-above-one", GRPO, [f"{VLLM}.gpu_memory_utilization=1.5"],
     f"{VLLM}.gpu_memory_utilization", "must be in (0, 1]"),
    ("unknown-named-dataset", GRPO, ["++data.train={dataset_name: OpenMathInstruct}", "data.dataset_name=null"],
     "data.train[0].dataset_name", "dataset 'OpenMathInstruct' is not available"),
    ("refit-bucket-zero", GRPO, ["policy.refit.bucket_size_mb=0"], "policy.refit.bucket_size_mb", "must be positive"),
    ("dtensor-custom-plan-not-importable", GRPO, ["policy.dtensor_config.custom_parallel_plan=nowhere.plans:tp"],
     "policy.dtensor_config.custom_parallel_plan", "cannot import 'nowhere.plans'"),
    ("model-config-unreadable", SFT, ["policy.model_name={broken_model}"], "policy.model_name",
     "cannot read the config"),
    ("grpo-without-generation", GRPO, ["policy.generation=null"], "policy.generation", "GRPO generates rollouts"),
]

RUN_CASES = [
    ("vllm-kv-cache-too-small", GRPO, [f"{VLLM}.kv_cache_space_gb=0.00001"], f"{VLLM}.kv_cache_space_gb",
     f"the KV cache cannot hold one sequence of {VLLM}.max_model_len"),
    ("every-prompt-too-long", GRPO, ["data.train_data_path={long_prompts}", "data.dataset_name=null"],
     "policy.max_total_sequence_length", "have prompts too long for policy.max_total_sequence_length=64"),
    ("data-file-missing", SFT, ["data.train_data_path={missing}/train.jsonl", "data.dataset_name=null"],
     "train.jsonl", "no such file or directory"),
    ("model-without-weights", SFT, ["policy.model_name={weightless_model}"], "policy.model_name",
     "cannot load the weights"),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad-configs")
    model = cached_tiny_model("llama", size="small")
    (root / "a_file").write_text("not a directory\n")
    broken = root / "broken_model"
    shutil.copytree(model, broken, ignore=shutil.ignore_patterns("*.safetensors"))
    (broken / "config.json").write_text("{ not json")
    weightless = root / "weightless_model"
    shutil.copytree(model, weightless, ignore=shutil.ignore_patterns("*.safetensors"))
    odd_experts = cached_tiny_model("qwen3_moe", size="tiny", num_experts=7)
    long_prompts = write_jsonl([{"problem": "1 + " * 80 + "1", "expected_answer": "81"}] * 3, root / "long.jsonl")
    return {"model": str(model), "root": str(root), "file": str(root / "a_file"), "broken_model": str(broken),
            "weightless_model": str(weightless), "odd_experts_model": str(odd_experts),
            "long_prompts": str(long_prompts), "missing": str(root / "missing")}


def _arguments(recipe: Path, overrides: list[str], paths: dict[str, str], run_dir: Path) -> list[str]:
    base = [f"policy.model_name={paths['model']}", f"checkpointing.checkpoint_dir={run_dir / 'ckpt'}",
            f"logger.log_dir={run_dir / 'logs'}"]
    return [str(recipe), *base, *(_fill(o, paths) for o in overrides)]


def _fill(override: str, paths: dict[str, str]) -> str:
    for name, path in paths.items():
        override = override.replace("{" + name + "}", path)
    return override


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("case", CHECK_CASES, ids=[c[0] for c in CHECK_CASES])
def test_config_check_refuses_in_one_line(case, paths, tmp_path, capsys, monkeypatch) -> None:
    _, recipe, overrides, key, phrase = case
    algorithm = "grpo" if recipe == GRPO else "sft"
    args = _arguments(recipe, overrides, paths, tmp_path)
    code = main(["config", "check", *args])
    [line] = _error_lines(capsys.readouterr().err)
    assert code == 2 and line.startswith(f"error: {key}") and phrase in line, line
    # `nrl train` refuses it the same way and leaves nothing running (a backend's check fails on the
    # workers, after Ray started): the first case on a local Ray of its own, which it stops; the
    # others join the suite's shared Ray as a job joins a cluster, and disconnect from it.
    if case is not CHECK_CASES[0]:
        monkeypatch.setenv("RAY_ADDRESS", shared_ray())
    assert main(["train", algorithm, "--config", *args]) == 2
    assert _error_lines(capsys.readouterr().err) == [line]
    assert not ray.is_initialized()


@pytest.mark.slow
@pytest.mark.parametrize("case", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_run_time_only_mistakes_fail_train_in_one_line(case, paths, tmp_path, capsys) -> None:
    _, recipe, overrides, key, phrase = case
    algorithm = "grpo" if recipe == GRPO else "sft"
    args = _arguments(recipe, overrides, paths, tmp_path)
    assert main(["config", "check", *args]) == 0, capsys.readouterr().err
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # kv_cache_space_gb must count
    env.update(VLLM_LOGGING_LEVEL="WARNING", NRL_STRICT_PLUGINS="1")
    proc = nrl(["train", algorithm, "--config", *args, f"{algorithm}.max_num_steps=1"], env=env, cwd=tmp_path,
               timeout=600, join_shared_ray=True)
    lines = _error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-4000:]
    assert key in lines[0] and phrase in lines[0], lines[0]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]


def test_there_are_at_least_34_cases_and_the_docs_list_each() -> None:
    ids = [c[0] for c in CHECK_CASES + RUN_CASES]
    assert len(set(ids)) == len(ids) >= 34
    table = DOC.read_text()
    missing = [i for i in ids if f"`{i}`" not in table]
    assert not missing, f"docs/configuration.md lacks rows for {missing}"
