"""The memory-bound kernels of a training step against the card's ceilings, in TB/s.

    python benchmarks/kernel_bandwidth.py         # one GPU

- ``adam``: the fused Adam(W) step with a split master (``ops.adam_step_split``: bf16 weight and gradient, 16-bit
  low halves, fp32 moments; 26 bytes an element), over a Llama-3 tied embedding's 263 M elements and over one
  block-sized 17 M;
- ``ce_forward``: the cross-entropy forward (``ops.cross_entropy_forward``) over an 8,192 x 128,256 bf16 chunk of
  logits, read once;
- the ceilings: a copy of as many bytes as Adam moves (read and write), and a row sum of the same logits (read).

Each is the median of 15 timed calls after 3 warm-ups (CUDA events). Prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import json
from typing import Callable, Dict

import torch

from bmtwrap import ops

ADAM_SIZES = (262_668_288, 16_777_216)  # 128,256 x 2,048 (the 1B's embedding); 8,192 x 2,048 (an MLP weight)
ADAM_BYTES = 26  # read: weight 2, low 2, grad 2, moments 8; written: weight 2, low 2, moments 8
ROWS, VOCAB = 8192, 128256


def median_seconds(fn: Callable[[], object], repeat: int = 15) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(start.elapsed_time(end) for start, end in events)[repeat // 2] / 1e3


def row(seconds: float, nbytes: float) -> Dict[str, float]:
    return dict(ms=round(seconds * 1e3, 3), tbs=round(nbytes / seconds / 1e12, 3))


def adam(n: int) -> Dict[str, float]:
    weight = torch.randn(n, device="cuda").bfloat16()
    low = torch.zeros(n, dtype=torch.int16, device="cuda")
    grad = torch.randn(n, device="cuda").bfloat16() * 1e-3
    exp_avg, exp_avg_sq = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    seconds = median_seconds(lambda: ops.adam_step_split(weight, low, grad, exp_avg, exp_avg_sq, lr=1e-4, beta1=0.9,
                                                         beta2=0.999, eps=1e-8, weight_decay=0.0, step=1))
    return row(seconds, ADAM_BYTES * n)


def copy(nbytes: int) -> Dict[str, float]:
    source = torch.empty(nbytes // 8, device="cuda")  # fp32: half the bytes each way
    target = torch.empty_like(source)
    return row(median_seconds(lambda: target.copy_(source)), 2 * source.numel() * 4)


def logits_rows() -> Dict[str, Dict[str, float]]:
    logits = torch.randn(ROWS, VOCAB, device="cuda").bfloat16()
    targets = torch.randint(0, VOCAB, (ROWS,), device="cuda")
    return dict(row_sum=row(median_seconds(lambda: logits.sum(dim=1)), logits.numel() * 2),
                ce_forward=row(median_seconds(lambda: ops.cross_entropy_forward(logits, targets)), logits.numel() * 2))


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    out: Dict[str, object] = dict(device=torch.cuda.get_device_name())
    for n in ADAM_SIZES:
        out[f"adam_{n}"] = adam(n)
    out["copy"] = copy(ADAM_SIZES[0] * ADAM_BYTES)
    out.update(logits_rows())
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
