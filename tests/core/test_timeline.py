"""Start-up timeline marks: one JSON line per mark, with the process's memory, only when asked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from nrl_core.timeline import ENV, mark, pss_kib


def test_mark_writes_nothing_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    mark("anything")
    assert list(tmp_path.iterdir()) == []


def test_a_process_with_torch_says_what_it_computes_with(tmp_path):
    path = tmp_path / "timeline.jsonl"
    subprocess.run([sys.executable, "-c", "import torch; from nrl_core.timeline import mark; mark('e')"], check=True,
                   env={**os.environ, ENV: str(path), "OMP_NUM_THREADS": "1"})
    line = json.loads(path.read_text())
    assert line["threads"] == 1 and line["cpus"] >= 1


def test_marks_from_two_processes_land_in_one_file_with_their_memory(tmp_path, monkeypatch):
    path = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(ENV, str(path))
    mark("driver_event", step=1)
    subprocess.run([sys.executable, "-c", "from nrl_core.timeline import mark; mark('child_event')"], check=True,
                   env={**os.environ, ENV: str(path)})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["event"] for line in lines] == ["driver_event", "child_event"]
    assert lines[0]["step"] == 1 and lines[0]["pid"] == os.getpid() and lines[1]["pid"] != os.getpid()
    # Proportional set size in MiB: a Python process maps several MiB of its own at least.
    assert all(line["pss_mib"] >= 5 for line in lines)


def test_pss_of_a_process_by_pid_and_of_one_that_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "up\n"  # a running interpreter, not a process still exec-ing
        assert pss_kib(child.pid) > 1024 and pss_kib() > pss_kib(child.pid) // 4
    finally:
        child.kill()
        child.wait()
    assert pss_kib(child.pid) is None
