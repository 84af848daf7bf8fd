"""Several vLLM engines in one world, as worker groups build them: an engine per training rank
(colocated, data-parallel 2), one engine over two ranks (vLLM tensor parallel 2 through its
external launcher, colocated and in its own generation group). Each generates its share of the
prompts, the outputs come back once per engine and in order, greedy equals HF ``generate``, and
refit (in process on every rank, or from another actor into both tensor-parallel ranks) loads
weights every rank agrees on."""

from __future__ import annotations

import functools
import glob
import os

import pytest

from nrl_core.algorithms.refit_orchestrator import choose_transport, refit
from nrl_core.cluster import WorkerGroup
from nrl_core.cluster._host import WorkerHost
from nrl_core.refit.plan import RefitPlan
from nrl_core.refit.shm_space import FREE_BYTES_VARIABLE, shm_dir
from nrl_core.testing.refit_host import perturb_hosted_source, perturb_weights
from tests.launch import driving_the_shared_ray
from tests.vllm.helpers import generation_config, hf_greedy, hf_model

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

WORKER = "nrl_gen_vllm.worker:VllmGenerationWorker"
SOURCE = "nrl_core.testing.refit_host:RankedHFSource"
BUCKET = 256 * 1024


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    """The module's worker groups on the suite's shared Ray (their actors from the zygote)."""
    with driving_the_shared_ray():
        yield


def _perturb(worker, seed):
    """``WorkerHost.execute`` target: perturb the hosted HF weight source."""
    perturb_weights(worker.model, seed)


def _colocated(model_dir, tp: int, async_engine: bool = False) -> WorkerGroup:
    group = WorkerGroup(SOURCE, 2, name=f"colocated-tp{tp}", init_kwargs={"model": str(model_dir)},
                        distributed_backend="gloo")
    group.call(WorkerHost.nrl_colocate_generation, WORKER,
               generation_config(model_dir, tensor_parallel_size=tp, async_engine=async_engine))
    return group


