"""Refit machinery without any engine: buckets, manifest checks, transport choice, and the three
transports moving tensors in one process, between processes, and between Ray actors."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
from typing import Any

import pytest
import torch

from nrl_core.algorithms.refit_orchestrator import choose_transport, refit
from nrl_core.contracts import WeightSpec
from nrl_core.errors import ConfigError, NrlError
from nrl_core.refit import RefitError, iter_buckets, verify
from nrl_core.refit.buckets import manifest_bytes, module_of
from nrl_core.refit.endpoints import receive_into, send_handles
from nrl_core.refit.plan import RefitMode, RefitPlan
from nrl_core.refit.transports import (
    RefitSession,
    SharedMemoryTransport,
    _remove_stale_pool_files,
    release_shared_buffers,
)
from nrl_core.testing.refit_host import RandomWeightSource, RecordingSink, fail_export_after

SHARED_MEMORY = choose_transport("same_node", "shared_memory")  # as the driver hands it to the endpoints

SHAPES = {"embed.weight": (64, 32), "layers.0.w": (32, 96), "layers.0.b": (96,), "layers.1.w": (96, 32),
          "norm.weight": (32,), "scalar": ()}


def _leftovers(session_id: str) -> list[str]:
    return glob.glob(f"/dev/shm/nrl-refit-{session_id}-*")


@pytest.fixture
def own_shm_dir(monkeypatch, tmp_path) -> str:
    """Shared-memory refits write into a directory of their own, so what a test finds left there
    is its own: other tests' refits share /dev/shm meanwhile."""
    monkeypatch.setattr(SharedMemoryTransport, "prepare",
                        lambda self, session: session.with_options(shm_dir=str(tmp_path)))
    return str(tmp_path)


# --------------------------------------------------------------------------- buckets and manifests


def test_buckets_are_bounded_ordered_and_complete() -> None:
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 20, 5, 100, 1, 1])]
    buckets = list(iter_buckets(named, bucket_bytes=25 * 4))
    assert [[n for n, _ in b] for b in buckets] == [["t0"], ["t1", "t2"], ["t3"], ["t4", "t5"]]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    with pytest.raises(ValueError):
        list(iter_buckets(named, 0))


def test_a_bucket_ends_where_a_layer_ends_when_the_next_layer_would_not_fit() -> None:
    """Layers of 30 elements in buckets of 70: two layers a bucket, none split over two (a split
    layer makes vLLM's layerwise reload keep part of a bucket while the next arrives); a layer
    larger than a bucket (the sixth, 90) is still split, each bucket within the bound."""
    def layer(i: int, sizes: tuple[int, ...] = (10, 15, 5)) -> list[tuple[str, torch.Tensor]]:
        return [(f"model.layers.{i}.{part}.weight", torch.zeros(n)) for part, n in zip(("qkv", "up", "down"), sizes)]

    named = [("model.embed_tokens.weight", torch.zeros(40)), *[t for i in range(5) for t in layer(i)],
             *layer(5, (40, 40, 10)), ("model.norm.weight", torch.zeros(1))]
    buckets = list(iter_buckets(named, bucket_bytes=70 * 4))
    layers = [sorted({module_of(n) for n, _ in b}) for b in buckets]
    assert layers[:3] == [["model.embed_tokens"], ["model.layers.0", "model.layers.1"],
                          ["model.layers.2", "model.layers.3"]]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    assert all(sum(t.numel() for _, t in b) <= 70 for b in buckets)
    assert [sum("model.layers.5" in modules for modules in layers), layers[-1]] == [2, ["model.norm"]], layers
    assert module_of("lm_head.weight") == "lm_head" and module_of("model.language_model.layers.7.mlp.w") == \
        "model.language_model.layers.7"


