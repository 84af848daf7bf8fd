"""An engine at tensor parallel 2 on GPUs inside Ray actors, decided on the CPU with CUDA mocked:
two gloo ranks stand in for the engine's two actors, each seeing only the GPU Ray gave it (3 and
5). What each rank's engine gets: ``LOCAL_RANK`` 0 on its own one GPU (vLLM's external launcher),
or, for an async engine whose first rank spawns the workers, both GPUs visible and this group's
rank variables hidden; custom all-reduce off where a rank sees one GPU; and NeMo RL's common
``expandable_segments:True`` removed for sleep mode with one warning naming the variable."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any
from unittest import mock

from nrl_core.testing.distributed import run_distributed

GPUS = ("3", "5")  # what Ray's CUDA_VISIBLE_DEVICES gives each actor
ALLOC = "expandable_segments:True,max_split_size_mb:512"


def _placements(rank: int, world: int) -> dict[str, Any]:
    import torch

    from nrl_gen_vllm.placement import engine_placement

    os.environ.update(CUDA_VISIBLE_DEVICES=GPUS[rank], PYTORCH_CUDA_ALLOC_CONF=ALLOC, LOCAL_RANK=str(rank))
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "device_count", return_value=1):
        return {
            "launcher": asdict(engine_placement(rank, 2, spawns_workers=False, external_launcher=True, sleep_mode=True)),
            "spawning": asdict(engine_placement(rank, 2, spawns_workers=True, external_launcher=False, sleep_mode=False)),
            "one_gpu": asdict(engine_placement(rank, 1, spawns_workers=False, external_launcher=False, sleep_mode=False)),
        }


def _cpu(rank: int, world: int) -> dict[str, Any]:
    from nrl_gen_vllm.placement import engine_placement

    os.environ.update(PYTORCH_CUDA_ALLOC_CONF=ALLOC)
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    return asdict(engine_placement(rank, 2, spawns_workers=True, external_launcher=True, sleep_mode=True))


def test_an_engine_at_tensor_parallel_2_in_two_actors_of_one_gpu_each() -> None:
    ranks = run_distributed(_placements, 2)
    for placed in ranks:
        launcher = placed["launcher"]
        assert launcher["env"] == {"LOCAL_RANK": "0", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
        assert launcher["engine_kwargs"] == {"disable_custom_all_reduce": True}
        [warning] = launcher["warnings"]
        assert warning.startswith("PYTORCH_CUDA_ALLOC_CONF: expandable_segments removed for the vLLM engine")
        assert launcher["allocator_settings"] == "expandable_segments:False"  # this process's allocator too
        spawning = placed["spawning"]  # the first rank starts both workers; vLLM numbers them 0 and 1
        assert spawning["env"]["CUDA_VISIBLE_DEVICES"] == "3,5"
        assert all(spawning["env"][name] == "" for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))
        assert spawning["engine_kwargs"] == {} and spawning["warnings"] == ()  # not colocated: no sleep mode
        assert placed["one_gpu"] == {"env": {"LOCAL_RANK": "0"}, "engine_kwargs": {}, "warnings": (),
                                     "allocator_settings": None}


def test_on_the_cpu_nothing_of_it_applies_but_thread_binding() -> None:
    """Without CUDA the allocator, devices and custom all-reduce are left alone; spawned CPU workers
    get no thread binding (vLLM's binding wants a NUMA node per worker)."""
    placed = run_distributed(_cpu, 2)
    for rank in range(2):
        assert placed[rank]["engine_kwargs"] == {} and placed[rank]["warnings"] == ()
        assert placed[rank]["allocator_settings"] is None
        assert placed[rank]["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
        assert "CUDA_VISIBLE_DEVICES" not in placed[rank]["env"] and "PYTORCH_CUDA_ALLOC_CONF" not in placed[rank]["env"]



def test_ahead_of_time_compilation_is_off_for_the_process_and_asking_for_it_is_one_warning(
        monkeypatch) -> None:
    from nrl_gen_vllm.placement import without_ahead_of_time_compilation

    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    assert without_ahead_of_time_compilation() is None and os.environ["VLLM_USE_AOT_COMPILE"] == "0"
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    warning = without_ahead_of_time_compilation()
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"
    assert warning.startswith("VLLM_USE_AOT_COMPILE=1 ignored for the vLLM engine") and "\n" not in warning


def test_pinned_cpu_code_paths_get_compile_caches_of_their_own_unless_the_environment_names_them(
        monkeypatch, tmp_path) -> None:
    """A compiled engine loaded from a cache written under other CPU pins sampled from NaN logits
    (the tests pin AVX2, other runs on the same host do not)."""
    from nrl_gen_vllm.placement import CPU_PINS, compile_caches_per_cpu_pins

    for name in (*CPU_PINS, "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT"):
        monkeypatch.setenv(name, "recorded")  # so that the test's end restores each as it was
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_caches_per_cpu_pins() == {} and "VLLM_CACHE_ROOT" not in os.environ  # unpinned: the defaults
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    avx2 = compile_caches_per_cpu_pins()
    assert avx2["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm" / "pinned-aten-avx2")
    assert avx2["TORCHINDUCTOR_CACHE_DIR"].endswith("_pinned-aten-avx2")
    assert all(os.environ[name] == value for name, value in avx2.items())
    for name in avx2:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    both = compile_caches_per_cpu_pins()
    assert both["VLLM_CACHE_ROOT"].endswith("pinned-aten-avx2-onednn-avx2") and both != avx2
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("VLLM_CACHE_ROOT", "/mine")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what importing vLLM sets
    assert set(compile_caches_per_cpu_pins()) == {"TORCHINDUCTOR_CACHE_DIR"} and os.environ["VLLM_CACHE_ROOT"] == "/mine"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/also-mine")
    assert compile_caches_per_cpu_pins() == {} and os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/also-mine"
