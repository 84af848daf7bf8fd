"""Run a function on N local processes joined in a gloo ``torch.distributed`` group.

Why: backends must be tested at world size > 1 (sharding, collectives, checkpoint resharding) on a
CPU-only machine, without ``torchrun`` or Ray. :func:`run_distributed` spawns the ranks, gives
each a process group, and returns each rank's result in rank order; a failure on any rank raises
in the caller with that rank's traceback. Results travel through ``torch.save`` files, so tensors
and plain Python objects both come back.

Ranks start from a fork server that has already imported torch (and, where installed,
transformers and Megatron-Core): a spawned interpreter would import them again for every rank,
seconds each, which is most of what a small multi-rank test costs. Each rank still gets the
caller's environment as it is at the call (:func:`rank_context`).
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from nrl_core.long_lived import freeze_at_exit
from nrl_core.net import free_port


def init_local_group(rank: int = 0, world_size: int = 1, port: int | None = None) -> None:
    """Initialise a gloo process group on localhost unless one exists (world of 1 by default)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if port is not None or "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(port or free_port())
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


#: What the fork server imports once, so that processes forked from it need not (missing ones are
#: skipped): what test ranks import, and what a driver process of ``nrl`` imports (Ray). The
#: Megatron backend's package comes before Megatron-Core, as in a worker, so that its fused
#: functions compile on first call (nrl_backend_megatron/compile_on_call.py).
PRELOAD: tuple[str, ...] = ("torch", "torch.distributed", "transformers", "nrl_backend_megatron", "megatron.core",
                            "ray")


def rank_context() -> Any:
    """The multiprocessing context test ranks start from: a fork server that preloads
    :data:`PRELOAD`. Forked ranks inherit the server's environment, not the caller's, so the entry
    of every rank must install the caller's (:func:`adopt_environment`)."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))  # takes effect when the server first starts
    return context


def adopt_environment(environ: dict[str, str]) -> None:
    """Make this process's environment ``environ`` (the caller's, sent with the rank's arguments),
    as a new interpreter would see it. Ray's native config reads the environment once, when Ray is
    imported, and the fork server imported Ray with its own: without a refresh, a process forked
    after the caller enabled Ray's token authentication (``RAY_AUTH_MODE=token``) would join a
    cluster without its token and be refused."""
    os.environ.clear()
    os.environ.update(environ)
    raylet = sys.modules.get("ray._raylet")
    if raylet is not None:
        raylet.Config.initialize("")


def run_as_interpreter(main: Callable[[], object]) -> NoReturn:
    """Run ``main`` as the whole life of a forked process that stands in for a new interpreter, and
    end as one ends: the status ``main`` returns (an int; anything else is 0) or raises with
    ``SystemExit`` (a message printed), a traceback for an uncaught exception, exit handlers run and
    streams flushed. It never returns into the code that forked."""
    code = 1
    try:
        result = main()
        code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _entry(rank: int, world_size: int, port: int, out_dir: str, threads: int, fn: Callable[..., Any],
           args: tuple[Any, ...], environ: dict[str, str]) -> None:
    adopt_environment(environ)
    freeze_at_exit()
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    init_local_group(rank, world_size, port)
    path = Path(out_dir) / f"rank{rank}.pt"
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        os._exit(1)  # peers may be blocked in a collective; do not wait for them
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1,
                    timeout: float = 600.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes (gloo) and return
    the results in rank order.

    ``fn`` must be importable by name (a module-level function); its result must be picklable.
    Raises ``RuntimeError`` naming the failing rank(s) with their tracebacks.
    """
    import torch
    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="nrl-dist-") as out_dir:
        rank_context()  # the fork server's preload
        context = mp.start_processes(_entry, args=(world_size, port, out_dir, threads, fn, args, dict(os.environ)),
                                     nprocs=world_size, join=False, start_method="forkserver")
        failed: list[str] = []
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    failed.append(f"timed out after {timeout:.0f}s")
                    break
        except Exception as exc:  # a rank exited non-zero; collect every rank's report below
            failed.append(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        results = []
        errors = []
        for rank in range(world_size):
            path = Path(out_dir) / f"rank{rank}.pt"
            if not path.exists():
                errors.append(f"rank {rank}: no result (killed or blocked)")
                continue
            report = torch.load(path, weights_only=False)
            if report["ok"]:
                results.append(report["result"])
            else:
                errors.append(f"rank {rank}:\n{report['error']}")
        if errors or failed:
            for proc in context.processes:
                if proc.is_alive():
                    proc.kill()
            raise RuntimeError("distributed run failed\n" + "\n".join(errors or failed))
        return results


def gather_shards(result: Any, batch: Any) -> Any:
    """The whole ``[B, T]`` tensor behind a worker's per-shard result (``BatchShard`` or ``None``
    on each rank), as the driver's ``Policy`` puts it together: every rank's shard is gathered from
    the process group (when there is one) and assembled, so tests compare whole results."""
    import torch.distributed as dist

    from nrl_core.contracts import BatchShard

    shards = [result]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        shards = [None] * dist.get_world_size()
        dist.all_gather_object(shards, result)
    return BatchShard.assemble(shards, batch.size, int(batch.input_ids.shape[1]))