def test_manifest_check_accepts_exact_and_names_every_problem() -> None:
    manifest = [WeightSpec(name="a", shape=(2, 3), dtype="float32"), WeightSpec(name="b", shape=(3,), dtype="float32"),
                WeightSpec(name="c", shape=(1,), dtype="float32")]
    verify(manifest, manifest)
    received = [WeightSpec(name="a", shape=(3, 2), dtype="float32"), WeightSpec(name="b", shape=(3,), dtype="bfloat16"),
                WeightSpec(name="b", shape=(3,), dtype="bfloat16"), WeightSpec(name="zz", shape=(1,), dtype="float32")]
    with pytest.raises(RefitError) as info:
        verify(received, manifest)
    err = info.value
    assert err.missing == ["c"] and err.extra == ["zz"] and err.duplicate == ["b"] and sorted(err.mismatched) == ["a", "b"]
    text = str(err)
    for key in ("c", "zz", "a (got [3, 2] float32, expected [2, 3] float32)", "weights unchanged"):
        assert key in text


def test_transport_choice_by_placement_and_override() -> None:
    assert choose_transport("same_process").name == "in_process"
    assert choose_transport("same_node").name == "shared_memory"
    assert choose_transport("cross_node").name == "broadcast"
    assert choose_transport("same_node", "broadcast").name == "broadcast"
    with pytest.raises(ConfigError, match="policy.refit.transport"):
        choose_transport("cross_node", "shared_memory")
    with pytest.raises(ConfigError, match="not available"):
        choose_transport("same_node", "carrier_pigeon")


RULE = {  # (placement, device) -> what the core's transports give, for every combination
    ("same_process", "cpu"): "in_process", ("same_process", "cuda"): "in_process",
    ("same_node", "cpu"): "shared_memory", ("same_node", "cuda"): "broadcast",  # NCCL, not /dev/shm, between GPUs
    ("cross_node", "cpu"): "broadcast", ("cross_node", "cuda"): "broadcast",
}


@pytest.mark.parametrize("placement, device", list(RULE))
def test_one_rule_picks_the_transport_from_placement_and_device(placement, device) -> None:
    assert choose_transport(placement, device=device).name == RULE[(placement, device)]


def test_a_transport_the_config_names_is_used_on_any_device_the_rule_never_picks_it_for() -> None:
    assert choose_transport("same_node", "shared_memory", device="cuda").name == "shared_memory"
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        choose_transport("same_node", device="tpu")


def test_a_transport_spec_names_its_devices_from_the_known_ones() -> None:
    from nrl_core.contracts import RefitTransportSpec
    from nrl_core.errors import PluginError

    for devices in (("gpu",), "cuda"):
        with pytest.raises(PluginError, match=r"refit transport 'x': devices must be a tuple of 'cpu', 'cuda'"):
            RefitTransportSpec(name="x", transport="m:T", placements=("same_node",), distribution="d", devices=devices)


class _Group:
    """A stand-in worker group: each rank started with or without a GPU, and its engine loads
    refits on ``loads_on`` (what ``nrl_refit_device`` answers); ``asked`` counts the questions."""

    def __init__(self, node: str, cuda: bool, loads_on: str) -> None:
        from types import SimpleNamespace

        self.infos = [SimpleNamespace(cuda=cuda, worker_id=f"{node}-{cuda}-{loads_on}-{id(self)}")]
        self.node, self.loads_on, self.asked = node, loads_on, 0

    def rank(self) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(node_id=self.node, rank=0, group=self)

    def call(self, method: Any, on: list[int]) -> list[str]:
        assert method.__name__ == "nrl_refit_device"
        self.asked += 1
        return [self.loads_on for _ in on]


@pytest.mark.parametrize("source, sinks, expected", [
    (("a", False), [("a", False, "cpu"), ("a", False, "cpu")], ("same_node", "cpu")),
    (("a", True), [("a", True, "cuda"), ("a", True, "cuda")], ("same_node", "cuda")),
    (("a", True), [("a", True, "cuda"), ("b", True, "cuda")], ("cross_node", "cuda")),
    (("a", True), [("a", False, "cpu")], ("same_node", "cpu")),  # an engine on the CPU: through host memory
    (("a", True), [("b", False, "cpu")], ("cross_node", "cpu")),  # gloo, from the GPU source's host copies
    (("a", False), [("b", True, "cuda")], ("cross_node", "cpu")),
    (("a", True), [("a", True, "cuda"), ("a", True, "cpu")], ("same_node", "cpu")),  # one engine loads from files
])
def test_where_a_refit_runs_comes_from_the_actors_nodes_and_devices(source, sinks, expected) -> None:
    from nrl_core.algorithms.refit_orchestrator import placement_of

    groups = [_Group(*sink) for sink in sinks]
    source_rank = _Group(*source, "cuda").rank()
    assert placement_of(source_rank, [g.rank() for g in groups]) == expected
    assert placement_of(source_rank, [g.rank() for g in groups]) == expected  # asked once per run
    assert all(g.asked == (1 if source[1] and all(s[1] for s in sinks) else 0) for g in groups)


