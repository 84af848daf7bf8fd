"""What a vLLM engine's processes must see on GPUs inside Ray actors, decided in one place.

Why: Ray gives each actor its own GPU (``CUDA_VISIBLE_DEVICES`` of one device), while vLLM assumes
a process that starts its tensor-parallel workers itself, on devices it can all see. So:

* an engine rank in its own actor (vLLM's ``external_launcher``, or an engine of one rank) sees
  its one GPU as ``cuda:0``: ``LOCAL_RANK`` is 0, whatever the rank's place on the node;
* an async engine's workers at tensor parallel 2+, which its first rank spawns, see the devices
  of all the engine's ranks (gathered over the generation group) and number them 0..tp-1
  themselves, so this group's ``LOCAL_RANK`` is hidden from them;
* vLLM's custom all-reduce exchanges CUDA IPC handles with peer devices it expects to see, which
  an actor that sees one GPU cannot: it is off for ``external_launcher`` engines at tensor
  parallel 2+ (``vllm_kwargs.disable_custom_all_reduce`` still overrides);
* sleep mode's allocator refuses ``expandable_segments:True`` in ``PYTORCH_CUDA_ALLOC_CONF``,
  common in NeMo RL's recipes: the setting is removed from what the engine's processes see, and
  turned off in this process's allocator (which read the variable when CUDA started), with one
  warning;
* a model vLLM loads from its ahead-of-time compile cache misses refits of its experts, and every
  nrl engine takes refits: :func:`without_ahead_of_time_compilation` turns it off for the whole
  process (vLLM reads the variable at every forward pass, and caches it after start-up).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
AOT_COMPILE = "VLLM_USE_AOT_COMPILE"
#: This generation group's own torch.distributed variables, hidden from an async engine's spawned
#: workers: vLLM's executor forms the engine's group itself.
GROUP_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Placement:
    """The environment around the engine's construction (a value of ``""`` removes the variable)
    and the engine arguments that follow from where it runs."""

    env: dict[str, str] = field(default_factory=dict)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    allocator_settings: str | None = None  # for this process's CUDA allocator, set before the engine starts

    def apply_allocator_settings(self) -> None:
        import torch

        if self.allocator_settings and torch.cuda.is_available():
            torch.cuda.memory._set_allocator_settings(self.allocator_settings)


def engine_placement(rank: int, tp: int, *, spawns_workers: bool, external_launcher: bool, sleep_mode: bool) -> Placement:
    """The placement of engine rank ``rank`` of tensor parallel ``tp``. ``spawns_workers``: an
    async engine at tp 2+, whose first rank starts the workers (collective over the generation
    group: every rank must call it). ``external_launcher``: each rank is one of the engine's workers."""
    import torch

    env: dict[str, str] = {}
    kwargs: dict[str, Any] = {}
    warnings: list[str] = []
    cuda = torch.cuda.is_available()
    if spawns_workers:
        env.update(dict.fromkeys(GROUP_VARIABLES, ""))
        if cuda:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(_engine_devices(rank, tp))
        elif "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # vLLM's automatic binding wants a NUMA node per worker
    if cuda and torch.cuda.device_count() == 1 and not spawns_workers:
        env["LOCAL_RANK"] = "0"  # vLLM picks cuda:LOCAL_RANK; the actor's one GPU is cuda:0
    if cuda and external_launcher and tp > 1:
        kwargs["disable_custom_all_reduce"] = True
    conf = os.environ.get(ALLOC_CONF, "")
    allocator = None
    if cuda and sleep_mode and "expandable_segments:true" in conf.replace(" ", "").lower():
        kept = ",".join(part for part in conf.split(",") if not part.replace(" ", "").lower().startswith("expandable_segments"))
        env[ALLOC_CONF] = kept
        allocator = "expandable_segments:False"
        warnings.append(f"{ALLOC_CONF}: expandable_segments removed for the vLLM engine (its sleep mode's allocator "
                        f"refuses it) and turned off in this process; {ALLOC_CONF} is now {kept!r} there")
    return Placement(env, kwargs, tuple(warnings), allocator)


def without_ahead_of_time_compilation() -> str | None:
    """Turn vLLM's ahead-of-time compilation off in this process, before its first engine;
    torch.compile and Inductor's cache still run. The warning to log when the environment asked
    for it, else None."""
    asked = os.environ.get(AOT_COMPILE, "").strip() == "1"
    os.environ[AOT_COMPILE] = "0"
    if asked:
        return (f"{AOT_COMPILE}=1 ignored for the vLLM engine: a model loaded from vLLM's ahead-of-time compile "
                "cache misses refits of its experts; torch.compile still runs")
    return None


#: Settings that pin the CPU code paths of torch, oneDNN and MKL below what the machine offers.
CPU_PINS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR")


def compile_caches_per_cpu_pins() -> dict[str, str]:
    """Give compiled engines of each setting of :data:`CPU_PINS` caches of their own, unless the
    environment names the caches. Inductor's and vLLM's compile caches are keyed by the code, not
    by these settings: an engine compiled unpinned and loaded from the cache under
    ``ATEN_CPU_CAPABILITY=avx2`` sampled from NaN logits, and the other way round it corrupted the
    heap (seen on one host, where the tests pin AVX2 and the demo does not). The caches set."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    pins = [f"{name.split('_')[0]}-{os.environ[name]}" for name in CPU_PINS if os.environ.get(name, "").strip()]
    if not pins:
        return {}
    tag = "pinned-" + "-".join(pins).lower()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    chosen = {"TORCHINDUCTOR_CACHE_DIR": f"{default_cache_dir()}_{tag}", "VLLM_CACHE_ROOT": str(cache / "vllm" / tag)}
    unchosen = {"TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}  # importing vLLM sets it: no one's choice
    chosen = {name: value for name, value in chosen.items() if os.environ.get(name) in (None, "", unchosen.get(name))}
    os.environ.update(chosen)
    return chosen


def _engine_devices(rank: int, tp: int) -> list[str]:
    """The devices of the engine's ``tp`` ranks, each rank's own as its actor sees it. Collective."""
    import torch
    import torch.distributed as dist

    own = os.environ.get("CUDA_VISIBLE_DEVICES") or str(torch.cuda.current_device())
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, own)
    first = rank - rank % tp
    return every[first:first + tp]
