#!/usr/bin/env bash
# Set up this checkout and train the demo GPT (examples/train_gpt.py) on 2 processes:
# one per GPU (up to 2) when CUDA GPUs are visible, else 2 CPU processes over gloo.
# Arguments are passed to the example, e.g. `bash scripts/demo.sh --steps 50 --layers 8`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHON
bash scripts/install.sh

nproc="$("$PYTHON" -c "import torch; print(min(2, torch.cuda.device_count()) or 2)")"
# One thread per process unless told otherwise (what torchrun would pick, without its warning).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
echo "demo.sh: $nproc processes"
"$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$nproc" examples/train_gpt.py "$@"
