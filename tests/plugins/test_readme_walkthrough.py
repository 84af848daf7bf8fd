"""The README's plugin walkthrough is the example backend's worker file, verbatim, and that file
stays within the size the SDK promises (150 non-blank lines)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "plugins" / "dists" / "nrl_example_plugin" / "nrl_example_plugin" / "worker.py"


def test_the_readme_shows_the_example_worker_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<summary><code>nrl_example_plugin/worker.py</code></summary>\n\n```python\n(.*?)```", readme,
                      re.DOTALL)
    assert block is not None, "README.md lost the example worker's walkthrough block"
    assert block.group(1) == WORKER.read_text()


def test_the_example_backend_is_small() -> None:
    lines = [line for line in WORKER.read_text().splitlines() if line.strip()]
    assert len(lines) <= 150, len(lines)
