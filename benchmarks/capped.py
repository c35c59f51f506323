"""Run a training script with this process's GPU memory capped, to measure a smaller card on a larger one.

    CAP_GIB=79.19 torchrun --nproc_per_node=2 benchmarks/capped.py benchmarks/train_llama.py --size 8b ...

Each process sets ``torch.cuda.set_per_process_memory_fraction`` for its ``LOCAL_RANK``'s GPU so that the
allocator refuses anything beyond ``CAP_GIB`` GiB (79.19 GiB is an H100 80 GB's capacity), then runs the
script as ``__main__`` with the remaining arguments. The memory outside torch's allocator (the CUDA context,
NCCL) is not capped; on the smaller card it would count against the same total.
"""

import os
import runpy
import sys

import torch


def main() -> None:
    if len(sys.argv) < 2 or "CAP_GIB" not in os.environ:
        raise SystemExit("usage: CAP_GIB=<GiB> python benchmarks/capped.py SCRIPT [ARGS...]")
    device = int(os.environ.get("LOCAL_RANK", "0"))
    cap = float(os.environ["CAP_GIB"]) * 2**30
    total = torch.cuda.get_device_properties(device).total_memory
    if cap > total:
        raise SystemExit(f"CAP_GIB={os.environ['CAP_GIB']} is more than the card's {total / 2**30:.2f} GiB")
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
