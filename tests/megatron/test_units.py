"""Fast in-process tests: schema knobs, plugin registration, directory resolution, conversion
caching and its failure modes, layout checks, weight mapping round trip."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="nrl-backend-megatron's engine is not installed")
pytest.importorskip("nrl_backend_megatron")

from nrl_backend_megatron import checkpoint_dir as cd
from nrl_backend_megatron.schema import MEGATRON_CFG_SCHEMA
from nrl_core.contracts import CheckpointOptions
from nrl_core.errors import ConfigError
from nrl_core.testing.tiny_models import cached_tiny_model, model_config

KEY = "policy.megatron_cfg"


def validate(section: dict) -> dict:
    return MEGATRON_CFG_SCHEMA.validate(section, KEY)


# ------------------------------------------------------------------ knobs: default and user value
KNOB_DEFAULTS = {"fully_parallel_save": True, "fully_parallel_load": True, "async_save": False, "load_rng": False,
                 "distributed_timeout_minutes": None, "check_for_nan_in_grad": True, "logging_level": logging.INFO,
                 "force_reconvert_from_hf": False}
KNOB_VALUES = {"fully_parallel_save": False, "fully_parallel_load": False, "async_save": True, "load_rng": True,
               "distributed_timeout_minutes": 7, "check_for_nan_in_grad": False, "logging_level": "WARNING",
               "force_reconvert_from_hf": True}


@pytest.mark.parametrize("knob", sorted(KNOB_DEFAULTS))
def test_knob_default_and_user_value(knob: str) -> None:
    assert validate({})[knob] == KNOB_DEFAULTS[knob]
    assert validate({knob: KNOB_VALUES[knob]})[knob] == KNOB_VALUES[knob]


def test_nested_checkpoint_spelling_is_an_alias() -> None:
    out = validate({"checkpoint": {"async_save": True, "load_rng": True}})
    assert out["async_save"] is True and out["load_rng"] is True and "checkpoint" not in out
    assert CheckpointOptions.from_section(out) == CheckpointOptions(async_save=True, load_rng=True)
    with pytest.raises(ConfigError, match="conflicts"):
        validate({"async_save": False, "checkpoint": {"async_save": True}})


def test_inert_nemo_rl_keys_accepted_and_unknown_rejected() -> None:
    validate({"expert_model_parallel_size": 1, "moe_router_dtype": None, "apply_rope_fusion": True})
    with pytest.raises(ConfigError, match="did you mean"):
        validate({"tensor_model_paralel_size": 2})


def test_plugin_registers_backend() -> None:
    from nrl_backend_megatron import plugin

    (spec,) = plugin.nrl_training_backends()
    assert (spec.name, spec.config_key, spec.priority) == ("megatron", "megatron_cfg", 20)
    assert spec.worker == "nrl_backend_megatron.worker:MegatronPolicyWorker"
    assert not hasattr(plugin, "nrl_checkpoint_save")  # the core calls the worker's own methods


def test_logging_level_reaches_megatron_loggers() -> None:
    from nrl_backend_megatron.worker import set_megatron_logging

    assert set_megatron_logging(logging.INFO) == logging.INFO
    assert logging.getLogger("megatron.core").level == logging.INFO
    set_megatron_logging("WARNING")
    assert logging.getLogger("megatron.core").level == logging.WARNING
    with pytest.raises(ConfigError):
        set_megatron_logging("LOUD")


def test_distributed_timeout_flows_into_process_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core import parallel_state

    from nrl_backend_megatron import parallel
    from nrl_backend_megatron.model import ParallelLayout

    seen: dict = {}
    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel.dist, "init_process_group", lambda **kw: seen.setdefault("pg", kw))
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: False)
    monkeypatch.setattr(parallel_state, "initialize_model_parallel", lambda **kw: seen.setdefault("mp", kw))
    parallel.ensure_process_group(0, 1, None)
    parallel.init_model_parallel(ParallelLayout(), None)
    assert "timeout" not in seen["pg"] and "distributed_timeout_minutes" not in seen["mp"]  # framework defaults
    seen.clear()
    parallel.ensure_process_group(0, 1, 7)
    parallel.init_model_parallel(ParallelLayout(), 7)
    assert seen["pg"]["timeout"].total_seconds() == 420 and seen["mp"]["distributed_timeout_minutes"] == 7


# ------------------------------------------------------------------ directory resolution
def test_checkpoint_root_priority(tmp_path: Path) -> None:
    home = str(tmp_path / "home")
    assert cd.checkpoint_root({"HOME": home}) == Path(home) / ".cache/huggingface/nemo_rl"
    assert cd.checkpoint_root({"HOME": home, "HF_HOME": "/hf"}) == Path("/hf/nemo_rl")
    assert cd.checkpoint_root({"HOME": home, "HF_HOME": "/hf", cd.ENV_VAR: "/explicit"}) == Path("/explicit")
    assert cd.checkpoint_root({"HOME": home, cd.ENV_VAR: "/explicit"}) == Path("/explicit")
    assert cd.checkpoint_root({"HOME": home, "HF_HOME": "/hf", cd.ENV_VAR: "  "}) == Path("/hf/nemo_rl")
    assert cd.checkpoint_root({"HOME": home, "HF_HOME": "", cd.ENV_VAR: ""}) == Path(home) / ".cache/huggingface/nemo_rl"


def test_model_subdir_naming(tmp_path: Path) -> None:
    assert cd.model_subdir("Qwen/Qwen3-0.6B") == Path("Qwen/Qwen3-0.6B")
    local = tmp_path / "my model"
    local.mkdir()
    sub = cd.model_subdir(str(local))
    assert sub.name.startswith("model_") and "/" not in str(sub) and str(local).strip("/").replace("/", "_") in str(sub)
    hashed = cd.model_subdir("Qwen/Qwen3-0.6B", {"rope_theta": 5.0})
    assert hashed.parent == Path("Qwen") and hashed.name.startswith("Qwen3-0.6B-") and hashed != cd.model_subdir(
        "Qwen/Qwen3-0.6B", {"rope_theta": 6.0})


# ------------------------------------------------------------------ conversion life cycle
def _writer(value: bytes, calls: list):
    def write(out: Path) -> None:
        calls.append(out)
        (out / cd.DIST_METADATA).write_text("{}")
        (out / "__0_0.distcp").write_bytes(value * 8)
    return write


def _ident(name: str = "m") -> dict:
    return cd.identity(name, {"a": 1}, None)


def test_conversion_is_cached(tmp_path: Path) -> None:
    target = tmp_path / "org" / "m" / cd.CONVERSION_DIRNAME
    calls: list = []
    first = cd.ensure_converted(target, _ident(), _writer(b"1", calls))
    marker = target / cd.MARKER
    stat = marker.stat()
    second = cd.ensure_converted(target, _ident(), _writer(b"2", calls))
    assert first.converted and not second.converted and len(calls) == 1
    assert (marker.stat().st_ino, marker.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
    forced = cd.ensure_converted(target, _ident(), _writer(b"3", calls), force=True)
    assert forced.converted and len(calls) == 2 and marker.stat().st_ino != stat.st_ino
    assert not [p for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.tmp")]
    assert cd.require_converted(target, _ident(), rank=1) == cd.Conversion(target, converted=False)


def test_bad_conversions_are_one_line_errors(tmp_path: Path) -> None:
    target = tmp_path / "m"
    cd.ensure_converted(target, _ident(), _writer(b"1", []))
    with pytest.raises(cd.CheckpointDirError, match="another model") as err:
        cd.ensure_converted(target, _ident("other"), _writer(b"1", []))
    assert "\n" not in str(err.value)
    data = target / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-4])  # truncated
    with pytest.raises(cd.CheckpointDirError, match=r"corrupt \(__0_0.distcp missing or truncated\)"):
        cd.ensure_converted(target, _ident(), _writer(b"1", []))
    partial = tmp_path / "p"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"junk")
    with pytest.raises(cd.CheckpointDirError, match="incomplete"):
        cd.ensure_converted(partial, _ident(), _writer(b"1", []))


def _parts_writer(out: Path) -> None:
    """A conversion saved part by part: each part a checkpoint of its own, listed in parts.json."""
    for name in ("part-00000", "part-00001"):
        (out / name).mkdir()
        (out / name / cd.DIST_METADATA).write_text("{}")
        (out / name / "__0_0.distcp").write_bytes(b"1" * 8)
    (out / cd.PARTS).write_text(json.dumps({"parts": [{"dir": "part-00000", "keys": ["a"]},
                                                      {"dir": "part-00001", "keys": ["b"]}]}))


def test_a_conversion_in_parts_is_verified_part_by_part(tmp_path: Path) -> None:
    target = tmp_path / "m"
    assert cd.ensure_converted(target, _ident(), _parts_writer).converted
    assert not cd.ensure_converted(target, _ident(), _parts_writer).converted  # reused
    shutil.rmtree(target / "part-00001")
    with pytest.raises(cd.CheckpointDirError, match=r"corrupt \(part-00001/__0_0.distcp missing or truncated\)"):
        cd.require_converted(target, _ident(), rank=1)
    listed = tmp_path / "listed"
    cd.ensure_converted(listed, _ident(), _parts_writer)
    (listed / cd.PARTS).write_text(json.dumps({"parts": [{"dir": "part-00002", "keys": ["c"]}]}))
    with pytest.raises(cd.CheckpointDirError, match=r"corrupt \(parts.json missing or truncated\)"):
        cd.require_converted(listed, _ident(), rank=1)


def test_a_rank_that_cannot_see_the_conversion_names_the_directory_and_the_variable(tmp_path: Path) -> None:
    unseen = tmp_path / "elsewhere" / cd.CONVERSION_DIRNAME
    with pytest.raises(cd.CheckpointDirError) as err:
        cd.require_converted(unseen, _ident(), rank=3)
    message = str(err.value)
    assert "\n" not in message and message.startswith("rank 3 on ")
    assert str(unseen) in message and cd.ENV_VAR in message


def test_failed_conversion_never_overwrites_a_good_one(tmp_path: Path) -> None:
    target = tmp_path / "m"
    cd.ensure_converted(target, _ident(), _writer(b"1", []))

    def crash(out: Path) -> None:
        (out / "__0_0.distcp").write_bytes(b"half")
        raise RuntimeError("killed mid-conversion")

    with pytest.raises(RuntimeError):
        cd.ensure_converted(target, _ident(), crash, force=True)
    assert (target / "__0_0.distcp").read_bytes() == b"1" * 8
    assert not cd.ensure_converted(target, _ident(), crash).converted
    assert [p.name for p in tmp_path.iterdir() if p.name != ".m.lock"] == ["m"]


def test_a_nemo_rl_conversion_beside_ours_is_left_alone(tmp_path: Path) -> None:
    """NeMo RL converts into ``<model dir>/iter_0000000``; nrl into ``<model dir>/nrl_megatron``,
    and forcing a reconversion replaces only its own."""
    model_dir = cd.converted_dir("org/m", None, {cd.ENV_VAR: str(tmp_path)}).parent
    theirs = model_dir / cd.NEMO_RL_DIRNAME
    theirs.mkdir(parents=True)
    (theirs / "run_config.yaml").write_text("theirs")
    target = model_dir / cd.CONVERSION_DIRNAME
    cd.ensure_converted(target, _ident(), _writer(b"1", []))
    cd.ensure_converted(target, _ident(), _writer(b"2", []), force=True)
    assert cd.nemo_rl_conversion(target) == theirs and (theirs / "run_config.yaml").read_text() == "theirs"
    assert sorted(p.name for p in model_dir.iterdir() if not p.name.startswith(".")) == [cd.NEMO_RL_DIRNAME,
                                                                                         cd.CONVERSION_DIRNAME]


# ------------------------------------------------------------------ mapping and model checks
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_hf_megatron_hf_round_trip_is_bit_identical(family: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from nrl_backend_megatron.convert import canonical_shapes, hf_to_megatron, megatron_to_hf

    path = cached_tiny_model(family)
    cfg = AutoConfig.from_pretrained(path)
    hf = load_file(str(path / "model.safetensors"))
    mg = hf_to_megatron(hf, cfg)
    assert {k: tuple(v.shape) for k, v in mg.items()} == canonical_shapes(cfg)
    back = megatron_to_hf(mg, cfg)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_tied_embeddings_round_trip() -> None:
    from nrl_backend_megatron.convert import hf_to_megatron, megatron_to_hf

    cfg = model_config("qwen3", tie_word_embeddings=True)
    cfg.architectures = ["Qwen3ForCausalLM"]
    hf = {k: torch.randn(v) for k, v in _hf_shapes(cfg).items()}
    mg = hf_to_megatron(hf, cfg)
    assert "output_layer.weight" not in mg
    assert all(torch.equal(megatron_to_hf(mg, cfg)[k], hf[k]) for k in hf)


def _hf_shapes(cfg) -> dict:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}


def test_unsupported_architecture_is_one_line() -> None:
    from transformers import GPT2Config

    from nrl_backend_megatron.convert import family_of

    cfg = GPT2Config()
    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ConfigError, match="supported: DeepseekV3ForCausalLM, Glm4MoeLiteForCausalLM, GptOssForCausalLM, LlamaForCausalLM, NemotronHForCausalLM, Qwen2") as err:
        family_of(cfg)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("layout,world,match", [
    (dict(tp=3), 3, "attention heads"),
    (dict(tp=4), 4, "key/value heads"),
    (dict(pp=3), 3, "layers"),
    (dict(tp=2), 3, "world size"),
    (dict(cp=2), 2, "Transformer Engine"),
])
def test_indivisible_layouts_are_one_line_errors(layout: dict, world: int, match: str) -> None:
    from nrl_backend_megatron.model import ParallelLayout
    from nrl_backend_megatron.parallel import check_layout

    cfg = model_config("llama")  # 4 heads, 2 kv heads, 2 layers
    with pytest.raises(ConfigError, match=match) as err:
        check_layout(ParallelLayout(**layout), world, cfg)
    assert "\n" not in str(err.value) and str(err.value).startswith("policy.megatron_cfg.")


@pytest.mark.parametrize("optimizer, key", [({"bf16": True}, "bf16"),
                                            ({"use_precision_aware_optimizer": True}, "use_precision_aware_optimizer")])
def test_what_needs_cuda_is_one_line_on_cpu(optimizer: dict, key: str) -> None:
    """Megatron's mixed-precision optimizer keeps CUDA tensors; Transformer Engine provides the
    precision-aware one: without them, one line naming the key, before any model work. (The
    distributed optimizer runs on the CPU: tests/megatron/test_parallel.py.)"""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine builds these optimizers")
    from nrl_backend_megatron.optim import build_optimizer

    section = validate({"optimizer": optimizer})
    with pytest.raises(ConfigError, match=f"^{KEY}.optimizer.{key}: .*(CUDA|Transformer Engine)"):
        build_optimizer([], section, "float32")


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
@pytest.mark.parametrize("window_left,with_sinks", [(None, False), (3, False), (None, True), (3, True)])
def test_packed_attention_runs_each_sequence_on_its_own(heads: int, groups: int, window_left: int | None,
                                                       with_sinks: bool) -> None:
    """The packed (THD) path splits the row at ``cu_seqlens`` and equals the block-diagonal causal
    mask it replaced (which held row-length^2 scores per head and layer: out of memory on a GPU),
    grouped-query attention and trailing padding included; with gpt-oss's sliding window (a query
    sees ``window_left`` keys before its own) and its sink logit per head, which takes a share of
    each softmax and is dropped."""
    from types import SimpleNamespace

    from nrl_backend_megatron.packed_attention import PackedDotProductAttention, block_causal_mask

    g = torch.Generator().manual_seed(0)
    total, dim, scale = 23, 8, 0.3
    q = torch.randn(total, heads, dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(total, groups, dim, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(heads, generator=g, dtype=torch.float64) if with_sinks else None
    cu = torch.tensor([0, 5, 5, 14, 20])  # an empty sequence, then 3 tokens of padding
    window = None if window_left is None else (window_left, 0)
    this = SimpleNamespace(attention_dropout=torch.nn.Dropout(0.0), training=True, softmax_scale=scale,
                           scale_mask_softmax=SimpleNamespace(window_size=window), softmax_offset=sinks)
    out = PackedDotProductAttention._per_sequence(this, q, k, v, cu)

    kk, vv = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
    scores = torch.einsum("thd,shd->hts", q, kk) * scale
    masked = block_causal_mask(cu, total)[0]
    if window_left is not None:
        i = torch.arange(total)
        masked = masked | (i[None, :] < i[:, None] - window_left)
    scores = scores.masked_fill(masked, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[:, None, None].expand(heads, total, 1)], dim=-1)
    probs = scores.softmax(-1)[..., :total]
    expected = torch.einsum("hts,shd->thd", probs, vv).reshape(total, 1, heads * dim)
    assert out.shape == (total, 1, heads * dim)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def _built_parameter_dtypes(rank: int, world: int, family: str) -> dict:
    from megatron.core import tensor_parallel

    from nrl_backend_megatron import cpu_shim
    from nrl_backend_megatron.model import ParallelLayout, build_model, transformer_config
    from nrl_backend_megatron.parallel import init_model_parallel

    cpu_shim.install()
    init_model_parallel(ParallelLayout(), None)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(cached_tiny_model(family))
    config = transformer_config(hf, ParallelLayout(), params_dtype=torch.bfloat16, bf16=True)
    model = build_model(hf, config, pre_process=True, post_process=True)
    return {name: str(p.dtype) for name, p in model.named_parameters() if p.dtype != torch.bfloat16}


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_every_parameter_is_built_in_the_training_dtype(family: str) -> None:
    """Megatron's bf16 optimizer checkpoints through its bf16 parameters only: the local spec's
    norm weights, built in fp32 whatever params_dtype says, failed the first save on a GPU."""
    from nrl_core.testing.distributed import run_distributed

    assert run_distributed(_built_parameter_dtypes, 1, family) == [{}]


def test_the_cpu_shim_keeps_the_meta_device_context_and_transformers_loads_intact(tmp_path) -> None:
    """In a fresh process with the shim installed first: ``with torch.device("meta")`` still puts
    torch's factory functions on "meta", and a transformers model loaded afterwards has the RoPE
    frequencies it computes (they were left uninitialised when the shim's wrappers stood in for
    torch's functions in the meta context's set)."""
    import subprocess
    import sys

    from nrl_core.testing.tiny_models import cached_tiny_model

    code = (
        "import sys, torch\n"
        "from nrl_backend_megatron import cpu_shim\n"
        "cpu_shim.install()\n"
        "with torch.device('meta'):\n"
        "    assert torch.empty(2).device.type == 'meta' and torch.tensor([]).device.type == 'meta'\n"
        "from transformers import AutoModelForCausalLM, LlamaConfig\n"
        "from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)\n"
        "expected = LlamaRotaryEmbedding(model.config).inv_freq\n"
        "assert torch.equal(model.model.rotary_emb.inv_freq, expected), model.model.rotary_emb.inv_freq\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(cached_tiny_model("llama"))], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("saved, run, refused", [(None, True, False), (None, False, False), (False, True, True),
                                                 (True, False, True), (True, True, False)])
def test_a_checkpoint_of_the_other_optimizer_kind_is_one_line(tmp_path: Path, saved, run, refused) -> None:
    """The marker says which optimizer's state a checkpoint holds; one written before it said so
    (no key) loads as before, and the other kind is refused naming the key that fixes it."""
    import json

    from nrl_backend_megatron.ckpt_io import MARKER, REQUIRED_FILES, CheckpointIO
    from nrl_core.errors import NrlError

    for name in REQUIRED_FILES:
        (tmp_path / name).write_bytes(b"")
    meta = {"model_name": "m", **({} if saved is None else {"distributed_optimizer": saved})}
    (tmp_path / MARKER).write_text(json.dumps(meta))
    io = CheckpointIO({"model_name": "m"}, distributed_optimizer=run)
    if not refused:
        io.check(str(tmp_path))
        return
    with pytest.raises(NrlError) as err:
        io.check(str(tmp_path))
    assert "\n" not in str(err.value) and f"use_distributed_optimizer: {str(saved).lower()}" in str(err.value)
