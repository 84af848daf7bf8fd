"""Every malformed config is exit 2 with one line ``error: <key.path>: ...`` and no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nrl_core.cli import main
from nrl_core.errors import ConfigError

from .conftest import VALID

# (case id, files {name: text}, overrides, the key path or file the one line must name, a phrase)
CASES = [
    ("wrong-type-int", {"c.yaml": VALID.replace("train_global_batch_size: 8", "train_global_batch_size: eight")},
     [], "policy.train_global_batch_size", "must be an integer"),
    ("wrong-type-bool", {"c.yaml": VALID + "data: {shuffle: 'yes'}\n"}, [], "data.shuffle", "must be a boolean"),
    ("wrong-type-section", {"c.yaml": "policy: just-a-string\n"}, [], "policy", "must be a mapping"),
    ("wrong-type-list-item", {"c.yaml": VALID}, ["policy.generation.stop_strings=[1, 2]"],
     "policy.generation.stop_strings[0]", "must be a string"),
    ("float-for-int", {"c.yaml": VALID}, ["grpo.num_prompts_per_step=2.5"], "grpo.num_prompts_per_step", "integer"),
    ("bad-choice", {"c.yaml": VALID}, ["policy.precision=fp64"], "policy.precision", "must be one of"),
    ("bad-kl-type", {"c.yaml": VALID}, ["loss_fn.reference_policy_kl_type=k4"], "loss_fn.reference_policy_kl_type", "k3"),
    ("unknown-top-level", {"c.yaml": VALID + "polcy: {}\n"}, [], "polcy", "did you mean 'policy'"),
    ("unknown-depth-2", {"c.yaml": VALID}, ["policy.modle_name=/x"], "policy.modle_name", "did you mean 'model_name'"),
    ("unknown-depth-3", {"c.yaml": VALID}, ["policy.generation.temprature=0.5"], "policy.generation.temprature",
     "did you mean 'temperature'"),
    ("unknown-depth-5", {"c.yaml": VALID}, ["policy.generation.colocated.resources.gpu_per_node=1"],
     "policy.generation.colocated.resources.gpu_per_node", "did you mean 'gpus_per_node'"),
    ("unknown-plugin-key", {"c.yaml": VALID}, ["policy.alpha_cfg.tensor_paralel_size=2"],
     "policy.alpha_cfg.tensor_paralel_size", "did you mean 'tensor_parallel_size'"),
    ("missing-required-key", {"c.yaml": VALID.replace("  model_name: /models/tiny\n", "")}, [],
     "policy.model_name", "required key is missing"),
    ("missing-policy", {"c.yaml": "grpo: {seed: 1}\n"}, [], "policy", "required section is missing"),
    ("override-no-equals", {"c.yaml": VALID}, ["policy.model_name"], "overrides", "is not an override"),
    ("override-bad-path", {"c.yaml": VALID}, ["policy..model_name=x"], "overrides", "invalid key path"),
    ("override-add-existing", {"c.yaml": VALID}, ["+policy.model_name=/x"], "policy.model_name", "already exists"),
    ("override-delete-missing", {"c.yaml": VALID}, ["~policy.not_there"], "policy.not_there", "no such key"),
    ("override-into-scalar", {"c.yaml": VALID}, ["policy.model_name.x=1"], "policy.model_name", "is not a section"),
    ("defaults-missing-file", {"c.yaml": "defaults: nowhere.yaml\n" + VALID}, [], "defaults", "does not exist"),
    ("defaults-cycle", {"c.yaml": "defaults: d.yaml\n" + VALID, "d.yaml": "defaults: c.yaml\n"}, [],
     "defaults", "inheritance cycle"),
    ("defaults-not-a-name", {"c.yaml": "defaults: {a: 1}\n" + VALID}, [], "defaults", "file name"),
    ("not-yaml", {"c.yaml": "policy: [unclosed\n  model_name: x\n"}, [], "c.yaml", "not valid YAML"),
    ("binary-file", {"c.yaml": b"\xff\xfe\x00\x01policy"}, [], "c.yaml", "UTF-8"),
    ("empty-file", {"c.yaml": ""}, [], "c.yaml", "empty"),
    ("top-level-list", {"c.yaml": "- a\n- b\n"}, [], "c.yaml", "mapping of sections"),
    ("duplicate-yaml-key", {"c.yaml": VALID + "grpo: {seed: 3}\n"}, [], "c.yaml", "duplicate key 'grpo'"),
    ("interpolation-missing", {"c.yaml": VALID}, ["policy.tokenizer.name=${policy.nope}"], "policy.tokenizer.name",
     "does not exist"),
    ("interpolation-cycle", {"c.yaml": VALID}, ["grpo.seed=${grpo.val_period}", "grpo.val_period=${grpo.seed}"],
     "grpo", "interpolation cycle"),
    ("interpolation-unknown-function", {"c.yaml": VALID}, ["grpo.seed=${pow:2,3}"], "grpo.seed", "unknown interpolation"),
    ("interpolation-unclosed", {"c.yaml": VALID}, ["policy.tokenizer.name=${policy.model_name"], "policy.tokenizer.name",
     "unclosed"),
    ("batch-not-multiple", {"c.yaml": VALID}, ["policy.train_micro_batch_size=3"], "policy.train_global_batch_size",
     "not a multiple"),
    ("non-positive", {"c.yaml": VALID}, ["cluster.gpus_per_node=0"], "cluster.gpus_per_node", "must be positive"),
    ("top-p-range", {"c.yaml": VALID}, ["policy.generation.top_p=1.5"], "policy.generation.top_p", "(0, 1]"),
    ("val-temperature", {"c.yaml": VALID}, ["policy.generation.val_temperature=0.5"],
     "policy.generation.val_temperature", "validates greedily (0) or at policy.generation.temperature"),
    ("val-top-p", {"c.yaml": VALID}, ["policy.generation.val_top_p=0.5"], "policy.generation.val_top_p",
     "0.5 differs from policy.generation.top_p (1.0): validation sampling of its own is NeMo RL's NeMo Gym path"),
    ("no-backend-enabled", {"c.yaml": VALID}, ["policy.alpha_cfg.enabled=false"], "policy", "no training backend is enabled"),
    ("unknown-generation-backend", {"c.yaml": VALID}, ["policy.generation.backend=vllmm"], "policy.generation.backend",
     "not available"),
    ("nemo-rl-generation-backend", {"c.yaml": VALID}, ["policy.generation.backend=sglang"], "policy.generation.backend",
     "'sglang' is NeMo RL's SGLang generation backend, which nrl lacks"),
    ("megatron-generation", {"c.yaml": VALID}, ["policy.generation.backend=megatron"], "policy.generation.backend",
     "generation with Megatron-Core's inference engine, which nrl lacks"),
    ("nemo-gym", {"c.yaml": VALID}, ["+env.should_use_nemo_gym=true"], "env.should_use_nemo_gym",
     "NeMo Gym's switch (its environments and rollout servers), a feature nrl lacks"),
    ("unknown-environment", {"c.yaml": VALID}, ["+env.chess={}"], "env.chess", "environment 'chess' is not available"),
    ("null-for-required-value", {"c.yaml": VALID}, ["policy.max_total_sequence_length=null"],
     "policy.max_total_sequence_length", "got null"),
    ("config-file-missing", {}, [], "c.yaml", "does not exist"),
    ("log-dir-in-proc", {"c.yaml": VALID}, ["logger.log_dir=/proc/nrl-logs"], "logger.log_dir",
     "'/proc/nrl-logs' cannot be created: '/proc' "),  # refuses new directories (root), is not writable
    ("checkpoint-dir-in-proc", {"c.yaml": VALID}, ["checkpointing.enabled=true", "checkpointing.checkpoint_dir=/proc/x"],
     "checkpointing.checkpoint_dir", "'/proc/x' cannot be created: '/proc' "),
    ("dual-clip-too-small", {"c.yaml": VALID}, ["loss_fn.ratio_clip_c=0.5"], "loss_fn.ratio_clip_c", "greater than 1"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_config_is_one_line(case, tmp_path, capsys, example_backends):
    _, files, overrides, key_path, phrase = case
    for name, text in files.items():
        target = tmp_path / name
        target.write_bytes(text if isinstance(text, bytes) else text.encode())
    code = main(["config", "check", str(tmp_path / "c.yaml"), *overrides])
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2
    assert len(err_lines) == 1, err_lines
    line = err_lines[0]
    assert key_path in line and phrase in line, line


def test_at_least_25_distinct_cases():
    assert len({c[0] for c in CASES}) >= 25


def test_the_command_itself_prints_no_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy:\n  model_name: /m\n  precision: fp64\n")
    proc = subprocess.run([sys.executable, "-m", "nrl_core.cli", "config", "check", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: policy.precision: must be one of 'float32', 'bfloat16', 'float16', got 'fp64'"]


def test_a_field_whose_default_is_null_accepts_an_explicit_null():
    from nrl_core.schema import Field, Section

    schema = Section(fields={"seed": Field(type=int, default=None)})
    assert schema.validate({"seed": None}) == {"seed": None}
    assert schema.validate({}) == {"seed": None}


def test_an_enabled_section_of_an_uninstalled_backend_says_what_to_install(write):
    from nrl_core.algorithms.installed import load_and_validate

    path = write("c.yaml", "policy: {model_name: /m, my_backend_cfg: {enabled: true}}\n")
    with pytest.raises(ConfigError, match=r"^policy.my_backend_cfg: is enabled but no installed plugin provides this "
                                          r"section; install the plugin that does"):
        load_and_validate(path)
