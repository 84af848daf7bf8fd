"""SIGKILL trials: kill ``nrl train sft`` (its whole process tree) while it saves a checkpoint, then check
what the kill left behind and that a restart resumes to the same result as a run never killed.

Each trial starts ``nrl train sft`` (tiny Llama, ``checkpointing.save_period=1``, ``load_rng``) in a new
session, waits until the save of a random step ``k`` is under way (its ``.tmp_step_k`` exists), sleeps a
random fraction of a save more and sends SIGKILL to the session's process group. It then checks:

* every published ``step_N`` has its completion marker and verifies against the checksums recorded
  at save (``CheckpointManager.verify``): no half-written checkpoint is visible as complete;
* a restart with the same command exits 0, resumes from the latest complete checkpoint (its log line
  names it) and reaches ``sft.max_num_steps``;
* the restarted run's ``metrics.jsonl`` (each step once) equals an uninterrupted reference run's bit
  for bit (loss, grad norm, token counts).

A trial holds when every check passes and is lost otherwise. Processes of the killed run that are not
in its process group (Ray's worker processes have their own) and still alive ``LEFT_GRACE_S`` after
the kill are reported as ``left`` and killed before the restart.

The driver runs training only as subprocesses; it imports nrl for ``CheckpointManager`` alone, the
API a user would check a checkpoint directory with::

    python benchmarks/reliability_trials.py --trials 10 --modes dtensor-sync,dtensor-async
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "configs" / "sft_tiny_cpu.yaml"
COMPARED = ("train/loss", "train/grad_norm", "train/num_valid_tokens", "train/num_tokens")
LEFT_GRACE_S = 10.0  # how long processes outside the killed process group get to exit by themselves
_RESUMED = re.compile(r"resuming from (\S+) \(step (\d+)\)")


@dataclass(frozen=True)
class Mode:
    """A backend and how it saves: ``dtensor-sync``, ``dtensor-async``, ``megatron-sync``, ``megatron-async``."""

    backend: str
    async_save: bool

    @classmethod
    def parse(cls, name: str) -> Mode:
        backend, _, how = name.partition("-")
        if backend not in ("dtensor", "megatron") or how not in ("sync", "async"):
            raise SystemExit(f"unknown mode {name!r}: use <dtensor|megatron>-<sync|async>")
        return cls(backend, how == "async")

    @property
    def name(self) -> str:
        return f"{self.backend}-{'async' if self.async_save else 'sync'}"

    def overrides(self) -> list[str]:
        if self.backend == "dtensor":
            return [f"policy.dtensor_config.async_save={str(self.async_save).lower()}",
                    "policy.dtensor_config.load_rng=true"]
        return ["policy.dtensor_config.enabled=false", "policy.megatron_cfg.enabled=true", "policy.optimizer=null",
                "policy.megatron_cfg.optimizer.lr=3e-3",
                f"policy.megatron_cfg.async_save={str(self.async_save).lower()}", "policy.megatron_cfg.load_rng=true"]


@dataclass
class Trial:
    mode: str
    seed: int
    kill_step: int
    delay_s: float
    held: bool = False
    resumed_from: int | None = None
    left: list[str] = field(default_factory=list)  # processes alive after the kill: "pid name"
    problems: list[str] = field(default_factory=list)


def train_command(model: Path, out: Path, mode: Mode, steps: int) -> list[str]:
    return [sys.executable, "-m", "nrl_core.cli", "train", "sft", "--config", str(CONFIG),
            f"policy.model_name={model}", f"checkpointing.checkpoint_dir={out}", f"logger.log_dir={out}/logs",
            "logger.plot=false", f"sft.max_num_steps={steps}", "checkpointing.save_period=1",
            "checkpointing.keep_top_k=null", "checkpointing.export_hf=false", "sft.val_period=0",
            "policy.train_global_batch_size=8", "policy.train_micro_batch_size=8", *mode.overrides()]


def _env() -> dict[str, str]:
    return {**os.environ, "NRL_STRICT_PLUGINS": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_to_end(cmd: list[str], log: Path, timeout: float = 900) -> tuple[int, str]:
    """Run ``cmd`` to its end (stderr into ``log``); its exit code and stderr."""
    with open(log, "w") as err:
        code = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=err, env=_env(), cwd=log.parent,
                              timeout=timeout).returncode
    return code, log.read_text()


def metric_rows(out: Path) -> list[dict]:
    path = out / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def compared(rows: list[dict]) -> list[tuple]:
    return [(row["step"], *(row.get(key) for key in COMPARED)) for row in rows]


def reference(work: Path, model: Path, mode: Mode, steps: int) -> list[tuple]:
    """The metrics of an uninterrupted run (what every resumed trial must reproduce)."""
    out = work / f"{mode.name}-reference"
    out.mkdir(parents=True, exist_ok=True)
    code, err = run_to_end(train_command(model, out, mode, steps), out / "stderr.txt")
    if code != 0:
        raise SystemExit(f"the reference run of {mode.name} failed (exit {code}):\n{err[-3000:]}")
    return compared(metric_rows(out))


def descendants(root: int) -> list[int]:
    """Every live descendant of ``root``, read from /proc (children first found, then theirs)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, ppid in parents.items() if ppid in frontier]
        found += children
        frontier = children
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def kill_during_save(cmd: list[str], out: Path, kill_step: int, delay_s: float,
                     timeout: float = 900) -> tuple[bool, list[str]]:
    """Start ``cmd`` in a new session, SIGKILL its process group ``delay_s`` after the save of step
    ``kill_step`` began. Returns (whether the kill came before the run ended, processes left alive)."""
    with open(out / "killed.stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=_env(), cwd=out,
                                start_new_session=True)
    saving = (out / f".tmp_step_{kill_step}", out / f"step_{kill_step}")
    deadline = time.monotonic() + timeout
    while not any(p.exists() for p in saving) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(delay_s)
    tree = descendants(proc.pid)
    in_time = proc.poll() is None
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    killed_at = time.monotonic()
    while [pid for pid in tree if alive(pid)] and time.monotonic() - killed_at < LEFT_GRACE_S:
        time.sleep(0.1)
    left = [pid for pid in tree if alive(pid)]
    names = [f"{pid} {process_name(pid)}" for pid in left]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return in_time, names


