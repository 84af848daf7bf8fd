"""What each spawned rank runs in the MoE tests (importable by name from spawned processes).

Every function builds real workers on the tiny random-init MoE models, exercises them and returns
plain results; the assertions live in the test modules. Megatron workers of one world share the
process (each build re-creates Megatron's parallel groups), so scenarios are grouped per world.
"""

from __future__ import annotations

from typing import Any

import torch
from _helpers import make_batch, make_config

from nrl_core.testing.distributed import gather_shards


def moe_paths() -> dict[str, str]:
    """The tiny MoE models the scenarios use (built once, cached)."""
    from nrl_core.testing.tiny_models import cached_tiny_model

    return {"qwen3_moe": str(cached_tiny_model("qwen3_moe")), "qwen2_moe": str(cached_tiny_model("qwen2_moe")),
            "qwen3_moe_sparse2": str(cached_tiny_model("qwen3_moe", decoder_sparse_step=2)),
            "qwen3_moe_kv2": str(cached_tiny_model("qwen3_moe", num_key_value_heads=2))}


def _loss() -> Any:
    from nrl_core.algorithms.loss import NLLLoss

    return NLLLoss()


def _logits(worker: Any, batch: Any) -> torch.Tensor:
    pos = torch.arange(batch.input_ids.shape[1])[None].expand(batch.size, -1)
    worker.model.eval()
    with torch.no_grad():
        out = worker.model(batch.input_ids, pos, None).float()
    worker.model.train()
    return out


def _export(worker: Any, bucket_bytes: int = 1 << 30) -> dict[str, torch.Tensor]:
    return {n: t for bucket in worker.export_weights(bucket_bytes, "float32") for n, t in bucket}


