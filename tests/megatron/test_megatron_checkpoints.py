"""Starting from Megatron checkpoints, and converting between HF and Megatron outside a run.

The Megatron-LM checkpoint is written here by Megatron-Core's own ``dist_checkpointing.save`` in
Megatron-LM's layout (``latest_checkpointed_iteration.txt``, ``iter_0000007/``, the training
``args`` in ``common.pt``), at TP=2, from the HF model's weights; nrl's checkpoint manager never
touches it. Training started from it at TP=2 and at PP=2 must take the same first step as training
started from the HF model. The conversions run through the ``nrl`` command, each in its own
process, and round trips must give back the HF model's tensors bit for bit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core", reason="nrl-backend-megatron's engine is not installed")
pytest.importorskip("nrl_backend_megatron")

import torch
from _helpers import make_batch, make_config, run_world

from nrl_core.errors import NrlError
from nrl_core.testing.tiny_models import cached_tiny_model
from tests.launch import nrl

ITERATION = 7


def megatron_lm_args(hf: Any) -> argparse.Namespace:
    """What Megatron-LM's ``pretrain_gpt.py`` records for this model (its own argument names), with
    one of Megatron's enums in it, as real runs have."""
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads, group_query_attention=True,
        num_query_groups=hf.num_key_value_heads, kv_channels=hf.hidden_size // hf.num_attention_heads,
        padded_vocab_size=hf.vocab_size, untie_embeddings_and_output_weights=not hf.tie_word_embeddings,
        normalization="RMSNorm", swiglu=True, add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False,
        position_embedding_type="rope", rotary_base=10000, norm_epsilon=hf.rms_norm_eps, num_experts=None,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=1, bf16=False, params_dtype=torch.float32,
        attention_backend=AttnBackend.auto, ckpt_format="torch_dist", iteration=ITERATION)


def write_megatron_lm(rank: int, world: int, hf_path: str, root: str) -> None:
    """Megatron-LM's layout at TP=2, saved by Megatron-Core's dist_checkpointing."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from transformers import AutoConfig

    from nrl_backend_megatron import cpu_shim
    from nrl_backend_megatron.convert.mapping import hf_to_megatron
    from nrl_backend_megatron.convert.sharded import load_hf_state
    from nrl_backend_megatron.model import ParallelLayout, build_model, transformer_config
    from nrl_backend_megatron.weights import load_full_state

    cpu_shim.install()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    hf = AutoConfig.from_pretrained(hf_path)
    config = transformer_config(hf, ParallelLayout(tp=2), params_dtype=torch.float32)
    model = build_model(hf, config, pre_process=True, post_process=True)
    with torch.no_grad():
        load_full_state(model, hf_to_megatron(load_hf_state(hf_path), hf), rank, world, bool(hf.tie_word_embeddings))
    iteration = Path(root) / f"iter_{ITERATION:07d}"
    if rank == 0:
        iteration.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": megatron_lm_args(hf), "iteration": ITERATION,
                             "checkpoint_version": 3.0}, str(iteration))
    if rank == 0:
        (Path(root) / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    parallel_state.destroy_model_parallel()


def as_megatron_bridge(megatron_lm: Path, bridge: Path, hf_path: str, **model: Any) -> None:
    """The same iteration in Megatron-Bridge's layout: ``run_config.yaml`` describes the model."""
    import yaml

    iteration = bridge / f"iter_{ITERATION:07d}"
    shutil.copytree(megatron_lm / f"iter_{ITERATION:07d}", iteration)
    (iteration / "common.pt").unlink()
    section = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
               "num_query_groups": 2, "kv_channels": 16, "vocab_size": 512,
               "share_embeddings_and_output_weights": False, "normalization": "RMSNorm", "gated_linear_unit": True,
               "add_bias_linear": False, "add_qkv_bias": False, "qk_layernorm": False,
               "position_embedding_type": "rope", "rotary_base": 10000, "layernorm_epsilon": 1e-6,
               "hf_model_id": hf_path, **model}
    (iteration / "run_config.yaml").write_text(yaml.safe_dump({"model": section, "train": {"train_iters": 10}}))


