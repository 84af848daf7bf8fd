"""Where a GRPO run's start-up time and memory go: a timeline to the first step and the process tree's memory.

Runs ``nrl train grpo`` in a child process with ``NRL_TIMELINE`` set (see :mod:`nrl_core.timeline`:
the driver and every Ray actor append their marks to one file), timestamps vLLM's own start-up log
lines as they arrive, and samples the proportional set size (PSS, so shared pages are counted once
over the tree) of every process under the child every ``--interval`` seconds. Prints the timeline
(seconds since the command started; each mark with its process's PSS at that moment,
``pss_mib``), each process's peak PSS, the tree's peak and who held it at that moment, and one
JSON line.

By default it runs the issue-18 bench work: ``nrl tiny-model --size bench`` (25.7M parameters),
8 prompts x 4 generations, up to 64 new tokens, DTensor, colocated vLLM, one worker, one step,
with ``policy.generation.vllm_cfg.kv_cache_space_gb`` left unset (``--kv-gb`` sets it)::

    nice -n 19 python benchmarks/startup_profile.py [--steps 1] [--kv-gb 1.0] [-- extra.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from nrl_core.timeline import pss_kib

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = ROOT / "examples" / "configs" / "grpo_tiny_cpu.yaml"

# vLLM's own start-up lines (its parts of the engine build), as (label, pattern).
VLLM_LINES = (
    ("vllm: weights loaded", re.compile(r"Loading weights took ([\d.]+) seconds")),
    ("vllm: model loaded", re.compile(r"Model loading took ([\d.]+) GiB.*?([\d.]+) seconds")),
    ("vllm: torch.compile", re.compile(r"torch\.compile takes ([\d.]+) s in total")),
    ("vllm: KV cache sized", re.compile(r"(?:CPU KV cache size|GPU KV cache size): ([\d,]+) tokens")),
    ("vllm: profile + KV cache + warm-up", re.compile(r"init engine \(profile, create kv cache, warmup model\) "
                                                      r"took ([\d.]+) seconds")),
)


def bench_overrides(model: str, steps: int, kv_gb: float | None) -> list[str]:
    vllm = "policy.generation.vllm_cfg"
    overrides = [
        f"policy.model_name={model}", "grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=4",
        f"grpo.max_num_steps={steps}", "grpo.val_at_start=false", "grpo.val_at_end=false", "grpo.val_period=0",
        "policy.train_global_batch_size=32", "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8",
        "policy.max_total_sequence_length=128", "policy.generation.max_new_tokens=64", f"{vllm}.max_model_len=128",
        "loss_fn.reference_policy_kl_penalty=0.01", "checkpointing.enabled=false", "logger.tensorboard_enabled=false",
        f"logger.log_dir={tempfile.mkdtemp(prefix='nrl-startup-logs-')}",
    ]
    if kv_gb is not None:
        overrides.append(f"{vllm}.kv_cache_space_gb={kv_gb}")
    return overrides


# ---------------------------------------------------------------------------------------- processes

def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def process_tree(root: int) -> list[int]:
    children = _children_map()
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def role(pid: int, root: int, cmd: str, actors: dict[int, str]) -> str:
    if pid == root:
        return "driver (nrl train)"
    if pid in actors:
        return actors[pid]
    for needle, name in (("gcs_server", "Ray GCS"), ("raylet", "raylet"), ("dashboard/agent.py", "Ray dashboard agent"),
                         ("runtime_env/agent", "Ray runtime-env agent"), ("dashboard.py", "Ray dashboard"),
                         ("log_monitor", "Ray log monitor"), ("monitor.py", "Ray monitor"),
                         ("ray::IDLE", "Ray idle worker"), ("default_worker.py", "Ray worker (starting)")):
        if needle in cmd:
            return name
    if cmd.startswith("ray::"):
        return f"actor {cmd.split()[0][5:]}"
    return " ".join(cmd.split())[:60] or f"pid {pid}"


class MemorySampler(threading.Thread):
    """PSS of every process under ``root`` every ``interval`` seconds, until stopped."""

    def __init__(self, root: int, interval: float, actors: dict[int, str]) -> None:
        super().__init__(daemon=True)
        self.root, self.interval, self.actors = root, interval, actors
        self.stop = threading.Event()
        self.peak_total = 0
        self.peak_at = 0.0
        self.at_peak: dict[int, int] = {}
        self.peak_by_pid: dict[int, int] = {}
        self.cmds: dict[int, str] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            sample = {}
            for pid in process_tree(self.root):
                kib = pss_kib(pid)
                if kib is None:
                    continue
                sample[pid] = kib
                self.cmds.setdefault(pid, cmdline(pid))
                if cmdline(pid) != self.cmds[pid]:  # Ray renames a worker when it becomes an actor
                    self.cmds[pid] = cmdline(pid)
                self.peak_by_pid[pid] = max(self.peak_by_pid.get(pid, 0), kib)
            total = sum(sample.values())
            if total > self.peak_total:
                self.peak_total, self.peak_at, self.at_peak = total, time.time(), sample
            self.stop.wait(self.interval)

    def label(self, pid: int) -> str:
        return role(pid, self.root, self.cmds.get(pid, ""), self.actors)


# ---------------------------------------------------------------------------------------- the run

def profile(cmd: list[str], interval: float) -> dict[str, Any]:
    fd, timeline_path = tempfile.mkstemp(prefix="nrl-timeline-", suffix=".jsonl")
    os.close(fd)
    env = dict(os.environ, NRL_TIMELINE=timeline_path, PYTHONUNBUFFERED="1")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, bufsize=1)
    actors: dict[int, str] = {}
    sampler = MemorySampler(proc.pid, interval, actors)
    sampler.start()
    lines: list[tuple[float, str]] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append((time.time(), line.rstrip()))
        _learn_actors(timeline_path, actors)
    rc = proc.wait()
    end = time.time()
    sampler.stop.set()
    sampler.join()
    marks = [json.loads(line) for line in Path(timeline_path).read_text().splitlines() if line.strip()]
    os.unlink(timeline_path)
    _learn_actors_from(marks, actors)
    events = [(m["t"] - t0, m["event"] + _detail(m), m["pid"]) for m in marks]
    for arrived, text in lines:
        for label, pattern in VLLM_LINES:
            found = pattern.search(text)
            if found:
                events.append((arrived - t0, f"{label} ({', '.join(found.groups())})", -1))
    events.sort()
    first_step = next((t for t, e, _ in events if e.startswith("step_end")), None)
    return {"rc": rc, "wall_s": end - t0, "first_step_s": first_step, "events": events, "sampler": sampler,
            "peak_mib": sampler.peak_total / 1024, "peak_at_s": sampler.peak_at - t0, "output": lines}


def _detail(mark: dict[str, Any]) -> str:
    extra = {k: v for k, v in mark.items() if k not in ("t", "pid", "event")}
    if "worker" in extra:
        extra["worker"] = str(extra["worker"]).rsplit(".", 1)[-1].rsplit(":", 1)[-1]
    return f" [{', '.join(f'{k}={v}' for k, v in extra.items())}]" if extra else ""


def _learn_actors(path: str, actors: dict[int, str]) -> None:
    try:
        text = Path(path).read_text()
    except OSError:
        return
    _learn_actors_from([json.loads(line) for line in text.splitlines() if line.strip()], actors)


def _learn_actors_from(marks: list[dict[str, Any]], actors: dict[int, str]) -> None:
    for m in marks:
        if m["event"] == "actor_start":
            actors[m["pid"]] = f"actor {m['group']} rank {m['rank']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(BASE_CONFIG))
    parser.add_argument("--size", default="bench", help="nrl tiny-model size of the model")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--kv-gb", type=float, default=None, help="set vllm_cfg.kv_cache_space_gb (default: unset)")
    parser.add_argument("--interval", type=float, default=0.2, help="memory sampling period, seconds")
    parser.add_argument("--show-output", action="store_true", help="print the run's own output too")
    parser.add_argument("overrides", nargs="*", help="more key.path=value overrides (after --)")
    args = parser.parse_args()
    from nrl_core.testing.tiny_models import cached_tiny_model

    model = str(cached_tiny_model("llama", args.size))
    cmd = [sys.executable, "-m", "nrl_core.cli", "train", "grpo", "--config", args.config,
           *bench_overrides(model, args.steps, args.kv_gb), *args.overrides]
    result = profile(cmd, args.interval)
    if args.show_output or result["rc"]:
        print("\n".join(text for _, text in result["output"]))
    print(f"$ {' '.join(cmd[1:])}\n")
    print(f"{'t (s)':>7} {'+dt':>6}  event")
    previous = 0.0
    for t, event, pid in result["events"]:
        print(f"{t:7.2f} {t - previous:6.2f}  {event}" + (f"  (pid {pid})" if pid > 0 else ""))
        previous = t
    sampler: MemorySampler = result["sampler"]
    print(f"\nprocess tree peak PSS {result['peak_mib']:.0f} MiB at {result['peak_at_s']:.1f} s; by process "
          "(at the tree's peak / own peak, MiB):")
    rows = sorted(sampler.peak_by_pid, key=lambda p: -sampler.peak_by_pid[p])
    for pid in rows:
        print(f"  {sampler.at_peak.get(pid, 0) / 1024:7.0f} {sampler.peak_by_pid[pid] / 1024:7.0f}  "
              f"{sampler.label(pid)} (pid {pid})")
    print(json.dumps({"rc": result["rc"], "first_step_s": result["first_step_s"], "wall_s": round(result["wall_s"], 2),
                      "peak_pss_mib": round(result["peak_mib"]), "processes": len(rows)}))
    sys.exit(result["rc"])


if __name__ == "__main__":
    main()