def _counting_gathers(fn: Any) -> tuple[Any, int]:
    """``fn()`` and how many ``all_gather`` collectives it ran."""
    import torch.distributed as dist

    original, calls = dist.all_gather, [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    dist.all_gather = counted
    try:
        return fn(), calls[0]
    finally:
        dist.all_gather = original


def megatron_world1(rank: int, world: int, paths: dict[str, str]) -> dict[str, Any]:
    """HF parity of every MoE shape, the single-rank baseline, and the moe_* keys taking effect."""
    from nrl_backend_megatron.worker import MegatronPolicyWorker

    out: dict[str, Any] = {}
    batch = make_batch()
    for name in ("qwen2_moe", "qwen3_moe_sparse2"):
        w = MegatronPolicyWorker(make_config(paths[name]), rank, world)
        out[f"{name}/logits"] = _logits(w, batch)
        out[f"{name}/export"] = _export(w)
    path = paths["qwen3_moe"]
    w = MegatronPolicyWorker(make_config(path), rank, world)
    out["logits"] = _logits(w, batch)
    out["logprobs"] = gather_shards(w.get_logprobs(batch), batch)
    out["initial"] = _export(w)
    out["metrics"] = [w.train(batch, _loss()) for _ in range(3)]
    out["tconfig"] = {k: getattr(w.tconfig, k) for k in (
        "num_moe_experts", "moe_router_topk", "moe_router_pre_softmax", "moe_token_dispatcher_type",
        "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_router_dtype", "moe_grouped_gemm")}

    w = MegatronPolicyWorker(make_config(path, megatron={"moe_router_topk": 4}), rank, world)
    out["top4/logits"] = _logits(w, batch)

    keys = {"freeze_moe_router": True, "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.1,
            "moe_router_dtype": "fp64", "moe_per_layer_logging": True, "moe_token_dispatcher_type": "allgather"}
    w = MegatronPolicyWorker(make_config(path, megatron=keys), rank, world)
    out["keys/tconfig"] = {k: getattr(w.tconfig, k) for k in (
        "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_router_dtype")}
    out["keys/logprobs"] = gather_shards(w.get_logprobs(batch), batch)
    out["keys/metrics"] = w.train(batch, _loss())
    out["keys/after"] = _export(w)
    return out


def megatron_world2(rank: int, world: int, paths: dict[str, str], ckpt: str) -> dict[str, Any]:
    """Expert parallel 2 (Qwen3-MoE): logprobs, training, export gathered over EP ranks, and a
    checkpoint saved at EP=2 resumed at EP=1 (same world: data parallel 2); tensor parallel 2 with
    sequence parallelism and expert parallel 2 against data parallel 2."""
    from nrl_backend_megatron.worker import MegatronPolicyWorker

    out: dict[str, Any] = {}
    batch, loss = make_batch(), _loss()
    w = MegatronPolicyWorker(make_config(paths["qwen3_moe"], megatron={"expert_model_parallel_size": 2}), rank, world)
    out["local_experts"] = sorted({n.split("local_experts.")[1].split(".")[0]
                                   for n, _ in w.model.named_parameters() if "local_experts" in n})
    out["logprobs"] = gather_shards(w.get_logprobs(batch), batch)
    out["export"], out["export_gathers"] = _counting_gathers(lambda: _export(w))
    out["buckets"] = [[n for n, _ in bucket] for bucket in w.export_weights(64 * 1024, "float32")]
    out["manifest"] = [(s.name, s.shape) for s in w.weight_manifest("float32")]
    out["metrics"] = [w.train(batch, loss) for _ in range(3)]
    w.save_checkpoint(ckpt)
    out["saved/logprobs"] = gather_shards(w.get_logprobs(batch), batch)
    out["saved/next_loss"] = w.train(batch, loss)["loss"]

    w = MegatronPolicyWorker(make_config(paths["qwen3_moe"], megatron={"expert_model_parallel_size": 1}), rank, world)
    w.load_checkpoint(ckpt)
    out["ep1/logprobs"] = gather_shards(w.get_logprobs(batch), batch)
    out["ep1/next_loss"] = w.train(batch, loss)["loss"]

    # tensor parallel 2 needs a model with two key/value heads, and a reference of its own
    for tag, megatron in (("kv2", {}), ("tp2sp_ep2", {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                                     "expert_model_parallel_size": 2})):
        w = MegatronPolicyWorker(make_config(paths["qwen3_moe_kv2"], megatron=megatron), rank, world)
        out[f"{tag}/logprobs"] = gather_shards(w.get_logprobs(batch), batch)
        out[f"{tag}/metrics"] = [w.train(batch, loss) for _ in range(3)]
    return out


def dtensor_config(path: str) -> dict[str, Any]:
    """The DTensor backend on the batch and optimizer settings of the Megatron scenarios."""
    from nrl_backend_dtensor.schema import DTENSOR_CONFIG_SCHEMA

    cfg = make_config(path)
    policy = cfg["policy"]
    del policy["megatron_cfg"]
    policy.update(optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2, "weight_decay": 0.0}},
                  scheduler=None, logprob_chunk_size=None,
                  dtensor_config=DTENSOR_CONFIG_SCHEMA.validate({"enabled": True}, "policy.dtensor_config"))
    return cfg


def dtensor_world2(rank: int, world: int, path: str) -> dict[str, Any]:
    """FSDP2 over two ranks: logprobs, export in the checkpoint's layout, two training steps."""
    from nrl_backend_dtensor.worker import DTensorPolicyWorker

    out: dict[str, Any] = {}
    batch = make_batch()
    w = DTensorPolicyWorker(dtensor_config(path), rank, world)
    out["logprobs"] = gather_shards(w.get_logprobs(batch), batch)
    out["export"] = _export(w)
    out["manifest"] = [(s.name, s.shape) for s in w.weight_manifest("float32")]
    out["metrics"] = [w.train(batch, _loss()) for _ in range(2)]
    return out


