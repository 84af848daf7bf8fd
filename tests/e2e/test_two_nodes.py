"""Two Ray nodes on this machine (``ray.cluster_utils.Cluster``: two raylets, each with its own
CPUs and node id), joined through ``cluster.ray_address`` as a real multi-node job would be.

Joining a cluster (not nrl's private local Ray) makes worker groups rendezvous over rank 0's
``TCPStore`` at its node address, the cross-node path, instead of the local file store; both
nodes share one address here, so the node *ids* tell where a worker runs. Megatron's conversions
land in the suite's shared directory (tests/conftest.py): each tiny model converts once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from nrl_core.algorithms.loss import NLLLoss
from nrl_core.cluster import init_ray, make_placement, shutdown_ray
from nrl_core.cluster._host import WorkerHost
from nrl_core.errors import NrlError
from tests.core.test_refit_slices import _counts as copied_and_received
from tests.e2e.facades import CONFIG, chat_prompts, policy_and_generation, training_batch
from tests.vllm.helpers import hf_greedy, hf_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster_address() -> Iterator[str]:
    from ray.cluster_utils import Cluster

    from nrl_core.cluster.ray_cluster import _use_token_auth_if_available

    shutdown_ray()
    saved = os.environ.get("RAY_AUTH_MODE")
    # As `ray start` would: when a cluster token exists (~/.ray/auth_token), the nodes require it,
    # and init_ray presents it; a cluster started without it would refuse the driver's workers.
    _use_token_auth_if_available()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        init_ray({"ray_address": cluster.address, "log_to_driver": False})
        yield cluster.address
    finally:
        shutdown_ray()
        cluster.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


def _nodes(group) -> list[str]:
    return [info.node_id for info in group.infos]


def test_more_nodes_than_the_cluster_has_is_one_line(cluster_address: str) -> None:
    with pytest.raises(NrlError) as info:
        make_placement({"num_nodes": 3, "gpus_per_node": 1}, 3, name="policy", nodes=3)
    message = str(info.value)
    assert "\n" not in message and "'policy' needs 3 node(s)" in message and "the Ray cluster has 2 nodes" in message


def _received(worker) -> int:
    from nrl_core.refit.transports import broadcast_bytes_received

    return broadcast_bytes_received()


def test_generation_on_the_other_node_refits_by_broadcast(cluster_address: str, model: Path, tmp_path: Path) -> None:
    """DTensor at data parallel 2 on the head node, a vLLM engine at tensor parallel 2 on the other.
    Its ranks learn their blocks from the first refit (whole); from the second each receives only
    its blocks, at most 0.55 of the model."""
    overrides = [f"cluster.ray_address={cluster_address}", "cluster.num_nodes=2", "cluster.gpus_per_node=2",
                 "policy.optimizer.kwargs.lr=5e-3", "policy.generation.colocated.enabled=false",
                 "policy.generation.colocated.resources.num_nodes=1",
                 "policy.generation.colocated.resources.gpus_per_node=2",
                 "policy.generation.vllm_cfg.tensor_parallel_size=2"]
    with policy_and_generation(model, overrides) as (_, policy, generation):
        train_nodes, generation_nodes = set(_nodes(policy.group)), set(_nodes(generation.hosts))
        head = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"])
        assert train_nodes == {head} and len(generation_nodes) == 1 and head not in generation_nodes
        assert policy.group.world_size == generation.hosts.world_size == 2
        assert policy.group.rendezvous_dir is None  # the TCP store, as across real nodes
        prompts = chat_prompts(model)
        before = generation.generate(prompts, greedy=True)
        total = sum(spec.nbytes for spec in policy.group.call(WorkerHost.nrl_refit_manifest, "float32"))
        for step in range(3):
            policy.train(training_batch(step), NLLLoss())
            report = generation.update_weights()
            assert (report.transport, report.placement) == ("broadcast", "cross_node")
            received = generation.hosts.call(WorkerHost.execute, _received)
            if step == 0:  # the ranks learn their blocks
                assert received == [total, total]
            else:
                assert all(0.45 * total < r <= 0.55 * total for r in received), (received, total)
        after = generation.generate(prompts, greedy=True)
        policy.export_hf(str(tmp_path / "trained"))
        assert after.token_ids == hf_greedy(hf_model(tmp_path / "trained"), prompts, max_new_tokens=8)
        assert after.token_ids != before.token_ids, "training should have changed the greedy answers"


def test_megatron_training_spans_both_nodes(cluster_address: str, model: Path) -> None:
    """Tensor parallel 2 with one rank per node; ``distributed_timeout_minutes`` is the main
    group's timeout on both."""
    from nrl_core.algorithms.installed import choose_backends, load_and_validate
    from nrl_core.algorithms.policy import Policy
    from nrl_core.process_groups import main_group_timeout

    config = load_and_validate(str(CONFIG), [
        f"policy.model_name={model}", f"cluster.ray_address={cluster_address}", "cluster.num_nodes=2",
        "policy.train_global_batch_size=8", "policy.train_micro_batch_size=4", "policy.logprob_batch_size=8",
        "policy.dtensor_config.enabled=false", "policy.megatron_cfg.enabled=true", "policy.optimizer=null",
        "+policy.megatron_cfg.tensor_model_parallel_size=2", "+policy.megatron_cfg.distributed_timeout_minutes=7",
        "+policy.megatron_cfg.optimizer.lr=5e-3", "+policy.megatron_cfg.optimizer.min_lr=5e-3"])
    policy = Policy(config, choose_backends(config).training, colocated_generation=False)
    try:
        assert len(set(_nodes(policy.group))) == 2
        assert policy.group.call(WorkerHost.execute, lambda worker: main_group_timeout().total_seconds()) == [420.0, 420.0]
        batch = training_batch(0)
        mask = batch.fields["token_mask"][:, 1:]
        first = float((policy.get_logprobs(batch)[:, 1:] * mask).sum())
        for _ in range(3):
            policy.train(batch, NLLLoss())
        assert float((policy.get_logprobs(batch)[:, 1:] * mask).sum()) > first + 1.0
    finally:
        policy.shutdown()


