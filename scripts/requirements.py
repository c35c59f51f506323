"""What scripts/install.sh installs, read from the package's own metadata (standard library only).

    python scripts/requirements.py --out DIR [EXTRA ...]   writes DIR/requirements.txt and DIR/constraints.txt
    python scripts/requirements.py --stamp                 prints what the compiled extension depends on

requirements.txt: the build requirements, ``[project] dependencies`` and the extras named, from
pyproject.toml. constraints.txt: for every package constraints.txt pins, the version installed here
if there is one (so nothing installed is ever replaced), else the pin.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as metadata
import os
import re
import sys
import sysconfig
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent

try:
    import tomllib
except ImportError:  # Python 3.10: pip carries a TOML reader
    from pip._vendor import tomli as tomllib


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def requirements(extras: List[str]) -> List[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    known = project["project"].get("optional-dependencies", {})
    unknown = [e for e in extras if e not in known]
    if unknown:
        raise SystemExit(f"requirements.py: no extra {unknown} in pyproject.toml; the extras are {sorted(known)}")
    # Editable builds need setuptools >= 70.1 (older ones also need `wheel`).
    build = ["setuptools>=70.1" if _name(r) == "setuptools" else r for r in project["build-system"]["requires"]]
    wanted = build + project["project"]["dependencies"] + [r for e in extras for r in known[e]]
    return list(dict.fromkeys(wanted))


def constraints() -> List[str]:
    lines = []
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        pin = line.split("#", 1)[0].strip()
        if not pin:
            continue
        try:
            lines.append(f"{_name(pin)}=={metadata.version(_name(pin))}")
        except metadata.PackageNotFoundError:
            lines.append(pin)
    return lines


def stamp() -> str:
    """A digest of everything the compiled extension depends on: sources, build script, interpreter."""
    digest = hashlib.sha256()
    sources = sorted(p for p in (ROOT / "csrc").rglob("*") if p.is_file())
    for path in [ROOT / "setup.py", ROOT / "pyproject.toml", *sources]:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    environment: Dict[str, str] = {k: v for k, v in sorted(os.environ.items())
                                   if k.startswith("BMTWRAP_") or k in ("CUDA_HOME", "CUDA_PATH")}
    digest.update(repr((sys.executable, sys.version, sysconfig.get_platform(), environment)).encode())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder to write requirements.txt and constraints.txt into")
    parser.add_argument("--stamp", action="store_true", help="print the extension's build stamp and exit")
    parser.add_argument("extras", nargs="*", help="extras of pyproject.toml to include")
    args = parser.parse_args()
    if args.stamp:
        print(stamp())
        return
    if args.out is None:
        parser.error("give --out DIR or --stamp")
    (args.out / "requirements.txt").write_text("\n".join(requirements(args.extras)) + "\n")
    (args.out / "constraints.txt").write_text("\n".join(constraints()) + "\n")


if __name__ == "__main__":
    main()
