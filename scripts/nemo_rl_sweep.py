"""``nrl config check`` over every NeMo RL config of a checkout: how many pass, and each refusal.

    python scripts/nemo_rl_sweep.py PATH/TO/NeMo-RL [--show-passing]

Reads ``examples/configs/*.yaml`` and ``examples/configs/recipes/llm/**/*.yaml`` (the sweep
docs/configuration.md reports), checks each in this process from the checkout's root (so the
recipes' relative prompt files resolve as they do for NeMo RL), and prints the count and one line
per refusal, grouped by the refusal with the configs it stopped. Nothing is loaded or started.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
from collections import defaultdict
from pathlib import Path


def configs(checkout: Path) -> list[Path]:
    root = checkout / "examples" / "configs"
    return sorted(root.glob("*.yaml")) + sorted((root / "recipes" / "llm").rglob("*.yaml"))


def check(path: Path) -> tuple[bool, str]:
    """Whether ``path`` passes ``nrl config check``, and its error line when it does not."""
    from nrl_core.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["config", "check", str(path)])
    errors = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
    return code == 0, errors[0] if errors else f"exit {code} without an error line"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a NeMo RL checkout")
    parser.add_argument("--show-passing", action="store_true", help="also list the configs that pass")
    args = parser.parse_args()
    checkout = args.checkout.resolve()
    paths = configs(checkout)
    if not paths:
        print(f"{checkout}: no examples/configs/*.yaml here; give a NeMo RL checkout", file=sys.stderr)
        return 2
    logging.disable(logging.WARNING)  # the inert-keys warning of every config would drown the counts
    os.chdir(checkout)
    refusals: dict[str, list[str]] = defaultdict(list)
    passing = []
    for path in paths:
        ok, line = check(path)
        name = str(path.relative_to(checkout / "examples" / "configs"))
        if ok:
            passing.append(name)
        else:
            refusals[line].append(name)
    print(f"{len(passing)} of {len(paths)} pass nrl config check; {len(paths) - len(passing)} are refused")
    for line, names in sorted(refusals.items(), key=lambda item: (-len(item[1]), item[0])):
        print(f"\n{len(names)}x {line}")
        for name in names:
            print(f"    {name}")
    if args.show_passing:
        print("\npassing:")
        for name in passing:
            print(f"    {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
