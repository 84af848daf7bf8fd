"""``nrl config check`` over every NeMo RL config of a checkout: how many pass, and each refusal.

    python scripts/nemo_rl_sweep.py PATH/TO/NeMo-RL [--show-passing] [--twins write|train [--start M] [--limit N]]

Reads ``examples/configs/*.yaml`` and ``examples/configs/recipes/llm/**/*.yaml`` (the sweep
docs/configuration.md reports), checks each in this process from the checkout's root (so the
recipes' relative prompt files resolve as they do for NeMo RL), and prints the count and one line
per refusal, grouped by the refusal with the configs it stopped. Nothing is loaded or started.

``--twins write`` then writes the CPU twin of each passing config (``nrl twin --write-only``, in
this process) and counts those written and those refused, with each refusal's line; ``--twins
train`` trains each written twin for 2 steps (``nrl twin``, a process each, joining the Ray at
``RAY_ADDRESS`` if set) and counts those that finish. ``--start M`` skips the first M passing,
``--limit N`` takes N of them.
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
    parser.add_argument("--twins", choices=("write", "train"), default=None,
                        help="also write (or write and train) the CPU twin of each passing config")
    parser.add_argument("--start", type=int, default=0, help="twins from the M-th passing config on")
    parser.add_argument("--limit", type=int, default=None, help="twins of N passing configs only")
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
    if args.twins:
        chosen = passing[args.start:][:args.limit]
        twins(checkout, chosen, train=args.twins == "train")
    return 0


def twins(checkout: Path, names: list[str], *, train: bool) -> None:
    """Write (and with ``train`` run) the twin of each of ``names``; print the counts and each failure."""
    import subprocess
    import tempfile
    import time

    from nrl_core.errors import NrlError
    from nrl_core.plugins import get_plugin_manager
    from nrl_core.twin import write_twin

    outcomes: dict[str, list[str]] = defaultdict(list)
    root = Path(tempfile.mkdtemp(prefix="nrl-twins-"))
    for index, name in enumerate(names):
        recipe = checkout / "examples" / "configs" / name
        out = root / f"{index:03d}"
        try:
            write_twin(recipe, out, get_plugin_manager())
        except NrlError as error:
            outcomes[f"refused: {str(error).splitlines()[0]}"].append(name)
            continue
        if not train:
            outcomes["written"].append(name)
            continue
        start = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, "-m", "nrl_core.cli", "twin", str(recipe), "--out", str(out)],
                                  capture_output=True, text=True, timeout=900, cwd=checkout)
            code, stderr = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired:
            code, stderr = -1, "error: timed out after 900 s"
        if code == 0:
            outcome = "trained 2 steps"
        else:
            lines = [line for line in stderr.splitlines() if line.startswith("error:")] or stderr.splitlines()[-1:]
            outcome = f"failed (exit {code}): {lines[0] if lines else ''}"[:300]
        outcomes[outcome].append(name)
        print(f"[{index + 1}/{len(names)}] {name} ({time.monotonic() - start:.0f} s): {outcome}", file=sys.stderr,
              flush=True)  # as it goes: a sweep stopped early still counts
    print(f"\ntwins of {len(names)} passing configs:")
    for outcome, which in sorted(outcomes.items(), key=lambda item: -len(item[1])):
        print(f"\n{len(which)}x {outcome}")
        for name in which:
            print(f"    {name}")


if __name__ == "__main__":
    sys.exit(main())