def test_the_run_plan_reads_nemo_rl_and_nrl_spellings() -> None:
    plan = RefitPlan.for_run({"policy": {"precision": "bfloat16", "refit_buffer_size_gb": 0.5,
                                         "refit": {"transport": "shared_memory", "bucket_size_mb": 64}}})
    assert (plan.transport, plan.bucket_bytes, plan.dtype) == ("shared_memory", 2**29, "bfloat16")
    assert RefitPlan.for_run({"policy": {"refit": {"bucket_size_mb": 64}}}).bucket_bytes == 64 * 2**20


def test_the_run_plan_pipelines_and_delivers_what_the_engines_declare() -> None:
    """Pipelined only when asked and the engines can, never for adapter-only refits (the engines'
    adapter import is atomic); each rank its wanted tensors when the engines declare it."""
    config = {"policy": {"refit": {"pipelined": True, "adapters": False}}}
    both = frozenset({"pipelined_import", "partial_import"})
    assert (RefitPlan.for_run(config, both).mode, RefitPlan.for_run(config, both).delivery) == ("pipelined", "wanted")
    assert RefitPlan.for_run(config).mode == RefitMode.STAGED and RefitPlan.for_run(config).delivery == "whole"
    assert RefitPlan.for_run({"policy": {"refit": {"pipelined": False}}}, both).mode == RefitMode.STAGED
    assert RefitPlan.for_run({"policy": {"refit": {"pipelined": True, "adapters": True}}}, both).mode == "staged"
    assert RefitPlan.for_run(config, both, timeout_s=5.0).with_mode("in_flight").in_flight
    with pytest.raises(ValueError, match="'sideways' is not a valid RefitMode"):
        RefitPlan(mode="sideways")


# --------------------------------------------------------------------------- transports


def test_in_process_refit_hands_tensors_over_by_reference() -> None:
    source, sink = RandomWeightSource(SHAPES, seed=1), RecordingSink()
    seen: list[int] = []
    original = sink.import_weights

    def spy(buckets, manifest):
        buckets = list(buckets)
        seen.extend(t.data_ptr() for b in buckets for _, t in b)
        return original(iter(buckets), manifest)

    sink.import_weights = spy  # type: ignore[method-assign]
    report = refit(source, sink, RefitPlan(bucket_bytes=4096))
    assert report.transport == "in_process" and report.version == 1
    assert report.bytes == manifest_bytes(source.weight_manifest("float32"))
    assert set(seen) == {t.data_ptr() for t in source.tensors.values()}  # no copy on the way
    assert sink.checksums() == source.checksums()


