#!/usr/bin/env bash
# Install what bmtwrap needs into the current Python, then build bmtwrap from this checkout (editable).
#
#   bash scripts/install.sh [EXTRA ...]     e.g.  bash scripts/install.sh examples      (extras: pyproject.toml)
#
# - Requirements come from the package's own metadata (pyproject.toml: dependencies, the extras named, the
#   build requirements), so nothing is listed twice.
# - A package already installed is kept exactly as it is (never upgraded or replaced: an installed torch
#   stays, CUDA build or not); a missing one gets the version constraints.txt pins (torch: the CPU build).
# - The extension is compiled only when its sources, the build script or the Python changed since the last
#   build from this checkout (a stamp under build/), or when it does not import.
# The Python used is $PYTHON, else `python`, else `python3` (a virtual environment's, when one is active).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-$(command -v python || command -v python3 || true)}"
if [[ -z "$PYTHON" ]]; then
    echo "install.sh: no python or python3 on PATH" >&2
    exit 1
fi
echo "install.sh: using $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# requirements.txt: what pyproject.toml asks for; constraints.txt: installed versions, else the pins.
"$PYTHON" scripts/requirements.py --out "$work" "$@"
"$PYTHON" -m pip install -q -c "$work/constraints.txt" -r "$work/requirements.txt"

stamp=build/install.stamp
wanted="$("$PYTHON" scripts/requirements.py --stamp)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$wanted" ]] \
        && "$PYTHON" -c "import bmtwrap._C, os, sys; sys.exit(not bmtwrap.__file__.startswith(os.getcwd()))" 2>/dev/null; then
    echo "install.sh: bmtwrap._C is up to date with csrc/ (no rebuild)"
else
    # --no-deps: the requirements are settled above; pip must not resolve torch again (it could replace it).
    # --no-build-isolation: build against the torch and pybind11 installed here.
    "$PYTHON" -m pip install -q --no-build-isolation --no-deps -e .
    mkdir -p build
    echo "$wanted" > "$stamp"
fi
# e.g. "with compiled kernels: CPU (AVX2), CUDA for sm_80, sm_90 (no GPU visible: the CPU kernels and torch run here)"
"$PYTHON" -c "import bmtwrap; from bmtwrap.ops import _ext; print('install.sh: bmtwrap', bmtwrap.__version__, \
_ext.build_summary())"
