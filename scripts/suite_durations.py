"""Write tests/durations.json, each test module's seconds, from the JUnit report of a whole-suite run
(``.ci/run`` keeps none; ``scripts/test.sh --junitxml=report.xml`` writes one). The suite hands the
longest groups of tests to pytest-xdist's workers first (tests/conftest.py); a module missing
from the file counts 10 s. Usage: python scripts/suite_durations.py REPORT.xml"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def module_seconds(report: str) -> dict[str, float]:
    seconds: Counter[str] = Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        # classname is the module's dotted path, then any class: keep up to the test_ module
        end = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1)
        seconds["/".join(parts[: end + 1]) + ".py"] += float(case.get("time", 0))
    return {module: round(value, 1) for module, value in sorted(seconds.items())}


if __name__ == "__main__":
    OUT.write_text(json.dumps(module_seconds(sys.argv[1]), indent=1) + "\n")
    print(f"wrote {OUT}")