def first_steps(rank: int, world: int, hf_path: str, root: str, bridge: str, other_model: str) -> dict[str, Any]:
    from nrl_backend_megatron.worker import MegatronPolicyWorker
    from nrl_core.algorithms.loss import NLLLoss

    write_megatron_lm(rank, world, hf_path, root)
    if rank == 0:
        as_megatron_bridge(Path(root), Path(bridge), hf_path)
    import torch.distributed as dist

    dist.barrier()
    tp2, pp2 = {"tensor_model_parallel_size": 2}, {"pipeline_model_parallel_size": 2}
    cases = {"hf/tp2": tp2, "megatron-lm/tp2": {**tp2, "pretrained_checkpoint": root},
             "hf/pp2": pp2, "megatron-lm/pp2": {**pp2, "pretrained_checkpoint": root},
             "megatron-bridge/pp2": {**pp2, "pretrained_checkpoint": bridge}}
    batch, out = make_batch(), {}
    for tag, megatron in cases.items():
        worker = MegatronPolicyWorker(make_config(hf_path, megatron=megatron), rank, world)
        out[tag] = worker.train(batch, NLLLoss())["loss"]
        out[f"{tag}/from"] = str(worker.conversion.path)
        del worker
    # a bare dist_checkpointing directory records no architecture: the tensors' shapes tell
    bare = Path(root).parent / "bare"
    if rank == 0:
        shutil.copytree(Path(root) / f"iter_{ITERATION:07d}", bare)
        (bare / "common.pt").unlink()
    dist.barrier()
    try:
        MegatronPolicyWorker(make_config(other_model, megatron={**tp2, "pretrained_checkpoint": str(bare)}),
                             rank, world)
    except NrlError as exc:
        out["bare/other"] = (type(exc).__name__, str(exc))
    return out


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    top = tmp_path_factory.mktemp("megatron-ckpts")
    hf_path = str(cached_tiny_model("llama"))
    other = str(cached_tiny_model("llama", intermediate_size=96))
    results = run_world(first_steps, 2, hf_path, str(top / "megatron_lm"), str(top / "bridge"), other)
    return top, results


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_training_from_a_megatron_lm_checkpoint_takes_the_hf_models_first_step(started, layout: str) -> None:
    top, results = started
    for rank in results:
        assert rank[f"megatron-lm/{layout}"] == rank[f"hf/{layout}"]
        assert rank[f"megatron-lm/{layout}/from"] == str(top / "megatron_lm" / f"iter_{ITERATION:07d}")
        assert rank[f"hf/{layout}/from"].endswith("nrl_megatron")  # the HF conversion, not the checkpoint
    assert results[0]["megatron-lm/tp2"] == pytest.approx(results[0]["megatron-lm/pp2"], abs=1e-5)


@pytest.mark.slow
def test_training_from_a_megatron_bridge_checkpoint(started) -> None:
    top, results = started
    for rank in results:
        assert rank["megatron-bridge/pp2"] == rank["hf/pp2"]
        assert rank["megatron-bridge/pp2/from"] == str(top / "bridge" / f"iter_{ITERATION:07d}")


@pytest.mark.slow
def test_a_bare_checkpoint_of_another_model_is_one_line_on_every_rank(started) -> None:
    _, results = started
    for rank in results:
        kind, message = rank["bare/other"]
        assert kind == "MegatronCheckpointError" and "\n" not in message
        assert "stores 'decoder.layers.mlp.linear_fc2.weight' as (2, 64, 128)" in message
        assert "needs (2, 64, 96)" in message and "another architecture" in message


# ---------------------------------------------------------------- bad checkpoints, one line each


def _check(path: Path, model: str | None = None) -> str:
    from transformers import AutoConfig

    from nrl_backend_megatron.checks import check_pretrained
    from nrl_core.errors import ConfigError

    model = model or str(cached_tiny_model("llama"))
    with pytest.raises(ConfigError) as caught:
        check_pretrained(str(path), AutoConfig.from_pretrained(model), model)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("policy.megatron_cfg.pretrained_checkpoint")
    return message