def latent_paths() -> dict[str, str]:
    """The tiny multi-head latent attention models (DeepSeek-V3, and GLM-4.7-Flash with low-rank queries)."""
    from nrl_core.testing.tiny_models import cached_tiny_model

    return {"deepseek_v3": str(cached_tiny_model("deepseek_v3")), "glm4_moe_lite": str(cached_tiny_model("glm4_moe_lite"))}


def latent_world1(rank: int, world: int, paths: dict[str, str]) -> dict[str, Any]:
    """HF parity and export of both latent families, and DeepSeek-V3's single-rank training baseline."""
    return _one_rank_baselines(rank, world, paths, trained=True)


def _one_rank_baselines(rank: int, world: int, paths: dict[str, str], trained: bool = False) -> dict[str, Any]:
    """Per model: logits and logprobs, the export before training, three steps' metrics (and the
    export after them)."""
    from nrl_backend_megatron.worker import MegatronPolicyWorker

    out: dict[str, Any] = {}
    batch = make_batch()
    for name, path in paths.items():
        w = MegatronPolicyWorker(make_config(path), rank, world)
        out[f"{name}/logits"] = _logits(w, batch)
        out[f"{name}/logprobs"] = gather_shards(w.get_logprobs(batch), batch)
        out[f"{name}/export"] = _export(w)
        out[f"{name}/metrics"] = [w.train(batch, _loss()) for _ in range(3)]
        if trained:
            out[f"{name}/trained"] = _export(w)
    return out


def latent_world2(rank: int, world: int, paths: dict[str, str]) -> dict[str, Any]:
    """DeepSeek-V3 at tensor parallel 2 with sequence parallelism (heads split, down-projections
    whole), expert parallel 2 and pipeline parallel 2 (the dense layer on one stage, the routed one
    on the other); GLM-4.7-Flash, whose queries have a down-projection and a norm too, at TP 2."""
    from nrl_backend_megatron.worker import MegatronPolicyWorker

    out: dict[str, Any] = {}
    batch, loss = make_batch(), _loss()
    tp2 = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    for tag, family, megatron in (("tp2", "deepseek_v3", tp2), ("ep2", "deepseek_v3", {"expert_model_parallel_size": 2}),
                                  ("pp2", "deepseek_v3", {"pipeline_model_parallel_size": 2}),
                                  ("glm_tp2", "glm4_moe_lite", tp2)):
        w = MegatronPolicyWorker(make_config(paths[family], megatron=megatron), rank, world)
        out[f"{tag}/logprobs"] = gather_shards(w.get_logprobs(batch), batch)
        out[f"{tag}/metrics"] = [w.train(batch, loss) for _ in range(3)]
        out[f"{tag}/trained"] = _export(w)
    return out


def hybrid_paths() -> dict[str, str]:
    """The small Nemotron-H models (Mamba, attention and MLP layers; Nemotron 3's experts in place of
    the MLP, and Nemotron 3 Super's experts in a latent space): the small size has every layer
    kind, and two Mamba groups so tensor parallelism splits them."""
    from nrl_core.testing.tiny_models import cached_tiny_model

    return {"nemotron_h": str(cached_tiny_model("nemotron_h", size="small")),
            "nemotron_h_moe": str(cached_tiny_model("nemotron_h_moe", size="small")),
            "nemotron_h_moe_latent": str(cached_tiny_model("nemotron_h_moe", size="small", moe_latent_size=64))}