def test_a_pipelined_local_refit_loads_as_exported_and_a_failed_one_still_ends_the_export() -> None:
    """In one process a sink that declares ``pipelined_import`` loads each bucket as it is
    exported (the export is not over when the first tensor lands). When it stops part-way, the
    export still runs to its end: a sharded source's ranks gather collectively, and a rank that
    stopped would leave the others waiting."""
    from nrl_core.refit.endpoints import refit_local
    from nrl_core.refit.manifest import TornRefitError
    from nrl_core.testing.refit_host import PipelinedRecordingSink

    class CountingSource(RandomWeightSource):
        """Counts the buckets it exports, and the tensors the sink had loaded before each."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.exported, self.loaded_before = 0, []

        def export_weights(self, bucket_bytes: int, dtype: str):
            for bucket in super().export_weights(bucket_bytes, dtype):
                self.loaded_before.append(sink.loaded)
                self.exported += 1
                yield bucket

    class StopsAfter(PipelinedRecordingSink):
        def import_weights_pipelined(self, buckets, manifest):
            def cut():
                for k, bucket in enumerate(buckets):
                    if k == 1:
                        raise RuntimeError("the engine stopped reading")
                    yield bucket
            return super().import_weights_pipelined(cut(), manifest)

    transport = choose_transport("same_process")
    source, sink = CountingSource(SHAPES, seed=4), PipelinedRecordingSink()
    refit_local(source, sink, transport, 2048, "float32", pipelined=True)
    assert sink.checksums() == source.checksums() and source.exported > 2
    assert source.loaded_before[1] > 0  # bucket 1 was made after bucket 0's tensors loaded
    stopped = StopsAfter()
    source, sink = CountingSource(SHAPES, seed=5), stopped
    with pytest.raises(TornRefitError, match="failed after .* tensors: the engine stopped reading"):
        refit_local(source, sink, transport, 2048, "float32", pipelined=True)
    full, sink = CountingSource(SHAPES, seed=5), PipelinedRecordingSink()
    refit_local(full, sink, transport, 2048, "float32", pipelined=True)
    assert source.exported == full.exported  # the failed refit's export still ran to its end


def test_shared_memory_in_one_process_round_trips_bf16_and_cleans_up(own_shm_dir) -> None:
    source, sink = RandomWeightSource(SHAPES, seed=2, dtype="bfloat16"), RecordingSink()
    report = refit(source, sink, RefitPlan(transport="shared_memory", bucket_bytes=4096, dtype="bfloat16"))
    assert report.transport == "shared_memory" and sink.buckets > 2
    for name, tensor in source.tensors.items():
        assert torch.equal(sink.received[name], tensor) and sink.received[name].dtype == torch.bfloat16
    assert os.listdir(own_shm_dir)  # the sender's pool, kept for the next refit
    release_shared_buffers()
    assert os.listdir(own_shm_dir) == []


def test_shared_memory_buffers_are_reused_across_refits() -> None:
    sink = RecordingSink()
    refit(RandomWeightSource(SHAPES, seed=5), sink, RefitPlan(transport="shared_memory", bucket_bytes=4096))
    pool = sorted(glob.glob(f"/dev/shm/nrl-refit-pool-{os.getpid()}-*"))
    inodes = [os.stat(p).st_ino for p in pool]
    second = RandomWeightSource(SHAPES, seed=6)
    refit(second, sink, RefitPlan(transport="shared_memory", bucket_bytes=4096))
    assert sorted(glob.glob(f"/dev/shm/nrl-refit-pool-{os.getpid()}-*")) == pool and pool
    assert [os.stat(p).st_ino for p in pool] == inodes  # the same files, rewritten
    assert all(torch.equal(sink.received[name], t) for name, t in second.tensors.items())
    release_shared_buffers()
    assert glob.glob(f"/dev/shm/nrl-refit-pool-{os.getpid()}-*") == []


def test_smaller_buckets_are_written_into_the_mappings_already_held() -> None:
    """Refits whose buckets differ in size (a pipelined refit's chunks beside an atomic refit's
    buckets) keep both sides' mappings: mapping a file again faults in every page it touches."""
    from nrl_core.refit import transports

    release_shared_buffers()
    try:
        sink = RecordingSink()
        refit(RandomWeightSource(SHAPES, seed=8), sink, RefitPlan(transport="shared_memory", bucket_bytes=2**20))  # one bucket
        pool = transports._SENDER_POOLS[transports.shm_dir()]
        sent = {index: flat.data_ptr() for index, flat in pool.maps.items()}
        read = {path: held.flat.data_ptr() for path, held in transports._RECEIVER_MAPS.items()}
        second = RandomWeightSource(SHAPES, seed=9)
        refit(second, sink, RefitPlan(transport="shared_memory", bucket_bytes=2048))  # several, each smaller
        assert len(pool.maps) > len(sent) == len(read) == 1
        assert {index: pool.maps[index].data_ptr() for index in sent} == sent
        assert {path: transports._RECEIVER_MAPS[path].flat.data_ptr() for path in read} == read
        assert all(torch.equal(sink.received[name], t) for name, t in second.tensors.items())
    finally:
        release_shared_buffers()