_MEGATRON = ["policy.dtensor_config.enabled=false", "policy.megatron_cfg.enabled=true", "policy.optimizer=null"]
SLICED_SOURCES = {
    "dtensor-dp2-dense": ("llama", []),
    "dtensor-dp2-moe": ("qwen3_moe", []),
    "megatron-tp2-dense": ("llama", [*_MEGATRON, "+policy.megatron_cfg.tensor_model_parallel_size=2"]),
    # experts under Megatron's tensor parallelism need sequence parallelism, and two key/value heads
    "megatron-tp2-moe": ("qwen3_moe", [*_MEGATRON, "+policy.megatron_cfg.tensor_model_parallel_size=2",
                                       "+policy.megatron_cfg.sequence_parallel=true"]),
    "megatron-pp2-dense": ("llama", [*_MEGATRON, "+policy.megatron_cfg.pipeline_model_parallel_size=2"]),
    "megatron-pp2-moe": ("qwen3_moe", [*_MEGATRON, "+policy.megatron_cfg.pipeline_model_parallel_size=2"]),
}

TENSOR_PARALLEL_MODEL = {"megatron-tp2-moe": {"num_key_value_heads": 2}}  # the tiny MoE model has one


def _blocks(exported: dict, wants: list) -> dict[str, float]:
    """Checksums of what ``wants`` names of the exported tensors (a name whole, a block its part)."""
    from nrl_core.refit.slices import cut

    parts = {want: exported[want] if isinstance(want, str) else cut(exported[want.name], want.region) for want in wants}
    return {getattr(want, "name", want): float(part.double().sum()) for want, part in parts.items()}


