"""How fast is bmtwrap's CPU Adam next to torch.optim.AdamW and DeepSpeedCPUAdam, and next to memory speed?

    python benchmarks/adam_cpu.py                    # 64 Mi fp32 parameters, torch.get_num_threads() threads
    python benchmarks/adam_cpu.py --numel 50000000 --steps 9 --threads 1
    THP_MEM_ALLOC_ENABLE=1 python benchmarks/adam_cpu.py   # torch allocates on transparent huge pages

Protocol (shared/BENCH.md, "CPU Adam"): one optimizer step over --numel fp32 parameters held in one tensor,
two warm-up steps, then the median of --steps timed steps, for
  - bmtwrap.ops.adam_step_cpu with fp32 gradients, and again with bf16 gradients and a bf16 copy written out
    (the offload engine's case: a bf16 gradient comes from the GPU, a bf16 weight goes back);
  - torch.optim.AdamW(foreach=True);
  - DeepSpeed's DeepSpeedCPUAdam (fp32 gradients), when deepspeed is importable ("not installed" otherwise;
    its first use JIT-compiles its kernel, about a minute).
All run with --threads threads (default torch.get_num_threads(), which OMP_NUM_THREADS sets): --threads calls
torch.set_num_threads, which also sets the OpenMP thread count that DeepSpeed's kernel uses (it runs on
torch's OpenMP runtime).

Effective bandwidth = bytes per element that one pass must move x elements/s, where a pass reads
param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq (and the copy):
    fp32 grad:              read 4+4+4+4 = 16 B, write 4+4+4 = 12 B  -> 28 B per element
    bf16 grad + bf16 copy:  read 4+2+4+4 = 14 B, write 4+4+4+2 = 14 B -> 28 B per element
The same figure is charged to every implementation, whatever it really moves (torch's foreach step makes
several passes). The ceiling beside it is a plain copy, torch `dst.copy_(src)` over two 512 MiB buffers,
charged 8 B per fp32 element (4 read + 4 written; the hardware also reads each destination line before
writing it, which the optimizers do not pay for, since they write lines they have just read).

The contenders are timed in turn, round after round (see median_seconds), and the load average is printed:
on a shared machine, compare figures from one run only.

Measured on the 2-core development machine (AMD EPYC, Zen 3, AVX2, under KVM, 4 KiB pages), 2026-11-28,
`--numel 50000000 --steps 11 --threads T`, T = 1 and 2 in turn, five runs each, the load average 2.0 to 3.6
from other work on the machine (which moves every absolute figure by up to 2x from run to run). Ratios are to
DeepSpeedCPUAdam (0.19.8, fp32 gradients) in the same run:

    M elements/s          threads=1                    threads=2
    copy ceiling          912-1,394                    830-2,097
    DeepSpeedCPUAdam      491-709                      500-1,025
    bmtwrap, fp32 grad    525-841,   1.06-1.40x (1.19) 572-1,109, 1.07-1.29x (1.14)
    bmtwrap, bf16 + copy  555-780,   1.07-1.29x (1.13) 630-1,065, 1.04-1.37x (1.25)
    (ranges over the five runs; the ratio's median in brackets)

Four runs each half an hour earlier (load 1.1 to 2.8) gave 1.12-1.19x at one thread and 0.96-1.14x at two. In the
quietest two-thread run bmtwrap moved 31.0 GB/s (1,109 M/s, 1.08x; the bf16 case 1.04x) beside the copy's
16.8 GB/s (25 GB/s counting its destination's reads): both optimizers then run at the memory's speed, and the
step is as fast as the same loads and stores with trivial arithmetic (see [Note: memory traffic] in
csrc/cpu/adam.cpp), so the margin there is what DeepSpeed's loop leaves below that ceiling, about 8%. With other
work on the cores the margin at two threads is larger, since a slowed thread holds bmtwrap's step up by one
slice only (see the splitting in csrc/cpu/adam.cpp).

Prints one ``RESULT {json}`` line per measurement (what, impl, elements_per_s, gbytes_per_s, threads, numel)
and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from bmtwrap import ops
from bmtwrap.engine.offload import advise_huge_pages

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
COPY_NUMEL = 128 * 1024 * 1024  # 512 MiB of fp32 per buffer: far beyond any last-level cache


class Contender(NamedTuple):
    """One thing to time: `step` runs one optimizer step (or one copy) over `numel` elements."""

    what: str
    impl: str
    numel: int
    bytes_per_element: int
    step: Callable[[], object]


HUGE_PAGES = False  # --huge-pages: every contender's buffers on transparent huge pages


def _buffer(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    tensor = torch.empty(numel, dtype=dtype)
    if HUGE_PAGES:
        advise_huge_pages(tensor)  # before the first touch, as AdamOffloadOptimizer allocates its state
    return tensor.zero_()


def make_state(numel: int, grad_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    param = _buffer(numel).copy_(torch.randn(numel, generator=generator))
    grad = _buffer(numel, grad_dtype).copy_(torch.randn(numel, generator=generator))
    return param, grad, _buffer(numel), _buffer(numel)


def copy_contender() -> Contender:
    src, dst = _buffer(COPY_NUMEL).normal_(), _buffer(COPY_NUMEL)
    return Contender("copy", "torch copy_", COPY_NUMEL, 8, lambda: dst.copy_(src))


def bmtwrap_contender(numel: int, grad_dtype: torch.dtype, copy_dtype: torch.dtype | None) -> Contender:
    param, grad, exp_avg, exp_avg_sq = make_state(numel, grad_dtype)
    out = None if copy_dtype is None else _buffer(numel, copy_dtype)
    step = 0

    def one_step() -> None:
        nonlocal step
        step += 1
        ops.adam_step_cpu(param, grad, exp_avg, exp_avg_sq, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                          weight_decay=WEIGHT_DECAY, step=step, out=out)

    grads = str(grad_dtype).removeprefix("torch.")
    impl = f"bmtwrap adam_step_cpu ({grads} grad" + (", bf16 copy out)" if copy_dtype is not None else ")")
    return Contender("adam_step", impl, numel, 28, one_step)


def optimizer_contender(numel: int, impl: str, make: Callable[[list], torch.optim.Optimizer]) -> Contender:
    param, grad, _, _ = make_state(numel, torch.float32)
    weights = torch.nn.Parameter(param)
    weights.grad = grad
    return Contender("adam_step", impl, numel, 28, make([weights]).step)


def deepspeed_contender(numel: int) -> Contender | str:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError as error:
        return f"not installed ({error})"
    make = lambda params: DeepSpeedCPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                           adamw_mode=True)
    return optimizer_contender(numel, "DeepSpeedCPUAdam", make)


def median_seconds(contenders: list[Contender], *, warmup: int, steps: int, settle: float) -> list[float]:
    """Warm every contender up, then time them in turn, `steps` rounds: a change in background load during
    the run then slows all of them alike instead of whichever happened to be running. Each timed step starts
    `settle` seconds after the previous one ended: torch's OpenMP threads keep spinning on the cores for a while
    after a parallel op, which slowed whatever came right after a torch contender by some 7%."""
    for contender in contenders:
        for _ in range(warmup):
            contender.step()
    times: list[list[float]] = [[] for _ in contenders]
    for _ in range(steps):
        for contender, samples in zip(contenders, times):
            time.sleep(settle)
            start = time.perf_counter()
            contender.step()
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--huge-pages", action="store_true",
                        help="allocate every contender's buffers on transparent huge pages (madvise)")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for every contender (default: torch.get_num_threads())")
    parser.add_argument("--numel", type=int, default=64 * 1024 * 1024, help="parameters (default 64 Mi)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps, median reported (default 5)")
    parser.add_argument("--settle", type=float, default=0.05,
                        help="seconds to sleep before each timed step (default 0.05; see median_seconds)")
    args = parser.parse_args()
    global HUGE_PAGES
    HUGE_PAGES = args.huge_pages
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)

    torch_adamw = lambda params: torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                                   foreach=True)
    contenders = [
        copy_contender(),
        bmtwrap_contender(args.numel, torch.float32, None),
        bmtwrap_contender(args.numel, torch.bfloat16, torch.bfloat16),
        optimizer_contender(args.numel, "torch.optim.AdamW(foreach=True)", torch_adamw),
    ]
    deepspeed = deepspeed_contender(args.numel)
    if isinstance(deepspeed, str):
        print(f"DeepSpeedCPUAdam: {deepspeed}")
    else:
        contenders.append(deepspeed)

    load_before = os.getloadavg()[0]
    seconds = median_seconds(contenders, warmup=args.warmup, steps=args.steps, settle=args.settle)
    threads = torch.get_num_threads()
    rates = {}
    for contender, median in zip(contenders, seconds):
        rate = contender.numel / median
        rates[contender.impl] = rate
        print("RESULT " + json.dumps({
            "what": contender.what, "impl": contender.impl, "elements_per_s": round(rate),
            "gbytes_per_s": round(rate * contender.bytes_per_element / 1e9, 2), "threads": threads,
            "numel": contender.numel, "bytes_per_element": contender.bytes_per_element,
        }), flush=True)

    print(f"\nhuge pages: {HUGE_PAGES}")
    print(f"{'implementation':<52} {'M elem/s':>9} {'GB/s':>6}   threads={threads}, numel={args.numel:,}, "
          f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    for contender in contenders:
        rate = rates[contender.impl]
        print(f"{contender.impl:<52} {rate / 1e6:>9,.0f} {rate * contender.bytes_per_element / 1e9:>6.1f}")
    ours = rates["bmtwrap adam_step_cpu (float32 grad)"]
    for name in ("torch.optim.AdamW(foreach=True)", "DeepSpeedCPUAdam"):
        if name in rates:
            print(f"bmtwrap (fp32 grad) / {name}: {ours / rates[name]:.2f}x")
    if "DeepSpeedCPUAdam" in rates:
        offload = rates["bmtwrap adam_step_cpu (bfloat16 grad, bf16 copy out)"]
        ratio = offload / rates["DeepSpeedCPUAdam"]
        print(f"bmtwrap (bf16 grad, bf16 copy out) / DeepSpeedCPUAdam (fp32 grad): {ratio:.2f}x")


if __name__ == "__main__":
    main()
