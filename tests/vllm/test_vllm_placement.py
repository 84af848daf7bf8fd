"""Refit into vLLM engines in other processes (Ray actors), colocated and not.

Group A's one rank hosts an HF weight source (the training side) *and* a vLLM worker (colocated
placement); group B's hosts only an HF weight source, so B -> A is the non-colocated refit (shared memory on
one node, or the broadcast group when asked). One vLLM engine in a Ray actor for the module.
"""

from __future__ import annotations

import functools

import pytest

from nrl_core.algorithms.refit_orchestrator import refit
from nrl_core.cluster._host import WorkerHost
from nrl_core.refit.hf_source import HFWeightSource
from nrl_core.refit.plan import RefitPlan
from nrl_core.testing.refit_host import fail_export_after, perturb_hosted_source
from tests.launch import driving_the_shared_ray
from tests.vllm.helpers import generation_config, hf_greedy, hf_model

ray = pytest.importorskip("ray")
WORKER = "nrl_gen_vllm.worker:VllmGenerationWorker"
SOURCE = "nrl_core.testing.refit_host:RankedHFSource"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def actors(model_dir):
    from nrl_core.cluster import WorkerGroup, init_ray

    with driving_the_shared_ray():
        init_ray({})  # the workers get the VLLM_*, OMP_NUM_THREADS, ... of this process
        colocated, separate = (WorkerGroup(SOURCE, 1, name=name, init_kwargs={"model": str(model_dir)},
                                           distributed_backend="none") for name in ("colocated", "separate"))
        colocated.call(WorkerHost.nrl_colocate_generation, WORKER, generation_config(model_dir))
        yield colocated, separate
        colocated.call(WorkerHost.nrl_generation_call, "shutdown")
        separate.call(WorkerHost.nrl_refit_release)  # ray.kill skips exit handlers: free the buffers first
        colocated.shutdown()
        separate.shutdown()


def _greedy(group, prompts):
    return group.call(WorkerHost.nrl_generation_call, "generate", prompts, greedy=True, on=0)


def test_two_identically_built_workers_sample_identically(actors, engine, model_dir, prompts) -> None:
    """The actor's fresh engine and this process's session engine, same weights and counter."""
    colocated, _ = actors
    refit(HFWeightSource(model_dir), engine)  # checkpoint weights, whatever earlier tests did
    engine.load_sampling_state({"calls": 0})
    here = engine.generate(prompts * 2)
    there = colocated.call(WorkerHost.nrl_generation_call, "generate", prompts * 2, on=0)
    assert there.token_ids == here.token_ids and there.logprobs == here.logprobs


def test_colocated_refit_in_process(actors, model_dir, prompts) -> None:
    colocated, _ = actors
    colocated.call(WorkerHost.execute, functools.partial(perturb_hosted_source, seed=11))
    report = refit(colocated.endpoint(0), colocated.endpoint(0), RefitPlan(bucket_bytes=256 * 1024))
    assert (report.transport, report.placement) == ("in_process", "same_process")
    out = _greedy(colocated, prompts)
    assert out.token_ids == hf_greedy(hf_model(model_dir, perturb_seed=11), prompts)
    assert out.weight_version == report.version == 1


def test_colocated_pipelined_refit_loads_as_the_training_side_exports_and_a_torn_one(actors, model_dir,
                                                                                     prompts) -> None:
    """Colocated, an engine that declares ``pipelined_import`` loads each bucket as the training
    worker exports it, so no second copy of the model is staged on its device. The proof: a
    source that fails after two buckets leaves the engine torn (tensors reached it before the
    export ended, which a staged refit never allows); it refuses to generate in one line until a
    refit succeeds, then equals HF again."""
    from nrl_core.refit.manifest import TornRefitError

    colocated, _ = actors
    colocated.call(WorkerHost.execute, functools.partial(perturb_hosted_source, seed=16, fresh_from=str(model_dir)))
    report = refit(colocated.endpoint(0), colocated.endpoint(0), RefitPlan(bucket_bytes=256 * 1024, mode="pipelined"))
    assert (report.transport, report.placement) == ("in_process", "same_process")
    expected = hf_greedy(hf_model(model_dir, perturb_seed=16), prompts)
    assert _greedy(colocated, prompts).token_ids == expected
    colocated.call(WorkerHost.execute, fail_export_after(2))
    try:
        with pytest.raises(TornRefitError, match=r"^vLLM engine 0: the pipelined refit to version \d+ failed after "
                                                 r"[1-9]\d* of \d+ tensors reached the engine \(the training side "
                                                 r"failed mid-export\)"):
            refit(colocated.endpoint(0), colocated.endpoint(0), RefitPlan(bucket_bytes=256 * 1024, mode="pipelined"))
    finally:
        colocated.call(WorkerHost.execute, lambda worker: delattr(worker, "export_weights"))
    with pytest.raises(TornRefitError, match=r"^vLLM engine 0: generate with torn weights: "):
        _greedy(colocated, prompts)
    report = refit(colocated.endpoint(0), colocated.endpoint(0), RefitPlan(bucket_bytes=256 * 1024, mode="pipelined"))
    out = _greedy(colocated, prompts)
    assert out.token_ids == expected and out.weight_version == report.version


