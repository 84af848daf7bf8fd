"""vLLM expert parallelism, and what each engine rank reads of a MoE refit.

A vLLM engine of two tensor-parallel ranks serves the tiny Qwen3-MoE with and without
``expert_parallel_size: 2``. Under expert parallelism each rank holds 4 of the 8 experts of every
layer (vLLM's CPU kernel needs nrl's id translation for that, ``nrl_gen_vllm/cpu_moe.py``); under
tensor parallelism alone each rank holds half of every expert. A pipelined refit from a training
actor into the engine (shared memory, one node) then gives greedy output equal to HF ``generate``
with the new weights, and the engine's read counter (``nrl_count_refit_reads``) shows, tensor by
tensor, that each rank copied out only what it holds: under expert parallelism the whole of its
own experts and nothing of the other rank's, under tensor parallelism half of every expert and of
every attention, embedding and output matrix; norms, routers and (the model has one key/value
head, which vLLM copies to every rank) the key and value projections whole on both. Under expert
parallelism each rank names the other rank's experts as not wanted (``refit_wants``, contract 14):
they never reach its loaders. Each rank also learns from that first refit the block of each
tensor its loaders read (``sliced_import``), and a refit over the broadcast transport (across
nodes) then sends each rank exactly those blocks, counted by the transport.
"""

from __future__ import annotations

import functools
import re

import pytest
from transformers import AutoConfig

from nrl_core.algorithms.refit_orchestrator import refit
from nrl_core.cluster._host import WorkerHost
from nrl_core.refit.plan import RefitPlan
from nrl_core.testing.refit_host import perturb_hosted_source
from nrl_core.testing.tiny_models import cached_tiny_model
from tests.launch import driving_the_shared_ray
from tests.vllm.helpers import generation_config, hf_greedy, hf_model

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

WORKER = "nrl_gen_vllm.worker:VllmGenerationWorker"
SOURCE = "nrl_core.testing.refit_host:RankedHFSource"
PROMPTS = [[1, 5, 7, 9, 11], [1, 40, 41, 42], [1, 100, 200, 300]]
EXPERTS, RANKS = 8, 2
EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


@pytest.fixture(scope="module")
def model():
    return cached_tiny_model("qwen3_moe")


@pytest.fixture(scope="module")
def source(model):
    from nrl_core.cluster import WorkerGroup

    with driving_the_shared_ray():  # the module's worker groups on the suite's shared Ray
        group = WorkerGroup(SOURCE, 1, name="moe-source", init_kwargs={"model": str(model)},
                            distributed_backend="none")
        yield group
        group.call(WorkerHost.nrl_refit_release)
        group.shutdown()


def _greedy(engine) -> list[list[int]]:
    """Both ranks of the engine take part in each step; the first answers."""
    (out,) = engine.call(WorkerHost.nrl_generate_sharded, [PROMPTS], RANKS, greedy=True)
    return out.token_ids


def _count_reads(worker) -> None:
    worker._engine.collective_rpc("nrl_count_refit_reads", args=(True,))


def _reads(worker) -> list[dict[str, int]]:
    """One dict per vLLM worker this rank reaches: its own (sync engine), or the engine's every
    worker (async engine, from its first rank)."""
    return worker._engine.collective_rpc("nrl_refit_reads")


def _sizes(worker) -> dict[str, int]:
    return {spec.name: spec.nbytes for spec in worker.weight_manifest("float32")}


def _received(worker) -> int:
    from nrl_core.refit.transports import broadcast_bytes_received

    return broadcast_bytes_received()


def loads(name: str, rank: int, expert_parallel: bool, async_engine: bool) -> bool:
    """Whether rank ``rank`` names ``name`` in ``refit_wants``: under expert parallelism all but the
    other rank's experts; the async engine's first rank loads for both workers, the second nothing."""
    if async_engine:
        return rank == 0
    expert = EXPERT.search(name)
    return not (expert and expert_parallel) or int(expert.group(1)) // (EXPERTS // RANKS) == rank


