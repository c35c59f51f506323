#!/usr/bin/env bash
# Install what bmtwrap needs into the current Python, then build bmtwrap from this checkout (editable).
#
#   bash scripts/install.sh [REQUIREMENT ...]     e.g.  bash scripts/install.sh pytest transformers safetensors
#
# Only what is missing is installed, so this also works offline where everything is already there:
#   - torch: an importable torch is kept exactly as it is (never upgraded or replaced); otherwise the version
#     pinned in constraints.txt is installed. Every pip call is constrained to that torch, so no dependency
#     can pull in another one.
#   - pybind11 and setuptools (the build needs them; it runs without build isolation, against this torch).
#   - the extra requirements given as arguments.
# Then `pip install --no-build-isolation --no-deps -e .` compiles bmtwrap._C (CUDA kernels too if nvcc exists).
# The Python used is $PYTHON, else `python`, else `python3` (a virtual environment's, when one is active).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-$(command -v python || command -v python3 || true)}"
if [[ -z "$PYTHON" ]]; then
    echo "install.sh: no python or python3 on PATH" >&2
    exit 1
fi
echo "install.sh: using $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

# Which of the requirements are missing? Prints one requirement per line.
missing() {
    "$PYTHON" - "$@" <<'PY'
import importlib.metadata as md
import importlib.util
import re
import sys


def version(dist):
    try:
        return tuple(int(x) for x in re.findall(r"\d+", md.version(dist))[:3])
    except md.PackageNotFoundError:
        return None


for req in sys.argv[1:]:
    name, _, minimum = req.partition(">=")
    have = version(name)
    if name == "setuptools":
        # Editable wheels need setuptools >= 70.1, or an older one (>= 64) together with `wheel`.
        ok = have is not None and (have >= (70, 1) or (have >= (64,) and importlib.util.find_spec("wheel")))
        if not ok:
            print("setuptools>=70.1")
        continue
    wanted = tuple(int(x) for x in minimum.split(".")) if minimum else ()
    if importlib.util.find_spec(name.replace("-", "_")) is None or (have is not None and have < wanted):
        print(req)
PY
}

constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
if "$PYTHON" -c "import torch" 2>/dev/null; then
    installed="$("$PYTHON" -c "import torch; print(torch.__version__)")"
    echo "install.sh: keeping the installed torch $installed"
    echo "torch==$installed" > "$constraints"
    to_install=()
else
    cp constraints.txt "$constraints"
    to_install=(torch)
fi
absent="$(missing "pybind11>=2.12" setuptools "$@")"
if [[ -n "$absent" ]]; then
    mapfile -t -O "${#to_install[@]}" to_install <<< "$absent"
fi

if ((${#to_install[@]})); then
    echo "install.sh: installing ${to_install[*]}"
    "$PYTHON" -m pip install -c "$constraints" "${to_install[@]}"
else
    echo "install.sh: every requirement is installed already"
fi

# --no-deps: the dependencies are settled above; pip must not resolve torch again (it could replace it).
"$PYTHON" -m pip install --no-build-isolation --no-deps -e .
"$PYTHON" -c "from bmtwrap import ops; import bmtwrap; print('install.sh: bmtwrap', bmtwrap.__version__, \
'with compiled kernels' if ops.extension_available() else 'WITHOUT compiled kernels', \
'(CUDA kernels built)' if ops.extension_available(cuda=True) else '')"