@pytest.mark.parametrize("source", list(SLICED_SOURCES))
def test_each_engine_rank_gets_its_blocks_from_every_training_layout(source: str, cluster_address: str,
                                                                     tmp_path: Path) -> None:
    """Sinks that name blocks as a tensor-parallel 2 engine does (and, for a mixture of experts,
    their half of the experts as vLLM's expert parallelism does), fed by each training layout:
    on the training node over shared memory and broadcast, and on the other node over broadcast,
    each rank receives and copies out exactly what it named, at most 0.55 of the model, and it
    equals the policy's export."""
    from safetensors.torch import load_file

    from nrl_core.algorithms.installed import choose_backends, load_and_validate
    from nrl_core.algorithms.policy import Policy
    from nrl_core.algorithms.refit_orchestrator import refit
    from nrl_core.cluster import WorkerGroup
    from nrl_core.refit.plan import RefitPlan
    from nrl_core.refit.slices import region_nbytes
    from nrl_core.testing.tiny_models import cached_tiny_model

    family, overrides = SLICED_SOURCES[source]
    config = load_and_validate(str(CONFIG), [
        f"policy.model_name={cached_tiny_model(family, **TENSOR_PARALLEL_MODEL.get(source, {}))}",
        f"cluster.ray_address={cluster_address}",
        "cluster.num_nodes=2", "cluster.gpus_per_node=2", "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=4", "policy.logprob_batch_size=8",
        # the other node is the engines' (held here by the far sinks), so training takes the head
        "policy.generation.colocated.enabled=false", "policy.generation.colocated.resources.num_nodes=1",
        "policy.generation.colocated.resources.gpus_per_node=2", *overrides])
    # colocated_generation: the training bundles keep room for the near sinks, which share them
    policy = Policy(config, choose_backends(config).training, colocated_generation=True)
    kwargs = {"expert_parallel": family == "qwen3_moe"}
    near = WorkerGroup("nrl_core.testing.refit_host:SlicedRecordingSink", 2, name="near", distributed_backend="none",
                       init_kwargs=kwargs, placement=make_placement(None, 2, colocate_with=policy.placement))
    other_node = make_placement(config["cluster"], 2, name="far", nodes=1)
    far = WorkerGroup("nrl_core.testing.refit_host:SlicedRecordingSink", 2, name="far", distributed_backend="none",
                      init_kwargs=kwargs, placement=other_node)
    try:
        assert policy.world_size == 2 and len(set(_nodes(policy.group))) == 1
        assert set(_nodes(near)) == set(_nodes(policy.group)) != set(_nodes(far))
        policy.export_hf(str(tmp_path / "export"))
        exported = {}
        for file in (tmp_path / "export").glob("*.safetensors"):
            exported.update(load_file(str(file)))
        manifest = policy.group.call(WorkerHost.nrl_refit_manifest, "float32", on=0)
        total = sum(spec.nbytes for spec in manifest)
        for sinks, transport, expected in [(near, None, ("shared_memory", "same_node")),
                                           (near, "broadcast", ("broadcast", "same_node")),
                                           (far, None, ("broadcast", "cross_node"))]:
            drain = policy.drain_export(1 << 20, "float32")
            report = refit(policy.rank0, [sinks.endpoint(0), sinks.endpoint(1)],
                           RefitPlan(transport=transport, bucket_bytes=1 << 20, delivery="wanted"))
            drain()
            assert (report.transport, report.placement) == expected
            wants = sinks.call("refit_wants", manifest)
            named = [sum(spec.nbytes if isinstance(want, str) else region_nbytes(want.region, 4)
                         for want, spec in _named_specs(w, manifest)) for w in wants]
            counts = sinks.call(WorkerHost.execute, copied_and_received)
            assert [copied for copied, _ in counts] == named and max(named) <= 0.55 * total, (named, total)
            if expected[0] == "broadcast":
                assert [received for _, received in counts] == named
            assert sinks.call("checksums") == [_blocks(exported, w) for w in wants]
    finally:
        for group in (near, far):
            group.shutdown()
        other_node.remove()
        policy.shutdown()


def _named_specs(wants: list, manifest: list) -> list:
    by_name = {spec.name: spec for spec in manifest}
    return [(want, by_name[want if isinstance(want, str) else want.name]) for want in wants]
