"""What the collective watchdog costs: per collective, per training step, and its heartbeat thread.

    torchrun --nproc_per_node=2 benchmarks/watchdog_overhead.py             # CPU, gloo
    torchrun --nproc_per_node=8 benchmarks/watchdog_overhead.py --steps 50  # GPUs, NCCL

Rows (one ``RESULT {json}`` line each, from rank 0):

- ``collective``: an all-gather of ``--numel`` elements through ``bmtwrap.engine.collectives.all_gather``,
  issued and waited ``--reps`` times, with the context's watchdog and without it (``ctx.watchdog``
  set to ``None``, as in a world of one), alternating rounds so that drift hits both alike;
  ``us_per_op`` for each and the difference.
- ``bookkeeping``: the watchdog's own work per collective alone (numbering it, marking the wait,
  the ``try`` around it) around a finished stand-in for the backend's work: what the rows above
  add, without the network's noise.
- ``step``: forward, backward and SGD step of a wrapped 8-layer MLP, with and without the watchdog.
- ``heartbeat``: one beat (building the record, JSON, one store ``set``) timed on the calling
  thread; ``core_fraction`` is that time over the heartbeat interval: the share of one core the
  thread takes.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable, Dict

import torch
from torch import nn

import bmtwrap as bmt
from bmtwrap.engine.collectives import all_gather
from bmtwrap.engine.dist import current


def _timed(fn: Callable[[], None], reps: int) -> float:
    bmt.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def _with_and_without(fn: Callable[[], None], reps: int, rounds: int) -> Dict[str, float]:
    ctx = current()
    dog = ctx.watchdog
    on, off = [], []
    for _ in range(rounds):
        on.append(_timed(fn, reps))
        ctx.watchdog = None
        off.append(_timed(fn, reps))
        ctx.watchdog = dog
    best_on, best_off = min(on) * 1e6, min(off) * 1e6  # the least disturbed round of each
    return {"us_with": round(best_on, 2), "us_without": round(best_off, 2), "us_added": round(best_on - best_off, 2),
            "percent": round(100 * (best_on - best_off) / best_off, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=4096, help="elements per rank of the timed all-gather")
    parser.add_argument("--reps", type=int, default=200, help="collectives per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds with and without the watchdog")
    parser.add_argument("--steps", type=int, default=20, help="training steps per timed round")
    args = parser.parse_args()

    ctx = bmt.init_distributed(seed=0)
    assert ctx.watchdog is not None, "run under torchrun with at least 2 processes"
    local = torch.randn(args.numel, device=ctx.device)
    full = torch.empty(args.numel * ctx.world_size, device=ctx.device)
    row = _with_and_without(lambda: all_gather(ctx, full, local, label="bench").wait(), args.reps, args.rounds)
    bmt.print_rank("RESULT " + json.dumps({"name": "collective", "backend": ctx.backend, "world": ctx.world_size,
                                           "numel": args.numel, **row}), flush=True)

    class Done:  # a collective that has completed: wait() returns at once
        def wait(self) -> bool:
            return True

    work, dog, op = Done(), ctx.watchdog, ("all-gather", "bench")
    n = 200_000
    start = time.perf_counter()
    for _ in range(n):
        work.wait()
    bare = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(n):
        dog.wait(work, dog.begin(op), op)
    watched = time.perf_counter() - start
    bmt.print_rank("RESULT " + json.dumps({"name": "bookkeeping", "us_per_op": round((watched - bare) / n * 1e6, 3)}),
                   flush=True)

    model = bmt.wrap(nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(8)]).to(ctx.device))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 256, device=ctx.device)

    def step() -> None:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # the first step records the block order
    before = dog.issued
    step()
    per_step = dog.issued - before
    row = _with_and_without(step, args.steps, args.rounds)
    bmt.print_rank("RESULT " + json.dumps({"name": "step", "collectives_per_step": per_step, **row}), flush=True)

    store = dog._store  # the diagnosis's connection: the same kind the thread beats on
    beats = 200
    start = time.perf_counter()
    for beat in range(beats):
        store.set(f"bmtwrap/heartbeat/bench{ctx.rank}", dog._record(beat).encode())
    per_beat = (time.perf_counter() - start) / beats
    bmt.print_rank("RESULT " + json.dumps({"name": "heartbeat", "us_per_beat": round(per_beat * 1e6, 1),
                                           "interval_s": dog.interval,
                                           "core_fraction": round(per_beat / dog.interval, 6)}), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