def test_a_receiver_reads_a_pool_file_made_again_under_its_name_not_its_old_mapping() -> None:
    """A sender that released its pool (or a pid used again) writes new files under the old names:
    a receiver still holding a mapping of the old file must map the new one."""
    from nrl_core.refit import transports

    release_shared_buffers()
    try:
        sink = RecordingSink()
        refit(RandomWeightSource(SHAPES, seed=10), sink, RefitPlan(transport="shared_memory", bucket_bytes=2**20))
        transports._SENDER_POOLS[transports.shm_dir()].release()  # the sender's side only
        second = RandomWeightSource(SHAPES, seed=11)
        refit(second, sink, RefitPlan(transport="shared_memory", bucket_bytes=2**20))  # the same file names and sizes
        assert all(torch.equal(sink.received[name], t) for name, t in second.tensors.items())
    finally:
        release_shared_buffers()


def test_shared_memory_without_reuse_leaves_nothing_behind() -> None:
    transport = SharedMemoryTransport()
    session = transport.prepare(RefitSession()).with_options(reuse_buffers=False)
    source, sink = RandomWeightSource(SHAPES, seed=7), RecordingSink()
    handles = list(send_handles(source, SHARED_MEMORY, session, 2048, "float32"))
    assert all(not h.reused for h in handles) and _leftovers(session.id)
    receive_into(sink, SHARED_MEMORY, session, iter(handles), source.weight_manifest("float32"))
    second = RecordingSink()  # receivers leave the files for others reading the same export
    receive_into(second, SHARED_MEMORY, session, iter(handles), source.weight_manifest("float32"))
    transport.cleanup(session)
    assert _leftovers(session.id) == []
    for recorded in (sink, second):
        assert all(torch.equal(recorded.received[name], t) for name, t in source.tensors.items())


def _send_from_child(session: RefitSession, queue: mp.Queue, received: Any) -> None:
    source = RandomWeightSource(SHAPES, seed=3)
    for handle in send_handles(source, SHARED_MEMORY, session, 2048, "float32"):
        queue.put(handle)
    queue.put(None)
    received.wait(60)  # a sender outlives the refit it serves; its buffers go when it exits


def test_shared_memory_between_two_processes_delivers_identical_tensors() -> None:
    transport = SharedMemoryTransport()
    session = transport.prepare(RefitSession())
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    received = ctx.Event()
    child = ctx.Process(target=_send_from_child, args=(session, queue, received))
    child.start()
    handles = list(iter(queue.get, None))
    sink = RecordingSink()
    receive_into(sink, SHARED_MEMORY, session, iter(handles), RandomWeightSource(SHAPES, seed=3).weight_manifest("float32"))
    received.set()
    child.join(timeout=60)
    assert child.exitcode == 0
    expected = RandomWeightSource(SHAPES, seed=3)
    assert sink.buckets > 2
    for name, tensor in expected.tensors.items():
        assert torch.equal(sink.received[name], tensor)
    assert _leftovers(session.id) == []
    assert glob.glob(f"/dev/shm/nrl-refit-pool-{child.pid}-*") == []  # the child released its buffers at exit
    # Once the sender is gone its buffers are too: a late receiver gets an error, never zeros.
    with pytest.raises(RefitError, match="is gone or short"):
        receive_into(RecordingSink(), SHARED_MEMORY, session, iter(handles[:1]),
                     RandomWeightSource(SHAPES, seed=3).weight_manifest("float32"))


def test_shared_memory_too_small_is_a_clear_error_before_anything_is_written(monkeypatch, own_shm_dir) -> None:
    full = os.statvfs_result((4096, 4096, 10, 0, 0, 10, 0, 0, 0, 255))  # no free blocks
    monkeypatch.setattr(os, "statvfs", lambda path: full)
    sink = RecordingSink()
    with pytest.raises(NrlError, match=r"^refit: the next weight bucket .* has 0.0 MiB free but needs .*--shm-size"):
        refit(RandomWeightSource(SHAPES, seed=9), sink, RefitPlan(transport="shared_memory", bucket_bytes=2048))
    assert sink.weight_version == 0 and sink.received == {}
    assert os.listdir(own_shm_dir) == []