@pytest.mark.slow
def test_bad_megatron_checkpoints_are_one_line(started, tmp_path: Path) -> None:
    top, _ = started
    source = top / "megatron_lm"
    assert "is not a Megatron checkpoint" in _check(tmp_path)
    assert "does not exist" in _check(tmp_path / "nowhere")

    missing = tmp_path / "missing_shard"
    shutil.copytree(source, missing)
    shard = sorted((missing / f"iter_{ITERATION:07d}").glob("*.distcp"))[-1]
    shard.unlink()
    assert f"missing the shard {shard.name} its index names" in _check(missing)

    truncated = tmp_path / "truncated"
    shutil.copytree(source, truncated)
    shard = sorted((truncated / f"iter_{ITERATION:07d}").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    assert f"shard {shard.name} is truncated (100 bytes" in _check(truncated)

    ahead = tmp_path / "ahead"
    shutil.copytree(source, ahead)
    (ahead / "latest_checkpointed_iteration.txt").write_text("9")
    assert "names iteration 9, but iter_0000009 is missing" in _check(ahead)

    deeper = tmp_path / "deeper"
    shutil.copytree(source, deeper)
    common = deeper / f"iter_{ITERATION:07d}" / "common.pt"
    from transformers import AutoConfig

    args = megatron_lm_args(AutoConfig.from_pretrained(str(cached_tiny_model("llama"))))
    args.num_layers = 4
    torch.save({"args": args, "iteration": ITERATION, "checkpoint_version": 3.0}, common)
    message = _check(deeper)
    assert "another architecture: its common.pt args has num_layers=4" in message and "gives 2" in message

    bridge = tmp_path / "bridge"
    as_megatron_bridge(source, bridge, "unused", qk_layernorm=True)
    assert "its run_config.yaml model has qk_layernorm=True" in _check(bridge)


def test_a_layout_that_does_not_divide_the_model_is_one_line() -> None:
    from transformers import AutoConfig

    from nrl_backend_megatron.model import ParallelLayout
    from nrl_backend_megatron.parallel import check_layout
    from nrl_core.errors import ConfigError

    hf = AutoConfig.from_pretrained(str(cached_tiny_model("llama")))
    for layout, world, says in ((ParallelLayout(tp=4), 4, "4 does not divide the 2 key/value heads"),
                                (ParallelLayout(pp=4), 4, "4 does not divide the 2 layers"),
                                (ParallelLayout(tp=3), 3, "3 does not divide the 4 attention heads")):
        with pytest.raises(ConfigError, match=says):
            check_layout(layout, world, hf)


# ---------------------------------------------------------------- nrl convert


def nrl_convert(*args: str) -> subprocess.CompletedProcess:
    return nrl(["convert", *args], env={**os.environ, "PYTHONWARNINGS": "ignore"})


def assert_same_tensors(model: Path, original: Path) -> None:
    from safetensors.torch import load_file

    ours, theirs = load_file(str(model / "model.safetensors")), load_file(str(original / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def assert_same_logits(model: Path, original: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = torch.randint(4, 500, (3, 20), generator=torch.Generator().manual_seed(0))
    ours, theirs = (AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32).eval() for p in (model, original))
    with torch.no_grad():
        assert (ours(ids).logits - theirs(ids).logits).abs().max() < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_convert_round_trip_hf_to_megatron_lm_to_hf(tmp_path: Path, family: str) -> None:
    original = cached_tiny_model(family)
    megatron, back = tmp_path / "megatron", tmp_path / "hf"
    done = nrl_convert("hf-to-megatron", str(original), "--out", str(megatron))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "its logprobs are within" in done.stdout
    assert (megatron / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert {p.name for p in (megatron / "release").iterdir()} >= {"metadata.json", ".metadata", "common.pt"}
    done = nrl_convert("megatron-to-hf", str(megatron), "--out", str(back))
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_tensors(back, original)
    assert_same_logits(back, original)


@pytest.mark.slow
def test_convert_a_tp2_megatron_lm_checkpoint_to_hf(started, tmp_path: Path) -> None:
    top, _ = started
    original = cached_tiny_model("llama")
    back = tmp_path / "hf"
    done = nrl_convert("megatron-to-hf", str(top / "megatron_lm"), "--out", str(back), "--hf-config", str(original))
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_tensors(back, original)
    assert (back / "tokenizer.json").is_file()


def test_convert_bad_inputs_are_one_line_and_write_nothing(tmp_path: Path) -> None:
    from nrl_backend_megatron.conversions import hf_to_megatron, megatron_to_hf

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(NrlError, match="exists and is not empty"):
        hf_to_megatron(str(cached_tiny_model("llama")), str(taken))
    with pytest.raises(NrlError, match="is not a Hugging Face model directory"):
        hf_to_megatron(str(tmp_path), None)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    with pytest.raises(NrlError, match="carries no Hugging Face config .* pass --hf-config DIR"):
        megatron_to_hf(str(bare), str(tmp_path / "out"))
    (bare / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    with pytest.raises(NrlError, match="saved with the 'zarr' backend"):
        megatron_to_hf(str(bare), str(tmp_path / "out"))
    assert (taken / "keep.txt").read_text() == "mine" and not (tmp_path / "out").exists()