def hybrid_world1(rank: int, world: int, paths: dict[str, str]) -> dict[str, Any]:
    """HF parity, export before training and a three-step baseline of each Nemotron-H model, and
    Nemotron-H's logprobs with sequence packing (each sequence's Mamba state starts afresh)."""
    from nrl_backend_megatron.worker import MegatronPolicyWorker

    out = _one_rank_baselines(rank, world, paths)
    batch = make_batch()
    packing = {"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 64}
    w = MegatronPolicyWorker(make_config(paths["nemotron_h"], sequence_packing=packing), rank, world)
    out["nemotron_h/packed_logprobs"] = gather_shards(w.get_logprobs(batch), batch)
    # full recompute: each layer runs again in backward (a Mamba mixer's forwards counted)
    w = MegatronPolicyWorker(make_config(paths["nemotron_h"], megatron={"activation_checkpointing": True}), rank, world)
    calls = [0]
    w.model.decoder.layers[0].mixer.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    out["nemotron_h/recomputed_metrics"] = [w.train(batch, _loss()) for _ in range(3)]
    out["nemotron_h/mixer_forwards"] = calls[0]
    return out


def hybrid_world2(rank: int, world: int, paths: dict[str, str]) -> dict[str, Any]:
    """Nemotron 3 Super's layout at tensor parallel 2 with sequence parallelism (Mamba's fused
    projection and convolution split part by part, the latent projections whole on each rank),
    Nemotron 3 at expert parallel 2, Nemotron-H at pipeline parallel 2."""
    from nrl_backend_megatron.worker import MegatronPolicyWorker

    out: dict[str, Any] = {}
    batch, loss = make_batch(), _loss()
    for tag, family, megatron in (("tp2", "nemotron_h_moe_latent", {"tensor_model_parallel_size": 2,
                                                                    "sequence_parallel": True}),
                                  ("ep2", "nemotron_h_moe", {"expert_model_parallel_size": 2}),
                                  ("pp2", "nemotron_h", {"pipeline_model_parallel_size": 2})):
        w = MegatronPolicyWorker(make_config(paths[family], megatron=megatron), rank, world)
        out[f"{tag}/logprobs"] = gather_shards(w.get_logprobs(batch), batch)
        out[f"{tag}/export"] = _export(w)  # gathered part by part at TP 2
        out[f"{tag}/metrics"] = [w.train(batch, loss) for _ in range(3)]
    return out


def gpt_oss_batch() -> Any:
    """Rows longer than the tiny gpt-oss's sliding window of 16, so its windowed layers leave keys out."""
    return make_batch(rows=4, width=28)


def gpt_oss_world1(rank: int, world: int, path: str) -> dict[str, Any]:
    """gpt-oss on one rank: logits (also with a clamp its activations reach), logprobs of padded and
    of packed rows, the export, three training steps and the export after them."""
    from nrl_backend_megatron.worker import MegatronPolicyWorker

    out: dict[str, Any] = {}
    batch = gpt_oss_batch()
    clamped = MegatronPolicyWorker(make_config(path, hf_config_overrides={"swiglu_limit": 0.05}), rank, world)
    out["clamped/logits"] = _logits(clamped, batch)
    packing = {"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 64}
    packed = MegatronPolicyWorker(make_config(path, sequence_packing=packing), rank, world)
    out["packed/logprobs"] = gather_shards(packed.get_logprobs(batch), batch)
    w = MegatronPolicyWorker(make_config(path), rank, world)
    out["logits"] = _logits(w, batch)
    out["logprobs"] = gather_shards(w.get_logprobs(batch), batch)
    out["export"] = _export(w)
    out["metrics"] = [w.train(batch, _loss()) for _ in range(3)]
    out["trained"] = _export(w)
    return out


def gpt_oss_world2(rank: int, world: int, path: str) -> dict[str, Any]:
    """gpt-oss at tensor parallel 2 with sequence parallelism (heads and their sinks split) and at
    expert parallel 2."""
    from nrl_backend_megatron.worker import MegatronPolicyWorker

    out: dict[str, Any] = {}
    batch, loss = gpt_oss_batch(), _loss()
    for tag, megatron in (("tp2", {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
                          ("ep2", {"expert_model_parallel_size": 2})):
        w = MegatronPolicyWorker(make_config(path, megatron=megatron), rank, world)
        out[f"{tag}/logprobs"] = gather_shards(w.get_logprobs(batch), batch)
        out[f"{tag}/metrics"] = [w.train(batch, loss) for _ in range(3)]
        out[f"{tag}/trained"] = _export(w)
    return out
