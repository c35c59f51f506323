"""Train a small model for a number of steps; optionally resume from a sharded checkpoint and die mid-step.

    soak.py RESULT.json FOLDER STEPS [--resume] [--save-every N] [--die-at STEP]

Every rank trains its share of a batch that depends only on the step number, with dropout (the RNG
states matter), bmtwrap's Adam, a cosine schedule and an OptimManager. Every ``--save-every`` steps
it saves a sharded checkpoint in FOLDER. With ``--die-at S``, rank 1 (rank 0 in a world of one)
kills itself with SIGKILL in the middle of step S, after its forward: the others are left inside a
collective, as in a crash on a real machine. With ``--resume`` it starts from FOLDER's checkpoint.
At the end rank 0 writes the losses and a digest of every parameter, bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
from typing import Any, Dict

import torch
from torch import nn

import bmtwrap as bmt


class Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.relu(self.up(x))))


class Model(nn.Module):
    def __init__(self, dim: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, dim)
        self.layers = nn.ModuleList([Layer(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def batch(step: int) -> torch.Tensor:
    """The global batch of ``step`` (the same on every rank and in every run)."""
    return torch.randint(0, 32, (6, 9), generator=torch.Generator().manual_seed(1000 + step))


def digest(model: nn.Module) -> Dict[str, str]:
    return {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
            for k, v in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("result")
    parser.add_argument("folder")
    parser.add_argument("steps", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--die-at", type=int, default=-1)
    args = parser.parse_args()

    bmt.init_distributed(seed=0)
    torch.manual_seed(0)
    model = bmt.wrap(Model())
    optimizer = bmt.optim.AdamOptimizer(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = bmt.lr_scheduler.Cosine(optimizer, start_lr=3e-3, warmup_iter=10, end_iter=args.steps)
    manager = bmt.optim.OptimManager()
    manager.add_optimizer(optimizer, scheduler)
    start = 0
    if args.resume:
        start = bmt.load_checkpoint(args.folder, model, manager).step
    rank, world = bmt.rank(), bmt.world_size()
    share = 6 // world
    losses = []
    for step in range(start, args.steps):
        manager.zero_grad()
        ids = batch(step)[rank * share : (rank + 1) * share]
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 32), ids[:, 1:].reshape(-1))
        if step == args.die_at and rank == min(1, world - 1):
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the others wait in backward's reductions
        manager.backward(loss)
        manager.step()
        losses.append(bmt.sum_loss(loss).item())
        if args.save_every and (step + 1) % args.save_every == 0:
            bmt.save_checkpoint(args.folder, model, manager, step=step + 1)
    result: Dict[str, Any] = {"start": start, "losses": losses, "digest": digest(model)}
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(result, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
