"""requirements/cpu.txt is the pinned stack and must also work as a pip constraints file
(``pip install -c requirements/cpu.txt ...``), which refuses extras and anything but pins."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.requirements import Requirement

PINS = Path(__file__).resolve().parents[2] / "requirements" / "cpu.txt"


def test_the_pinned_stack_is_a_valid_constraints_file():
    lines = [line.split("#")[0].strip() for line in PINS.read_text().splitlines()]
    requirements = [Requirement(line) for line in lines if line]
    assert requirements
    for req in requirements:
        assert not req.extras, f"{req}: a constraints file cannot carry extras"
        assert re.fullmatch(r"==[^,]+", str(req.specifier)), f"{req}: pin an exact version"