@dataclass
class Killed:
    """What :func:`kill_mid_run` saw: the process it killed, the run's exit code and stderr, seconds
    from the kill to the run's exit, and the run's processes still alive a second after."""

    victim: int
    returncode: int
    stderr: str
    exited_after_s: float
    left: list[int]


def kill_mid_run(cmd: list[str], cwd: Path, victim: Callable[[list[str]], int | None],
                 timeout: float = 300) -> Killed:
    """Start ``cmd``; once ``victim(stderr lines so far)`` names a pid, SIGKILL that one process and
    wait for the run to end by itself (its process group is killed if it has not within ``timeout``)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            start_new_session=True, env=_env())
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + timeout
        while (pid := victim(list(lines))) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run ended or stalled before the kill:\n{''.join(lines)[-3000:]}")
            time.sleep(0.2)
        tree = descendants(proc.pid)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=timeout)
        exited_after = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    time.sleep(1.0)  # the stderr reader finishes; stragglers of the run would still be alive
    return Killed(pid, proc.returncode, "".join(lines), exited_after, [p for p in tree if alive(p)])


def check_published(out: Path) -> tuple[int | None, list[str]]:
    """The latest complete checkpoint's step after a kill and what is wrong with the published ones."""
    from nrl_core.checkpoint.checksums import ChecksumError
    from nrl_core.checkpoint.manager import INFO_FILE, CheckpointManager

    problems = []
    for path in sorted(out.glob("step_*")):
        if not (path / INFO_FILE).is_file():
            problems.append(f"{path.name} is published without its {INFO_FILE}")
    manager = CheckpointManager({"enabled": False, "checkpoint_dir": str(out), "save_period": 1})
    for path in manager.checkpoints():
        try:
            manager.verify(path)
        except ChecksumError as exc:
            problems.append(str(exc))
    latest = manager.latest()
    return (int(latest.name.removeprefix("step_")) if latest else None), problems


def trial(work: Path, model: Path, mode: Mode, steps: int, seed: int, expected: list[tuple]) -> Trial:
    """One seeded kill, then the checks and the restart."""
    rng = random.Random(f"{mode.name}:{seed}")
    result = Trial(mode.name, seed, kill_step=rng.randint(1, steps - 1), delay_s=round(rng.uniform(0.0, 0.15), 4))
    out = work / f"{mode.name}-{seed}"
    out.mkdir(parents=True)
    cmd = train_command(model, out, mode, steps)
    in_time, result.left = kill_during_save(cmd, out, result.kill_step, result.delay_s)
    if not in_time:
        result.problems.append("the run ended before the kill")
    latest, problems = check_published(out)
    result.problems += problems
    code, err = run_to_end(cmd, out / "resumed.stderr.txt")
    resumed = _RESUMED.search(err)
    result.resumed_from = int(resumed.group(2)) if resumed else None
    if code != 0:
        result.problems.append(f"the restart exited {code}: {err.strip().splitlines()[-1:]}")
    if result.resumed_from != latest:
        result.problems.append(f"the restart resumed from step {result.resumed_from}, the latest complete is {latest}")
    got = compared(metric_rows(out))
    if got != expected:
        result.problems.append(f"metrics differ from the uninterrupted run: {got} != {expected}")
    result.held = not result.problems
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="dtensor-sync,dtensor-async,megatron-sync,megatron-async")
    parser.add_argument("--trials", type=int, default=10, help="trials per DTensor mode")
    parser.add_argument("--megatron-trials", type=int, default=3, help="trials per Megatron mode (slower)")
    parser.add_argument("--steps", type=int, default=5, help="sft.max_num_steps of each run")
    parser.add_argument("--seed", type=int, default=0, help="first trial seed")
    parser.add_argument("--work", type=Path, default=Path("/tmp/nrl-reliability-trials"))
    args = parser.parse_args(argv)
    from nrl_core.testing.tiny_models import cached_tiny_model

    model = cached_tiny_model("llama")
    args.work.mkdir(parents=True, exist_ok=True)
    run_dir = Path(__import__("tempfile").mkdtemp(dir=args.work, prefix="run_"))
    summary = {}
    for mode in map(Mode.parse, args.modes.split(",")):
        expected = reference(run_dir, model, mode, args.steps)
        count = args.trials if mode.backend == "dtensor" else args.megatron_trials
        trials = []
        for i in range(count):
            trials.append(trial(run_dir, model, mode, args.steps, args.seed + i, expected))
            print(json.dumps(asdict(trials[-1])), flush=True)
        held = sum(t.held for t in trials)
        summary[mode.name] = {"trials": count, "held": held, "lost": count - held, "left": sum(len(t.left) for t in trials)}
        print(f"{mode.name}: trials {count}, held {held}, lost {count - held}, "
              f"processes left after the kill {summary[mode.name]['left']}", flush=True)
    print(json.dumps({"reliability_trials": summary, "steps": args.steps, "seed": args.seed}))
    return 0 if all(s["lost"] == 0 for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
