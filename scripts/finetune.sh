#!/usr/bin/env bash
# The main job on a fresh machine: install bmtwrap and what it needs (scripts/install.sh), then fine-tune a
# Hugging Face causal LM with examples/finetune_hf.py. With no arguments it runs the example's embedded
# default (a small Llama on the bundled text, one process per GPU, or 2 CPU processes over gloo).
# Arguments go to the example, e.g. `bash scripts/finetune.sh --model path/to/hf-folder --data my.txt`.
# Paths in them are relative to the directory you run it from (it does not cd: the example's --out lands
# there too); the checkout is found from this script's own location.
set -euo pipefail
checkout="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHON
bash "$checkout/scripts/install.sh" examples  # a process of its own: its cd stays there
"$PYTHON" "$checkout/examples/finetune_hf.py" "$@"
