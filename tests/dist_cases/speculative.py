"""Updates started in backward (``AdamOffloadOptimizer(step_in_backward="speculative")``) against the same
training with every update started at ``step()`` (``step_in_backward=False``), in one process group.

Each case trains twice from the same values on the same data, in bf16 (the offload optimizer keeps fp32 masters
and moments on the host), and reports whether every loss and every final parameter is the same bit for bit, and
how many updates started in backward were kept, redone or undone (so that each case shows which path it took).
Argument 2 (optional): "cpu" (default) or "cuda" (one GPU per process: the gradients then go to the host on a
side stream, and the parameters come back through the offload queue's copies). Argument 3 (optional): the cases
to run, comma-separated (default: all).
"""

from __future__ import annotations

import copy
import math
import sys
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

import bmtwrap as bmt
from bmtwrap.optim.optim_manager import clip_grads_with_norm, grad_norm
from common import run
from gpt_model import ShardedGPT

DTYPE = torch.bfloat16
LR = 1e-2
DEVICE = sys.argv[2] if len(sys.argv) > 2 else "cpu"


class Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    """A plain model for bmt.wrap: an input projection and a head around repeated layers."""

    def __init__(self, dim: int = 24, layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.layers = nn.ModuleList(Layer(dim) for _ in range(layers))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).pow(2).mean()


def gpt(**kwargs: Any) -> nn.Module:
    torch.manual_seed(1234)
    return ShardedGPT(dtype=DTYPE, device=DEVICE, **kwargs)


STACK = None


def stack() -> nn.Module:
    global STACK
    if STACK is None:
        torch.manual_seed(99)
        STACK = Stack().to(DTYPE)
    return bmt.wrap(copy.deepcopy(STACK).to(DEVICE))


def batches(model: nn.Module, step: int, micro: int) -> torch.Tensor:
    """This rank's micro-batch ``micro`` of step ``step``."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + bmt.rank())
    if isinstance(model, ShardedGPT):
        return torch.randint(0, 64, (2, 9), generator=g).to(DEVICE)
    return torch.randn(4, 8, generator=g).to(DEVICE, DTYPE)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.loss(x) if isinstance(model, ShardedGPT) else model(x)


def train(mode: Any, make: Callable[[], nn.Module], *, steps: int = 4, accums: Optional[List[int]] = None,
          clip: Optional[float] = None, clip_with: str = "manager", loss_scale: Optional[float] = None,
          late_lr: bool = False, poison: Optional[int] = None, skip_by_zero_grad: Optional[int] = None,
          eval_between: bool = False, closure: bool = False, **options: Any) -> Dict[str, Any]:
    model = make()
    opt = bmt.optim.AdamOffloadOptimizer(model.parameters(), lr=LR, weight_decay=0.1, step_in_backward=mode,
                                         nonfinite="skip", **options)
    manager = bmt.optim.OptimManager(loss_scale=loss_scale, nonfinite="skip")
    manager.add_optimizer(opt)
    accums = accums or [1] * steps
    losses: List[float] = []
    skipped = 0
    for step, accum in enumerate(accums):
        def backward() -> torch.Tensor:
            total = torch.zeros((), device=DEVICE)
            for micro in range(accum):
                loss = loss_of(model, batches(model, step, micro)) / accum
                if step == poison and bmt.rank() == bmt.world_size() - 1:
                    loss = loss * math.inf  # one rank's gradients turn inf or NaN
                manager.backward(loss)
                total += loss.detach().float()
            return total
        if closure:
            loss = opt.step(backward)
            opt.zero_grad()
            losses.append(bmt.sum_loss(loss).item())
            continue
        loss = backward()
        if eval_between:
            with torch.no_grad():
                loss_of(model, batches(model, 99, 0))
        if late_lr:  # the schedule moves between backward and the step
            for group in opt.param_groups:
                group["lr"] = LR / (step + 2)
        if clip is not None and clip_with == "manager":
            manager.clip_grad_norm(opt.param_groups, clip)
        elif clip is not None:  # as bmtwrap.hf.Trainer clips
            params = list(model.parameters())
            clip_grads_with_norm(params, clip, grad_norm(params), [opt])
        if step == skip_by_zero_grad:
            manager.zero_grad()
            continue
        skipped += not manager.step()
        manager.zero_grad()
        losses.append(bmt.sum_loss(loss).item())
    opt.wait()
    full = bmt.full_state_dict(model)
    return dict(losses=losses, params=full, speculation=dict(opt.speculation), skipped=skipped)


def compare(make: Callable[[], nn.Module] = gpt, **kwargs: Any) -> Dict[str, Any]:
    plain = train(False, make, **kwargs)
    early = train("speculative", make, **kwargs)
    finite = all(bool(torch.isfinite(v.float()).all()) for v in early["params"].values())
    return dict(losses_equal=plain["losses"] == early["losses"], losses=early["losses"],
                params_equal=all(torch.equal(v, early["params"][k]) for k, v in plain["params"].items()),
                finite=bool(finite), speculation=early["speculation"], skipped=[plain["skipped"], early["skipped"]])


CASES = {
    "plain": lambda: compare(),
    "wrapped_plain": lambda: compare(stack),
    "clipped": lambda: compare(clip=1e-3),
    "clip_not_reached": lambda: compare(clip=1e6),
    "clipped_as_the_trainer_clips": lambda: compare(stack, clip=1e-3, clip_with="trainer"),
    "trainer_clip_not_reached": lambda: compare(stack, clip=1e6, clip_with="trainer"),
    "accumulate_2_clipped": lambda: compare(accums=[2, 2, 2, 2], clip=1e-3),
    "accumulate_2": lambda: compare(accums=[2, 2, 2, 2]),
    "accumulation_changes": lambda: compare(accums=[1, 1, 2, 2, 1, 3, 1, 1]),
    "wrapped_accumulation_changes": lambda: compare(stack, accums=[1, 1, 2, 1, 1]),
    "lr_moves_before_step": lambda: compare(late_lr=True),
    "loss_scale": lambda: compare(loss_scale=1024.0),
    "nonfinite_skipped": lambda: compare(steps=5, poison=2),
    "zero_grad_without_step": lambda: compare(steps=5, skip_by_zero_grad=2),
    "evaluation_before_step": lambda: compare(stack, eval_between=True),
    "closure": lambda: compare(closure=True),
    "offload_params": lambda: compare(lambda: gpt(offload_params=True)),
    "small_chunks": lambda: compare(chunk_numel=100, staging_slots=2),
}


if __name__ == "__main__":
    chosen = sys.argv[3].split(",") if len(sys.argv) > 3 else list(CASES)
    run({name: CASES[name] for name in chosen})