def test_a_pipelined_broadcast_refit_loads_as_it_arrives_and_a_torn_one(actors, model_dir, prompts) -> None:
    """Over the broadcast group an engine that declares ``pipelined_import`` loads each bucket as it
    arrives: a sender that fails after two buckets leaves it torn (tensors reached it before the
    stream ended), refusing to generate until a refit through the same group succeeds."""
    from nrl_core.cluster import WorkerRaisedError
    from nrl_core.refit.manifest import TornRefitError

    colocated, separate = actors
    separate.call(WorkerHost.execute, functools.partial(perturb_hosted_source, seed=17, fresh_from=str(model_dir)))
    refit(separate.endpoint(0), colocated.endpoint(0), RefitPlan(transport="broadcast", bucket_bytes=256 * 1024, mode="pipelined"))
    expected = hf_greedy(hf_model(model_dir, perturb_seed=17), prompts)
    assert _greedy(colocated, prompts).token_ids == expected
    separate.call(WorkerHost.execute, fail_export_after(2))
    try:
        with pytest.raises((WorkerRaisedError, TornRefitError), match="the training side failed mid-export"):
            refit(separate.endpoint(0), colocated.endpoint(0), RefitPlan(transport="broadcast", bucket_bytes=256 * 1024, mode="pipelined"))
    finally:
        separate.call(WorkerHost.execute, lambda worker: delattr(worker, "export_weights"))
    with pytest.raises(TornRefitError, match=r"^vLLM engine 0: generate with torn weights: the pipelined refit"):
        _greedy(colocated, prompts)
    report = refit(separate.endpoint(0), colocated.endpoint(0), RefitPlan(transport="broadcast", bucket_bytes=256 * 1024, mode="pipelined"))
    out = _greedy(colocated, prompts)
    assert out.token_ids == expected and out.weight_version == report.version


@pytest.mark.parametrize("transport, seed", [(None, 12), ("broadcast", 13)])
def test_non_colocated_refit_across_processes(actors, model_dir, prompts, transport, seed) -> None:
    colocated, separate = actors
    separate.call(WorkerHost.execute, functools.partial(perturb_hosted_source, seed=seed, fresh_from=str(model_dir)))
    before = _greedy(colocated, prompts)
    report = refit(separate.endpoint(0), colocated.endpoint(0), RefitPlan(transport=transport, bucket_bytes=256 * 1024))
    assert report.transport == (transport or "shared_memory") and report.placement == "same_node"
    out = _greedy(colocated, prompts)
    assert out.token_ids == hf_greedy(hf_model(model_dir, perturb_seed=seed), prompts) != before.token_ids
    assert out.weight_version == report.version


def test_pipelined_refit_across_processes_and_a_torn_one(actors, model_dir, prompts) -> None:
    """The engine loads each bucket as the source writes it: greedy output then equals HF's with
    the new weights. A source that fails part-way leaves the engine torn (some tensors loaded):
    it refuses to generate, in one line, until the next refit, after which it matches HF again."""
    from nrl_core.cluster import WorkerRaisedError
    from nrl_core.refit.manifest import TornRefitError

    colocated, separate = actors
    separate.call(WorkerHost.execute, functools.partial(perturb_hosted_source, seed=14, fresh_from=str(model_dir)))
    report = refit(separate.endpoint(0), colocated.endpoint(0), RefitPlan(bucket_bytes=256 * 1024, mode="pipelined"))
    assert (report.transport, report.placement) == ("shared_memory", "same_node")
    out = _greedy(colocated, prompts)
    assert out.token_ids == hf_greedy(hf_model(model_dir, perturb_seed=14), prompts)
    assert out.weight_version == report.version

    separate.call(WorkerHost.execute, functools.partial(perturb_hosted_source, seed=15, fresh_from=str(model_dir)))
    separate.call(WorkerHost.execute, fail_export_after(2))
    try:
        with pytest.raises(WorkerRaisedError, match="nrl_refit_export_streamed.. raised RuntimeError: the training "
                                                    "side failed mid-export"):
            refit(separate.endpoint(0), colocated.endpoint(0), RefitPlan(bucket_bytes=256 * 1024, mode="pipelined"))
    finally:
        separate.call(WorkerHost.execute, lambda worker: delattr(worker, "export_weights"))
    with pytest.raises(TornRefitError, match=r"^vLLM engine 0: generate with torn weights: the "
                                                r"pipelined refit to version \d+ failed after [1-9]\d* of \d+ tensors "
                                                r"reached the engine .*the exporting side raised RuntimeError"):
        _greedy(colocated, prompts)
    report = refit(separate.endpoint(0), colocated.endpoint(0), RefitPlan(bucket_bytes=256 * 1024, mode="pipelined"))
    out = _greedy(colocated, prompts)
    assert out.token_ids == hf_greedy(hf_model(model_dir, perturb_seed=15), prompts)
    assert out.weight_version == report.version