def test_a_shared_file_is_reserved_whole_or_refused_in_one_line_leaving_nothing(monkeypatch) -> None:
    """``NRL_SHM_FREE_BYTES`` caps the free space the check sees (a budget, or a small /dev/shm
    here); a file that fits is backed before the first write, one that does not is removed."""
    from nrl_core.refit.shm_space import FREE_BYTES_VARIABLE, shared_file, shm_dir

    def mine() -> list[str]:  # other tests' processes write to the same directory meanwhile
        return glob.glob(os.path.join(shm_dir(), "nrl-test-shm-*"))

    with shared_file(3 * 4096, "nrl-test-shm-", "test") as path:
        assert os.path.getsize(path) == 3 * 4096 and os.stat(path).st_blocks * 512 >= 3 * 4096  # backed, not sparse
    assert mine() == []
    monkeypatch.setenv(FREE_BYTES_VARIABLE, str(2**20))
    with pytest.raises(NrlError) as err, shared_file(2 * 2**20, "nrl-test-shm-", "the async engine's refit"):
        pass
    assert str(err.value).startswith(f"the async engine's refit: {shm_dir()} has 1.0 MiB free but needs 2.0 MiB")
    assert "\n" not in str(err.value) and mine() == []


def test_space_the_kernel_refuses_after_the_check_is_one_line_too() -> None:
    """The free-space check can pass and the allocation still fail (another process took the
    space meanwhile): here a file-size limit the kernel enforces makes ``posix_fallocate`` fail, in
    a child process so the limit stays there. One line, and no file left."""
    import subprocess
    import sys

    from nrl_core.refit.shm_space import shm_dir

    program = (
        "import os, resource, signal\n"
        "from nrl_core.errors import NrlError\n"
        "from nrl_core.refit.shm_space import shared_file\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    with shared_file(4 * 2**20, 'nrl-test-limit-', 'the async engine\\'s refit'):\n"
        "        print('reserved')\n"
        "except NrlError as exc:\n"
        "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("the async engine's refit: ") and "needs 4.0 MiB" in out.stdout, out.stdout
    assert out.stdout.count("\n") == 1 and glob.glob(os.path.join(shm_dir(), "nrl-test-limit-*")) == []


def test_buffers_of_a_killed_sender_are_removed_by_the_next_pool() -> None:
    dead_pid = 2**22 + 12345  # above the kernel's pid range: never a live process
    stale = f"/dev/shm/nrl-refit-pool-{dead_pid}-000000"
    open(stale, "wb").close()
    _remove_stale_pool_files("/dev/shm")
    assert not os.path.exists(stale)


def test_missing_tensor_is_rejected_and_shared_memory_is_cleaned_up(own_shm_dir) -> None:
    source, sink = RandomWeightSource(SHAPES, seed=4), RecordingSink()
    manifest = source.weight_manifest("float32") + [WeightSpec(name="lost.weight", shape=(4,), dtype="float32")]
    source.weight_manifest = lambda dtype: manifest  # type: ignore[method-assign]
    with pytest.raises(RefitError, match="lost.weight"):
        refit(source, sink, RefitPlan(transport="shared_memory", bucket_bytes=2048))
    assert sink.weight_version == 0
    release_shared_buffers()
    assert os.listdir(own_shm_dir) == []


# --------------------------------------------------------------------------- between Ray actors


@pytest.fixture(scope="module")
def ray_groups():
    """A weight source and two sinks, each a worker group of one rank (the production host)."""
    yield from ray_groups_of("nrl_core.testing.refit_host:RecordingSink")


def ray_groups_of(sink: str, shapes: dict[str, tuple[int, ...]] = SHAPES,
                  sink_kwargs: dict[str, Any] | None = None) -> Any:
    """On the suite's shared Ray, a weight source of ``shapes`` and two ``sink`` workers; yield them; stop them."""
    from nrl_core.cluster import WorkerGroup, init_ray
    from nrl_core.cluster._host import WorkerHost
    from tests.launch import driving_the_shared_ray

    with driving_the_shared_ray():
        init_ray({})
        source = WorkerGroup("nrl_core.testing.refit_host:RandomWeightSource", 1, name="source",
                             init_kwargs={"shapes": shapes, "seed": 5}, distributed_backend="none")
        sinks = WorkerGroup(sink, 2, name="sinks", distributed_backend="none", init_kwargs=sink_kwargs or {})
        yield source, sinks
        source.call(WorkerHost.nrl_refit_release)  # ray.kill skips exit handlers: free the buffers first
        source.shutdown()
        sinks.shutdown()


def _sinks(group: Any) -> list[Any]:
    return [group.endpoint(r) for r in range(group.world_size)]


def test_broadcast_runs_nccl_between_gpus_and_gloo_here_on_one_code_path() -> None:
    """The sender picks the group's backend in ``prepare``; a receiver without CUDA asked to join
    an NCCL group refuses in one line before touching the store (nothing hangs)."""
    from nrl_core.refit.transports import BroadcastTransport, broadcast_backend

    assert (broadcast_backend(cuda=True), broadcast_backend(cuda=False)) == ("nccl", "gloo")
    session = BroadcastTransport().prepare(RefitSession(options={"world_size": 3}))
    try:
        assert session.options["backend"] == ("nccl" if torch.cuda.is_available() else "gloo")
        if not torch.cuda.is_available():
            with pytest.raises(RefitError, match="over NCCL but receiver rank 1 has no CUDA device"):
                BroadcastTransport().receiver(session.with_options(backend="nccl", rank=1))
    finally:
        BroadcastTransport().cleanup(session)  # the sender's store, bound by prepare


@pytest.mark.slow
@pytest.mark.parametrize("transport", [None, "broadcast"])
def test_refit_between_worker_groups(ray_groups, transport) -> None:
    from nrl_core.cluster._host import WorkerHost

    source, sinks = ray_groups
    assert len({info.pid for group in ray_groups for info in group.infos}) == 3
    exports = source.call(WorkerHost.execute, lambda worker: worker.exports, on=0)
    report = refit(source.endpoint(0), _sinks(sinks), RefitPlan(transport=transport, bucket_bytes=2048))
    assert report.transport == (transport or "shared_memory") and report.placement == "same_node"
    assert sinks.call("checksums") == [source.call("checksums", on=0)] * 2
    assert report.bytes == 2 * manifest_bytes(RandomWeightSource(SHAPES).weight_manifest("float32"))
    # One export serves both engines: other training ranks run the same collective export once.
    assert source.call(WorkerHost.execute, lambda worker: worker.exports, on=0) == exports + 1


def _groups_formed(worker: Any) -> tuple[int, int]:
    """``WorkerHost.execute`` target: refit groups this process formed, and holds now."""
    from nrl_core.refit import transports

    return transports.broadcast_groups_formed(), len(transports._LASTING)


@pytest.mark.slow
def test_a_broadcast_group_lasts_from_refit_to_refit_and_is_formed_again_after_a_failure(ray_groups) -> None:
    """Forming the group costs seconds on NCCL and its communicator lives until destroyed: it is
    formed once for a sender and its receivers, reused by every later refit, dropped by every
    member when a refit through it fails (the next one forms it again) and destroyed at release."""
    from nrl_core.cluster._host import WorkerHost

    source, sinks = ray_groups

    def formed() -> list[tuple[int, int]]:
        return [source.call(WorkerHost.execute, _groups_formed, on=0), *sinks.call(WorkerHost.execute, _groups_formed)]

    refit(source.endpoint(0), _sinks(sinks), RefitPlan(transport="broadcast", bucket_bytes=2048))
    first = formed()
    assert all(held >= 1 for _, held in first)
    for _ in range(3):
        refit(source.endpoint(0), _sinks(sinks), RefitPlan(transport="broadcast", bucket_bytes=2048))
        assert sinks.call("checksums") == [source.call("checksums", on=0)] * 2
    assert formed() == first  # three refits, no group formed
    source.call(WorkerHost.execute, fail_export_after(1))
    try:
        with pytest.raises(Exception, match="the training side failed mid-export"):
            refit(source.endpoint(0), _sinks(sinks), RefitPlan(transport="broadcast", bucket_bytes=2048))
    finally:
        source.call(WorkerHost.execute, lambda worker: delattr(worker, "export_weights"))
    refit(source.endpoint(0), _sinks(sinks), RefitPlan(transport="broadcast", bucket_bytes=2048))
    assert [count for count, _ in formed()] == [count + 1 for count, _ in first]  # formed once more
    assert sinks.call("checksums") == [source.call("checksums", on=0)] * 2
    from nrl_core.algorithms import refit_orchestrator

    try:
        source.call(WorkerHost.nrl_refit_release)
        sinks.call(WorkerHost.nrl_refit_release, on=[0, 1])
        assert [held for _, held in formed()] == [0, 0, 0]
    finally:
        refit_orchestrator._FORMED_GROUPS.clear()  # release is for shutdown: this driver forgets the groups too
    refit(source.endpoint(0), _sinks(sinks), RefitPlan(transport="broadcast", bucket_bytes=2048))  # formed again
    assert [count for count, _ in formed()] == [count + 2 for count, _ in first]


@pytest.mark.slow
def test_refit_rejects_sinks_both_inside_and_outside_the_source_actor(ray_groups) -> None:
    source, sinks = ray_groups
    with pytest.raises(ValueError, match="colocated, the sinks are the source ranks themselves; otherwise one source"):
        refit(source.endpoint(0), [source.endpoint(0), sinks.endpoint(0)])
    with pytest.raises(TypeError, match="all local objects or all worker group ranks"):
        refit(source.endpoint(0), RecordingSink())


@pytest.mark.slow
@pytest.mark.parametrize("transport", [None, "broadcast"])
def test_failed_export_leaves_the_engines_untouched_and_names_the_source_rank(ray_groups, transport) -> None:
    from nrl_core.cluster import WorkerRaisedError
    from nrl_core.cluster._host import WorkerHost

    source, sinks = ray_groups
    checksums = sinks.call("checksums")
    versions = sinks.call(WorkerHost.execute, lambda worker: worker.weight_version)
    source.call(WorkerHost.execute, fail_export_after(1))
    try:
        with pytest.raises(WorkerRaisedError, match=r"source\[rank 0\] pid \d+: nrl_refit_\w+\(\) raised "
                                                    r"RuntimeError: the training side failed mid-export"):
            refit(source.endpoint(0), _sinks(sinks), RefitPlan(transport=transport, bucket_bytes=2048))
    finally:
        source.call(WorkerHost.execute, lambda worker: delattr(worker, "export_weights"))
    assert sinks.call("checksums") == checksums
    assert sinks.call(WorkerHost.execute, lambda worker: worker.weight_version) == versions
    refit(source.endpoint(0), _sinks(sinks), RefitPlan(transport=transport, bucket_bytes=2048))  # the next refit goes through
    assert sinks.call("checksums") == [source.call("checksums", on=0)] * 2


@pytest.mark.slow
def test_an_engine_that_dies_during_a_refit_is_named_in_one_line(ray_groups) -> None:
    """The refit waits through the worker groups: a sink's death is that group's one-line error,
    and the source's group stays usable."""
    import ray

    from nrl_core.cluster import WorkerDiedError, WorkerGroup
    from nrl_core.cluster._host import WorkerHost

    source = WorkerGroup("nrl_core.testing.refit_host:RandomWeightSource", 1, name="lone-source",
                         init_kwargs={"shapes": SHAPES, "seed": 6}, distributed_backend="none")
    doomed = WorkerGroup("nrl_core.testing.refit_host:RecordingSink", 1, name="doomed", distributed_backend="none")
    try:
        ray.kill(doomed.actors[0], no_restart=True)
        with pytest.raises(WorkerDiedError, match=r"^doomed\[rank 0\] pid \d+ died .*during nrl_refit_import\(\)"):
            refit(source.endpoint(0), [doomed.endpoint(0)], RefitPlan(bucket_bytes=2048))
        assert source.call("checksums", on=0)  # the training side is untouched and answers
        source.call(WorkerHost.nrl_refit_release)
    finally:
        doomed.shutdown()
        source.shutdown()
