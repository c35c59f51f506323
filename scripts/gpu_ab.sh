#!/usr/bin/env bash
# On a machine with CUDA GPUs: the training throughput of this checkout (B) against another tree of
# bmtwrap (A, a folder holding its bmtwrap/ and benchmarks/, e.g. from `git archive`), measured in one
# call, alternating A B A B so that drift of the machine shows as the spread within each side.
#
#   bash scripts/gpu_ab.sh OTHER_TREE [train_llama.py arguments]    (default: --size 1b --batch 8 --seq 2048)
#
# The extension is built here once (sm_90) and shared: the other tree must have the same csrc/.
# Prints every RESULT line, then the median tokens/s of each side. Logs go to $OUT (default ./gpu-logs).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-logs}
other=$(cd "${1:?usage: bash scripts/gpu_ab.sh OTHER_TREE [train_llama.py arguments]}" && pwd)
shift
args=("$@")
((${#args[@]})) || args=(--size 1b --batch 8 --seq 2048 --steps 5 --warmup 2)
mkdir -p "$OUT"

if ! python3 -c "import bmtwrap._C" 2>/dev/null; then
    BMTWRAP_CUDA_ARCH=${BMTWRAP_CUDA_ARCH:-90} python3 -m pip install -q --no-build-isolation --no-deps -e . \
        > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
cp bmtwrap/_C*.so "$other/bmtwrap/"
for tree in "$other" "$(pwd)"; do  # each side must import its own tree
    (cd "$tree" && PYTHONPATH="$tree" python3 -c "import bmtwrap; print('imports', bmtwrap.__file__)")
done

for round in 1 2; do
    for side in A B; do
        tree=$([[ $side == A ]] && echo "$other" || pwd)
        (cd "$tree" && PYTHONPATH="$tree" python3 benchmarks/train_llama.py "${args[@]}") \
            > "$OUT/ab_${side}${round}.log" 2>&1
        echo "$side$round $(grep '^RESULT' "$OUT/ab_${side}${round}.log" || tail -3 "$OUT/ab_${side}${round}.log")"
    done
done
python3 - "$OUT" <<'PY'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
for side in "AB":
    runs = [json.loads(line[7:]) for f in sorted(out.glob(f"ab_{side}*.log"))
            for line in f.read_text().splitlines() if line.startswith("RESULT ")]
    tok = [r["tok_s_gpu"] for r in runs]
    print(f"{side}: tokens/s {tok} median {statistics.median(tok) if tok else None}",
          f"peak GiB {[r['peak_gib'] for r in runs]}")
PY
