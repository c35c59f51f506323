#!/usr/bin/env bash
# The main job on a fresh machine: install bmtwrap and what it needs (scripts/install.sh), then fine-tune a
# Hugging Face causal LM with examples/finetune_hf.py. With no arguments it runs the example's embedded
# default (a small Llama on the bundled text, one process per GPU, or 2 CPU processes over gloo).
# Arguments go to the example, e.g. `bash scripts/finetune.sh --model path/to/hf-folder --data my.txt`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHON
bash scripts/install.sh examples
"$PYTHON" examples/finetune_hf.py "$@"