def _generate(group: WorkerGroup, prompts, engine_size: int):
    engines = group.world_size // engine_size
    size = -(-len(prompts) // engines)
    chunks = [prompts[i * size:(i + 1) * size] for i in range(engines)]
    outs = group.call(WorkerHost.nrl_generate_sharded, chunks, engine_size, greedy=True)
    assert len(outs) == engines  # one answer per engine, from its first rank
    return [t for o in outs for t in o.token_ids]


def _set_env(worker, name: str, value: str | None) -> None:
    """``WorkerHost.execute`` target: set (or, with None, remove) an environment variable."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _small_parts(worker) -> None:
    """The async engine's refits in parts of 256 KiB, counted (this process holds the engine)."""
    from nrl_gen_vllm import engines

    whole, seen = engines._parts, []

    def counted(named, part_bytes):
        for part in whole(named, part_bytes):
            seen.append(len(part))
            yield part

    engines.PART_BYTES, engines._parts, engines.PARTS_SEEN = (256 * 1024, 256 * 1024), counted, seen


def _parts_loaded(worker) -> int:
    from nrl_gen_vllm import engines

    return len(engines.PARTS_SEEN)


def _refit_in_place(group: WorkerGroup, seed: int | None, versions: tuple[int, int] = (1, 1)) -> None:
    if seed is not None:
        group.call(WorkerHost.execute, functools.partial(_perturb, seed=seed))
    reports = group.call(WorkerHost.nrl_refit_local, choose_transport("same_process", "in_process"), BUCKET, "float32")
    assert tuple(r.version for r in reports) == versions


@pytest.mark.parametrize("tp, async_engine", [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2-async"])
def test_colocated_engines_in_a_two_rank_world(model_dir, prompts, tp, async_engine):
    """tp=1: two engines, one per training rank (the DP=2 colocated shape that used to hang);
    tp=2: one engine spanning both training ranks; tp2-async: vLLM's async engine over both
    training ranks, its two workers started by the first rank with vLLM's own executor (NeMo RL's
    colocated ``async_engine: true`` recipes), refit in process on each rank reaching both."""
    group = _colocated(model_dir, tp, async_engine)
    try:
        before = hf_greedy(hf_model(model_dir), prompts)
        assert _generate(group, prompts, tp) == before
        if async_engine:  # its refit goes through one /dev/shm file: too small is one line, nothing lands
            files = set(glob.glob(os.path.join(shm_dir(), "nrl-async-refit-*")))
            group.call(WorkerHost.execute, functools.partial(_perturb, seed=21))
            group.call(WorkerHost.execute, functools.partial(_set_env, name=FREE_BYTES_VARIABLE, value=str(4096)))
            with pytest.raises(Exception, match=r"the async engine's refit: \S+ has 0.0 MiB free but needs "):
                group.call(WorkerHost.nrl_refit_local, choose_transport("same_process", "in_process"), BUCKET,
                           "float32")
            group.call(WorkerHost.execute, functools.partial(_set_env, name=FREE_BYTES_VARIABLE, value=None))
            assert set(glob.glob(os.path.join(shm_dir(), "nrl-async-refit-*"))) == files
            assert _generate(group, prompts, tp) == before  # the engine still has the weights it had
            # the engine's first rank loads for both workers; its follower counted the refused refit too
            _refit_in_place(group, seed=None, versions=(1, 2))
            assert _generate(group, prompts, tp) == hf_greedy(hf_model(model_dir, perturb_seed=21), prompts)
            # a pipelined refit in parts of 256 KiB: the engine loads each before the next is written
            group.call(WorkerHost.execute, _small_parts, on=0)
            group.call(WorkerHost.execute, functools.partial(perturb_hosted_source, seed=26, fresh_from=str(model_dir)))
            reports = group.call(WorkerHost.nrl_refit_local, choose_transport("same_process", "in_process"), BUCKET,
                                 "float32", False, True)
            assert [r.version for r in reports] == [2, 3]
            assert group.call(WorkerHost.execute, _parts_loaded, on=0) > 8
            assert _generate(group, prompts, tp) == hf_greedy(hf_model(model_dir, perturb_seed=26), prompts)
        else:
            _refit_in_place(group, seed=21)
            assert _generate(group, prompts, tp) == hf_greedy(hf_model(model_dir, perturb_seed=21), prompts)
    finally:
        group.call(WorkerHost.nrl_generation_call, "shutdown")
        group.shutdown()


def test_tensor_parallel_engine_in_its_own_group_refits_from_another_actor(model_dir, prompts):
    engine = WorkerGroup(WORKER, 2, name="generation-tp2", distributed_backend="gloo",
                         init_kwargs={"config": generation_config(model_dir, tensor_parallel_size=2)})
    source = WorkerGroup(SOURCE, 1, name="source", init_kwargs={"model": str(model_dir)}, distributed_backend="none")
    try:
        assert _generate(engine, prompts, 2) == hf_greedy(hf_model(model_dir), prompts)
        source.call(WorkerHost.execute, functools.partial(_perturb, seed=22))
        report = refit(source.endpoint(0), [engine.endpoint(0), engine.endpoint(1)], RefitPlan(bucket_bytes=BUCKET))
        assert report.transport == "shared_memory" and report.version == 1
        assert _generate(engine, prompts, 2) == hf_greedy(hf_model(model_dir, perturb_seed=22), prompts)
        _each_rank_receives_its_blocks(engine, source, model_dir, prompts)
    finally:
        source.call(WorkerHost.nrl_refit_release)
        source.shutdown()
        engine.shutdown()


def _received(worker) -> int:
    from nrl_core.refit.transports import broadcast_bytes_received

    return broadcast_bytes_received()


def _shrink_block(worker, name: str) -> None:
    """Make rank 0 name half of the block its loaders read of ``name``: a rank that names too little."""
    (a, b), *rest = worker._blocks[name]
    worker._blocks[name] = [[a, (a + b) // 2], *rest]


def _each_rank_receives_its_blocks(engine, source, model_dir, prompts) -> None:
    """Its first refit taught each rank the block of each tensor its loaders read (sliced_import):
    over the broadcast transport (across nodes) each now receives its blocks only, at most 0.55 of
    the model (norms and the single key/value head are whole on both). A rank that names less than
    its loaders read fails the refit in one line, refuses to generate, and its next refit comes
    whole and teaches it again."""
    from nrl_core.refit.manifest import RefitError

    total = sum(spec.nbytes for spec in source.call(WorkerHost.nrl_refit_manifest, "float32"))
    wanted = RefitPlan(transport="broadcast", bucket_bytes=BUCKET, delivery="wanted")
    source.call(WorkerHost.execute, functools.partial(perturb_hosted_source, seed=23, fresh_from=str(model_dir)))
    assert refit(source.endpoint(0), [engine.endpoint(0), engine.endpoint(1)], wanted).version == 2
    received = engine.call(WorkerHost.execute, _received)
    assert 0.45 * total < received[0] <= 0.55 * total and 0.45 * total < received[1] <= 0.55 * total, (received, total)
    assert _generate(engine, prompts, 2) == hf_greedy(hf_model(model_dir, perturb_seed=23), prompts)
    # through shared memory (one node) each rank is handed views of its blocks alone
    one_node = RefitPlan(bucket_bytes=BUCKET, delivery="wanted")
    assert refit(source.endpoint(0), [engine.endpoint(0), engine.endpoint(1)], one_node).transport == "shared_memory"

    engine.call(WorkerHost.execute, functools.partial(_shrink_block, name="model.layers.0.mlp.down_proj.weight"), on=0)
    source.call(WorkerHost.execute, functools.partial(perturb_hosted_source, seed=24, fresh_from=str(model_dir)))
    with pytest.raises(RefitError, match=r"read model\.layers\.0\.mlp\.down_proj\.weight outside the block it named"):
        refit(source.endpoint(0), [engine.endpoint(0), engine.endpoint(1)], wanted)
    with pytest.raises(Exception, match="generate with torn weights: the refit to version 4 failed while loading"):
        engine.call(WorkerHost.nrl_generation_call, "generate", [prompts[0]], on=0)  # rank 1 loaded: it would wait
    refit(source.endpoint(0), [engine.endpoint(0), engine.endpoint(1)], wanted)
    assert engine.call(WorkerHost.execute, _received)[0] > 0.95 * total  # rank 0 learns again from a whole refit
    assert _generate(engine, prompts, 2) == hf_greedy(hf_model(model_dir, perturb_seed=24), prompts)
