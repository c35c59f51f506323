"""Module trees the converter must handle, and non-finite gradients, in one process group.

Training cases compare against the same model unwrapped on the whole batch with SGD (Adam would
amplify rounding, see test_parity.py); non-finite cases check that every rank agrees and that no
parameter changes.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List

import torch
from torch import nn

import bmtwrap as bmt
from bmtwrap.wrap.convert import wrapped_record
from common import max_abs_diff, max_rel, run


class Mlp(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.tanh(self.up(x))))


class NestedLists(nn.Module):
    """A ModuleList of ModuleLists, never called: the model calls the layers one by one."""

    def __init__(self) -> None:
        super().__init__()
        self.groups = nn.ModuleList([nn.ModuleList([Mlp() for _ in range(2)]) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for group in self.groups:
            for layer in group:
                x = layer(x)
        return x


class UsedOutside(nn.Module):
    """Calls a layer's sub-module directly and multiplies by another layer's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Mlp() for _ in range(3)])
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        x = self.head(torch.relu(self.layers[0].up(x)))
        return x * self.layers[-1].norm.weight


class CrossBlock(nn.Module):
    """A layer whose forward reads a weight of another layer (inside one block, another's parameter)."""

    class Layer(Mlp):
        def forward(self, x: torch.Tensor, other: nn.Module = None) -> torch.Tensor:
            y = super().forward(x)
            return y if other is None else y + other.down.bias

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([self.Layer() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = layer(x, other=self.layers[index - 1] if index else None)
        return x


class CallsRootModule(nn.Module):
    """Layers that each call a module of the root group: a norm outside the layers, kept out of their parameters."""

    class Layer(Mlp):
        def __init__(self, shared: nn.Module) -> None:
            super().__init__()
            self.shared = [shared]  # a plain list: the norm is the root's, not the layer's

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(self.shared[0](x))

    def __init__(self) -> None:
        super().__init__()
        self.final = nn.LayerNorm(8)
        self.layers = nn.ModuleList([self.Layer(self.final) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.final(x)


def train_pair(make: Callable[[], nn.Module], steps: int = 3, **options: Any) -> Dict[str, Any]:
    torch.manual_seed(21)
    ref = make()
    model = bmt.wrap(copy.deepcopy(ref), **options)
    rank, world = bmt.rank(), bmt.world_size()
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(22))
    share = 6 // world
    rels = []
    for _ in range(steps):
        opt_ref.zero_grad()
        opt.zero_grad()
        ref_loss = (ref(x) ** 2).mean()
        ref_loss.backward()
        mine = (model(x[rank * share : (rank + 1) * share]) ** 2).mean()
        mine.backward()
        grads = bmt.full_grad_dict(model)
        grad_diff = max((grads[k] - p.grad).abs().max().item() for k, p in ref.named_parameters())
        rels.append(max_rel(bmt.sum_loss(mine).item(), ref_loss.item()))
        opt_ref.step()
        opt.step()
    record = wrapped_record(model)
    gathered_after = [r.group.gathered for _, r in record.runners]
    with torch.no_grad():
        no_grad_equal = torch.allclose(model(x[rank * share : (rank + 1) * share]), ref(x[rank * share : (rank + 1) * share]),
                                       atol=1e-5)
    return {"loss_max_rel": max(rels), "grad_max_abs": grad_diff, **max_abs_diff(model.state_dict(), ref.state_dict()),
            "blocks": [type(m).__name__ for m, _ in record.runners], "released": not any(gathered_after),
            "released_no_grad": not any(r.group.gathered for _, r in record.runners), "no_grad_equal": no_grad_equal}


# --- non-finite gradients -----------------------------------------------------------------------


def _poisoned_step(optimizer_kind: str, nonfinite: str, poison_rank: int) -> Dict[str, Any]:
    """A step whose loss is inf on ``poison_rank`` only (-1: none): what happens on every rank."""
    torch.manual_seed(23)
    model = bmt.wrap(nn.Sequential(Mlp(), Mlp()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if optimizer_kind == "adam":
        opt = bmt.optim.AdamOptimizer(model.parameters(), lr=0.1, nonfinite=nonfinite)
        stepper: Callable[[], Any] = opt.step
    elif optimizer_kind == "offload":
        opt = bmt.optim.AdamOffloadOptimizer(model.parameters(), lr=0.1, nonfinite=nonfinite)
        stepper = opt.step
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        manager = bmt.optim.OptimManager(nonfinite=nonfinite)
        manager.add_optimizer(opt)
        stepper = manager.step
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(24))
    loss = (model(x) ** 2).mean()
    if bmt.rank() == poison_rank:
        loss = loss * float("inf")
    loss.backward()
    try:
        returned = stepper()
        outcome = f"stepped: {returned}"
    except bmt.optim.NonFiniteGradientError as err:
        outcome = f"raised: {err}"
    after = model.state_dict()
    unchanged = all(torch.equal(after[k], v) for k, v in before.items())
    return {"outcome": outcome, "unchanged": unchanged, "finite": all(bool(torch.isfinite(v).all()) for v in after.values()),
            "skipped": getattr(opt, "skipped_steps", None)}


def nonfinite_cases() -> Dict[str, Any]:
    last = bmt.world_size() - 1
    out = {}
    for kind in ("adam", "offload", "manager"):
        for choice in ("raise", "skip"):
            out[f"{kind}_{choice}"] = _poisoned_step(kind, choice, last)
        out[f"{kind}_finite"] = _poisoned_step(kind, "raise", -1)
    return out


def one_check_per_block() -> Dict[str, Any]:
    """The check reads each block's flat gradient once where every parameter's gradient is a view of it, and each
    gradient alone otherwise: a NaN in one rank's piece of one gradient is found on every rank either way."""
    from bmtwrap.optim import nonfinite

    torch.manual_seed(27)
    model = bmt.wrap(nn.Sequential(Mlp(), Mlp(), Mlp()))
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(28))
    (model(x) ** 2).mean().backward()
    params = list(model.parameters())
    checked: List[int] = []
    real = nonfinite.ops.has_inf_nan_into

    def counting(tensor: torch.Tensor, flag: torch.Tensor) -> None:
        checked.append(tensor.numel())
        real(tensor, flag)

    def check(subset: List[torch.Tensor]) -> Dict[str, Any]:
        checked.clear()
        return {"found": nonfinite.start_check(subset).found(), "checks": len(checked), "elements": sum(checked)}

    out = {"grads": sum(1 for p in params if p.grad is not None and p.grad.numel() > 0)}
    nonfinite.ops.has_inf_nan_into = counting
    try:
        out["clean"] = check(params)
        poisoned = next(p for p in params[::-1] if p.grad is not None and p.grad.numel() > 0)  # the last block's
        if bmt.rank() == bmt.world_size() - 1:
            poisoned.grad.view(-1)[-1] = float("nan")
        out["nan"] = check(params)
        out["first_block"] = check(params[:6])  # the first block's parameters: its flat gradient, not the last's
        poisoned.grad = poisoned.grad.clone()  # no longer a view: its block is checked one gradient at a time
        out["replaced"] = check(params)
    finally:
        nonfinite.ops.has_inf_nan_into = real
    return out


def offload_in_backward_nonfinite() -> Dict[str, Any]:
    torch.manual_seed(25)
    model = bmt.wrap(nn.Sequential(Mlp(), Mlp()))
    opt = bmt.optim.AdamOffloadOptimizer(model.parameters(), lr=0.1, step_in_backward=True)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(26))
    ((model(x) ** 2).mean() * float("nan")).backward()
    try:
        opt.step()
        return {"outcome": "stepped"}
    except bmt.optim.NonFiniteGradientError as err:
        return {"outcome": f"raised: {err}"}


if __name__ == "__main__":
    run({
        "nested_lists": lambda: train_pair(NestedLists),
        "used_outside": lambda: train_pair(UsedOutside),
        "cross_block": lambda: train_pair(CrossBlock),
        "nonfinite": nonfinite_cases,
        "offload_in_backward_nonfinite": offload_in_backward_nonfinite,
        "one_check_per_block": one_check_per_block,
    })
