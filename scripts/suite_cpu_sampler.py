"""Where a command's CPU time goes, by kind of process: the suite's Ray workers, test ranks,
launchers, Ray's own daemons.

    python scripts/suite_cpu_sampler.py [--json OUT] -- CI=true bash .ci/run --junitxml=...

Why: the suite is bound by CPU seconds on a 2-core machine, and most of them are spent in
processes pytest's durations do not name. Every process started after this one is read from
``/proc`` every two seconds until the command ends; each keeps the last CPU time seen, so a
process that lives under two seconds may be missed or undercounted (the total busy time of the
machine is printed beside the sum, to show how much).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")
#: (kind, test on the command line or name), first match wins
KINDS = (("pip install", lambda comm, cmd: " pip " in f" {cmd} " or "pip install" in cmd),
         ("Ray log monitor", lambda comm, cmd: "log_monitor" in cmd),
         ("Ray raylet and GCS", lambda comm, cmd: comm in ("raylet", "gcs_server")),
         ("Ray dashboard and agents", lambda comm, cmd: "dashboard" in cmd or comm.startswith(("ray::Dash", "ray::Runtime"))),
         ("Ray idle workers", lambda comm, cmd: comm == "ray::IDLE"),
         ("Ray actors", lambda comm, cmd: comm.startswith("ray::")),
         ("worker launchers (tests/ray_worker_launcher.py)", lambda comm, cmd: "ray_worker_launcher" in cmd),
         ("zygote and its other children", lambda comm, cmd: "zygote.py" in cmd),
         ("fork server children (test ranks, nrl drivers)", lambda comm, cmd: "forkserver" in cmd),
         ("pytest", lambda comm, cmd: "pytest" in cmd or comm.startswith("[pytest")),
         ("nrl drivers started fresh", lambda comm, cmd: "nrl_core.cli" in cmd))


def _busy() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / TICK


def _read(pid: str) -> tuple[tuple[str, str], float, str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    comm = stat.split("(", 1)[1].rsplit(")", 1)[0]
    fields = stat.rsplit(")", 1)[1].split()
    return (pid, fields[19]), (int(fields[11]) + int(fields[12])) / TICK, comm


def sample(command: list[str]) -> dict:
    before = {key for pid in os.listdir("/proc") if pid.isdigit() and (r := _read(pid)) for key in [r[0]]}
    seen: dict[tuple[str, str], list] = {}
    busy, start = _busy(), time.time()
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or (r := _read(pid)) is None or r[0] in before:
                continue
            key, cpu, comm = r
            if key not in seen:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
                except OSError:
                    cmd = ""
                seen[key] = [cpu, comm, cmd]
            else:
                seen[key][:2] = [cpu, comm]
        time.sleep(2)
    return {"returncode": proc.returncode, "busy": _busy() - busy, "wall": time.time() - start,
            "processes": [v for v in seen.values()]}


def by_kind(processes: list[list]) -> list[tuple[str, float, int]]:
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for cpu, comm, cmd in processes:
        kind = next((name for name, test in KINDS if test(comm, cmd)), f"other ({comm})")
        totals[kind][0] += cpu
        totals[kind][1] += 1
    return sorted(((k, v[0], int(v[1])) for k, v in totals.items()), key=lambda row: -row[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write every process's CPU, name and command line here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    result = sample(command)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    print(f"machine busy {result['busy']:.0f} CPU-s over {result['wall']:.0f} s; sampled processes "
          f"{sum(p[0] for p in result['processes']):.0f} CPU-s")
    for kind, cpu, count in by_kind(result["processes"]):
        if cpu >= 1.0:
            print(f"{cpu:8.1f} CPU-s  {count:5d} processes  {kind}")
    return int(result["returncode"])


if __name__ == "__main__":
    sys.exit(main())