def expected_read(name: str, nbytes: int, rank: int, expert_parallel: bool) -> int:
    """What rank ``rank`` of a two-rank engine holds of a tensor of ``nbytes``."""
    expert = EXPERT.search(name)
    if expert and expert_parallel:
        return nbytes if int(expert.group(1)) // (EXPERTS // RANKS) == rank else 0
    if name.endswith(("norm.weight", ".mlp.gate.weight", "k_proj.weight", "v_proj.weight")):
        return nbytes  # norms, routers, the one key/value head: every rank whole
    return nbytes // RANKS  # experts, attention, embedding, output: the rank's slice


@pytest.mark.parametrize("expert_parallel, async_engine", [(False, False), (True, False), (True, True)],
                         ids=["tp2", "tp2-ep2", "tp2-ep2-async"])
def test_each_engine_rank_reads_only_what_it_holds_of_a_moe_refit(model, source, expert_parallel,
                                                                  async_engine) -> None:
    """The async engine's first rank runs both vLLM workers in processes of their own (the weights
    reach them through one shared-memory file): there the count comes from the first rank."""
    from nrl_core.cluster import WorkerGroup

    config = generation_config(model, tensor_parallel_size=2, expert_parallel_size=2 if expert_parallel else 1,
                               async_engine=async_engine)
    first_rank_only = {"on": 0} if async_engine else {}
    engine = WorkerGroup(WORKER, RANKS, name="moe-engine", distributed_backend="gloo", init_kwargs={"config": config})
    try:
        assert _greedy(engine) == hf_greedy(hf_model(model), PROMPTS)
        engine.call(WorkerHost.execute, _count_reads, **first_rank_only)
        seed = 31 + expert_parallel + async_engine
        source.call(WorkerHost.execute, functools.partial(perturb_hosted_source, seed=seed, fresh_from=str(model)))
        report = refit(source.endpoint(0), [engine.endpoint(0), engine.endpoint(1)], RefitPlan(bucket_bytes=256 * 1024, mode="pipelined", delivery="wanted"))
        assert report.transport == "shared_memory" and report.version == 1
        assert _greedy(engine) == hf_greedy(hf_model(model, perturb_seed=seed), PROMPTS)

        sizes = source.call(WorkerHost.execute, _sizes)[0]
        reads = engine.call(WorkerHost.execute, _reads, on=0) if async_engine else \
            [read for (read,) in engine.call(WorkerHost.execute, _reads)]
        assert len(reads) == RANKS
        assert sum(1 for name in sizes if EXPERT.search(name)) == 2 * EXPERTS * 3  # two layers, three projections
        assert AutoConfig.from_pretrained(model).num_key_value_heads == 1
        for rank, read in enumerate(reads):
            assert {name: read.get(name, 0) for name in sizes} == \
                {name: expected_read(name, nbytes, rank, expert_parallel) for name, nbytes in sizes.items()}
            # what reached the loaders: the rank's part (the async engine's workers share one file of all)
            assert set(read) == {name for name in sizes if async_engine or loads(name, rank, expert_parallel, False)}
        per_rank = [sum(read.values()) for read in reads]
        assert per_rank[0] == per_rank[1] < 0.53 * sum(sizes.values())  # the replicated tensors are small

        # Across nodes (the broadcast transport): each rank receives only what it loads. Its first
        # refit taught it the block of each tensor its loaders read (sliced_import), so it now
        # receives exactly those blocks: what it copied out above, byte for byte. The async engine's
        # first rank loads for both workers, so it receives every tensor whole.
        source.call(WorkerHost.execute, functools.partial(perturb_hosted_source, seed=seed + 10, fresh_from=str(model)))
        report = refit(source.endpoint(0), [engine.endpoint(0), engine.endpoint(1)], RefitPlan(transport="broadcast", bucket_bytes=256 * 1024, delivery="wanted"))
        assert report.transport == "broadcast" and report.version == 2
        assert _greedy(engine) == hf_greedy(hf_model(model, perturb_seed=seed + 10), PROMPTS)
        received = engine.call(WorkerHost.execute, _received)
        if async_engine:
            assert received == [sum(sizes.values()), 0]
        else:
            assert received == per_rank and received[0] < 0.53 * sum(sizes.values())
            # and its loaders read the same blocks out of them
            assert [sum(read.values()) for (read,) in engine.call(WorkerHost.execute, _reads)] == per_rank
    finally:
        engine.call(WorkerHost.nrl_generation_call, "shutdown")
        engine.shutdown()
