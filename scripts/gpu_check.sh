#!/usr/bin/env bash
# On a machine with CUDA GPUs and torch installed: build the extension for sm_90, run the GPU
# tests and the overlap benchmark. Logs go to $OUT (default ./gpu-logs); a summary prints last.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"

start=$(date +%s)
BMTWRAP_CUDA_ARCH=${BMTWRAP_CUDA_ARCH:-90} python3 -m pip install -q --no-build-isolation --no-deps -e . \
    > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"

python3 -m pytest -q -m cuda -s tests/test_ops.py tests/test_cuda_kernels.py tests/test_gpu.py > "$OUT/gpu_tests.log" 2>&1
tests_rc=$?
python3 -m torch.distributed.run --nproc_per_node=2 benchmarks/overlap_trace.py --out "$OUT" "$@" \
    > "$OUT/overlap.log" 2>&1
bench_rc=$?
gzip -f "$OUT/trace_rank0.json" 2>/dev/null

echo "=== GPU tests (exit $tests_rc)"
grep -E "passed|failed|error|Error" "$OUT/gpu_tests.log" | tail -8
grep -o "{'zero3_checkpoint.*" "$OUT/gpu_tests.log" | head -c 3000; echo
echo "=== overlap benchmark (exit $bench_rc)"
grep -E "^all_gather|^RESULT|Error|error" "$OUT/overlap.log" | tail -40
