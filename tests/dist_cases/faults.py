"""A training loop in which one rank fails, for tests/test_faults.py (launched without torchrun).

argv: mode, victim rank, collective timeout (s), and check ("check" turns on check_collectives).

Every rank trains a small wrapped model (on its GPU where CUDA is available, over NCCL) (4 blocks, SGD, ``bmt.sum_loss`` each step). In step
``FAULT_STEP`` the victim, inside the forward of block ``FAULT_BLOCK``:
- ``kill``: SIGKILLs itself;
- ``hang``: sleeps for an hour (alive, never reaching its next collective);
- ``reorder``: runs its blocks in reverse order from there on (what rank-dependent control flow does);
- ``oom``: raises ``torch.OutOfMemoryError`` (every block is checkpointed, so nothing recovers);
- ``oom-backward``: raises it when the block's forward is recomputed in backward instead;
- ``none``: nothing (the loop ends normally).
Each rank prints ``rank R step S`` after each step, ``FAULT <mode> <unix time>`` just before the
fault and ``RAISED <unix time>`` when a ``bmtwrap.CollectiveError`` reaches the top, on stdout,
flushed; the error's traceback goes to stderr.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import bmtwrap as bmt
from bmtwrap.engine.schedule import in_backward

MODE, VICTIM, TIMEOUT = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
CHECK = len(sys.argv) > 4 and sys.argv[4] == "check"
STEPS, FAULT_STEP, FAULT_BLOCK, WIDTH = 6, 3, 2, 64


class Layer(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, WIDTH) -> (B, WIDTH)
        if (STATE["step"] == FAULT_STEP and self.index == FAULT_BLOCK and not STATE["fired"] and bmt.rank() == VICTIM
                and in_backward() == (MODE == "oom-backward")):
            STATE["fired"] = True
            fault()
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(i) for i in range(4))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = list(self.layers)
        if STATE["reversed"]:
            order.reverse()
        for layer in order:
            x = layer(x)
        return self.head(x)


STATE = {"step": 0, "fired": False, "reversed": False}


def fault() -> None:
    print(f"FAULT {MODE} {time.time():.3f}", flush=True)
    if MODE == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif MODE == "hang":
        time.sleep(3600)
    elif MODE == "reorder":
        STATE["reversed"] = True
    elif MODE.startswith("oom"):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected by the test)")


def wait_for_every_rank() -> None:
    """Return once every rank has imported what it needs: a loaded machine starts the ranks of the jobs that run
    side by side tens of seconds apart, longer than the collectives' timeout that the test is about, and the
    process group's own rendezvous waits only that long."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=600))
    world = int(os.environ["WORLD_SIZE"])
    store.set(f"faults/imported/{os.environ['RANK']}", "1")
    store.wait([f"faults/imported/{r}" for r in range(world)])


def main() -> None:
    wait_for_every_rank()
    ctx = bmt.init_distributed(seed=0, timeout=TIMEOUT, check_collectives=CHECK)
    # checkpoint='auto' would recover from running out of memory in a kept block on a GPU; nothing recovers here.
    model = bmt.wrap(Net().to(ctx.device), checkpoint=True if MODE.startswith("oom") else "auto")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(bmt.rank())
    for step in range(1, STEPS + 1):
        STATE["step"] = step
        x = torch.randn(8, WIDTH, generator=data).to(ctx.device)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {bmt.rank()} step {step} loss {bmt.sum_loss(loss).item():.6f}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except bmt.CollectiveError:
        print(f"RAISED {time.time():.3f}", flush=True)
        raise
