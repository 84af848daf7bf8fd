"""Rewrite a wheel without members the GPU check never loads, so that it fits the small folder of
wheels carried to a bare GPU machine: Ray's wheel is mostly its Java worker (``ray/jars``) and the
dashboard's browser bundle, neither used by Python workers on a local Ray.

    python benchmarks/gpu/slim_wheel.py WHEEL OUT_DIR [PREFIX ...]   # default prefixes: Ray's
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

RAY_UNUSED = ("ray/jars/", "ray/dashboard/client/build/")


def slim(wheel: Path, out_dir: Path, prefixes: tuple[str, ...] = RAY_UNUSED) -> Path:
    """Copy ``wheel`` into ``out_dir`` (same file name) without the members under ``prefixes``;
    the wheel's RECORD drops their lines too, so pip installs it without complaint."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(prefixes):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(line for line in lines if not line.startswith(prefixes)) + "\n").encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    return target


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    extra = tuple(sys.argv[3:]) or RAY_UNUSED
    print(slim(Path(sys.argv[1]), Path(sys.argv[2]), extra))
