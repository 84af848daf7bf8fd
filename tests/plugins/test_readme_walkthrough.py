"""The README's plugin walkthrough is the example backend's worker file, verbatim, and that file
stays within the size the engine SDK promises (120 non-blank lines in all its files)."""

from __future__ import annotations

import ast
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


def test_the_example_backend_is_small_and_imports_only_the_public_api() -> None:
    """The smallest complete backend (the whole kit passes, it trains GRPO: test_installed_plugins,
    test_example_backend_grpo) is at most 120 non-blank lines in all its files, and reaches nrl
    only through nrl_core.api: no other nrl distribution, no internal module."""
    files = sorted(WORKER.parent.glob("*.py"))
    lines = sum(1 for file in files for line in file.read_text().splitlines() if line.strip())
    assert len(files) == 2 and lines <= 120, (files, lines)
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith("nrl") or name in ("nrl_core.api", "nrl_example_plugin"), (file, name)
