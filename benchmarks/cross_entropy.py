"""Peak memory and time of the loss on a large vocabulary: torch vs bmtwrap's fused and chunked losses.

    python benchmarks/cross_entropy.py            # 8 x 2048 tokens, 128,256 classes, bf16, one GPU

Three ways to get the loss and the gradients of an LM head's output:
- torch: ``F.cross_entropy(hidden @ W.T, target)`` on bf16 logits (the usual code),
- fused: ``bmt.loss.FusedCrossEntropy(inplace=True)`` on the same bf16 logits,
- chunked: ``bmt.loss.linear_cross_entropy(hidden, W, target)``, which never holds all the logits
  (also at the chunk sizes of ``--chunks``).
Each is timed forward + backward (median of 5 after 2 warm-ups) and its peak memory above the
inputs is read from ``torch.cuda.max_memory_allocated``. Prints ``RESULT {json}`` lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable

import torch
import torch.nn.functional as F

import bmtwrap as bmt


def measure(step: Callable[[], None], warmup: int = 2, repeat: int = 5) -> tuple:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8 * 2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--chunks", default="2048,4096,8192",
                        help="chunk sizes (rows) of linear_cross_entropy to time, the default first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=g)
    fused = bmt.loss.FusedCrossEntropy(inplace=True)

    def run(loss_fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            hidden.grad = weight.grad = None
            loss_fn().backward()
        return step

    cases = {
        "torch": lambda: F.cross_entropy(hidden @ weight.T, target),
        "fused": lambda: fused(hidden @ weight.T, target),
        "chunked": lambda: bmt.loss.linear_cross_entropy(hidden, weight, target),  # the default chunk size
    }
    for size in [int(c) for c in args.chunks.split(",") if c]:
        cases[f"chunked-{size}"] = lambda size=size: bmt.loss.linear_cross_entropy(hidden, weight, target,
                                                                                   chunk_size=size)
    losses = {}
    for name, loss_fn in cases.items():
        losses[name] = loss_fn().item()
        ms, gib = measure(run(loss_fn))
        print("RESULT " + json.dumps({"what": "cross_entropy", "impl": name, "tokens": args.tokens,
                                      "vocab": args.vocab, "hidden": args.hidden, "ms": round(ms, 2),
                                      "peak_extra_gib": round(gib, 2), "loss": round(losses[name], 5)}))
    print(f"losses agree: {max(losses.values()) - min(losses.values()):.2e}")


if __name__ == "__main__":
    main()
