#!/usr/bin/env bash
# Install bmtwrap with its test requirements (scripts/install.sh test) and run the test suite (testpaths
# in pyproject.toml). Arguments go to pytest, e.g. `bash scripts/test.sh -k parity`.
# Exits non-zero when a test fails, and also when no test was collected.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHON
bash scripts/install.sh test

# The multi-process tests start their workers with OMP_NUM_THREADS=1 themselves; the pytest process keeps
# torch's default (one thread per core) unless the caller sets it. The 20 slowest tests are listed at the end,
# to keep the suite's time in view.
status=0
"$PYTHON" -m pytest -q --durations=20 "$@" || status=$?
if ((status == 5)); then
    echo "test.sh: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit "$status"
