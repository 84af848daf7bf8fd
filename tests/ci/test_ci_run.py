"""``.ci/run`` itself, on a one-test selection: it prints pytest's wall time, and fails in one line
naming the slowest tests when that time passes the alarm (lowered here from 75 minutes to 1 s)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = "tests/ci/slow_sample.py"


def ci_run(alarm_s: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NRL_SUITE_ALARM_S": alarm_s}
    return subprocess.run([str(ROOT / ".ci" / "run"), SAMPLE], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)


def test_the_alarm_fires_in_one_line_naming_the_slowest_tests():
    proc = ci_run("1")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout
    assert re.search(r"^CI: pytest took \d+\.\d min for 1 tests \(budget 30 min, alarm 0\.0166667 min\)$",
                     proc.stdout, re.MULTILINE), proc.stdout[-2000:]
    alarm = [line for line in proc.stderr.splitlines() if line.startswith("CI: the suite took")]
    assert len(alarm) == 1, proc.stderr[-2000:]
    assert re.fullmatch(r"CI: the suite took \d+\.\d min, over its 0\.0166667-minute alarm; the 1 slowest: "
                        r"tests\.ci\.slow_sample::test_takes_a_little_over_a_second \(1 s\)", alarm[0]), alarm[0]


def test_under_the_alarm_the_run_passes_and_says_its_time():
    proc = ci_run("600")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"^CI: pytest took \d+\.\d min for 1 tests \(budget 30 min, alarm 10 min\)$", proc.stdout,
                     re.MULTILINE), proc.stdout[-2000:]
    assert "CI: the suite took" not in proc.stderr
