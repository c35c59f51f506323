#!/usr/bin/env bash
# On a machine with one CUDA GPU and torch installed: build the extension for sm_90, then
#   bench   the plan's GPU-memory estimate beside the measured peak (benchmarks/train_llama.py):
#           1b without offload, 3b and 8b with the optimizer offloaded (in backward);
#   example examples/finetune_hf.py on a 1b-shaped Llama, with and without the offload optimizer.
# Usage: bash scripts/gpu_memory_check.sh [bench|example|all]. Logs go to $OUT (default ./gpu-logs);
# a table prints last.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-logs}
what=${1:-all}
mkdir -p "$OUT"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'gpus', torch.cuda.device_count(), torch.cuda.get_device_name())"

if ! python3 -c "import bmtwrap._C" 2>/dev/null; then
    start=$(date +%s)
    BMTWRAP_CUDA_ARCH=${BMTWRAP_CUDA_ARCH:-90} python3 -m pip install -q --no-build-isolation --no-deps -e . \
        > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
    echo "build: $(( $(date +%s) - start )) s"
fi

bench() {  # name, timeout, train_llama arguments...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" python3 benchmarks/train_llama.py "$@" > "$OUT/$name.log" 2>&1
    echo "$name (exit $?): $(grep '^RESULT' "$OUT/$name.log" || tail -3 "$OUT/$name.log")"
}

example() {  # name, timeout, finetune_hf arguments...
    local name=$1 limit=$2
    shift 2
    local out=${TMPDIR:-/tmp}/bmtwrap-$name  # checkpoints and exports stay out of $OUT
    timeout "$limit" python3 examples/finetune_hf.py --out "$out" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    cp "$out/summary.json" "$OUT/$name.summary.json" 2>/dev/null
    rm -rf "$out"
    echo "$name (exit $rc): $(tr '\r' '\n' < "$OUT/$name.log" | grep -E 'perplexity after|throughput|reloaded|Error' | tr '\n' ' ')"
}

if [[ $what == bench || $what == all ]]; then
    bench 1b_adam 150 --size 1b --batch 8 --seq 2048 --steps 3 --warmup 2
    bench 3b_offload 200 --size 3b --batch 4 --seq 2048 --steps 3 --warmup 2 --optimizer offload-in-backward
    bench 8b_offload 280 --size 8b --batch 4 --seq 2048 --steps 2 --warmup 2 --optimizer offload-in-backward
fi
if [[ $what == example || $what == all ]]; then
    common=(--shape 1b --seq 2048 --batch 4 --steps 16 --warmup 4 --lr 3e-4 --save-every 0 --eval-batches 1)
    example ft_1b_adam 240 "${common[@]}"
    example ft_1b_offload 240 "${common[@]}" --optimizer offload
fi
