"""bmt.distributed's collectives against values computed here from every rank's known input.

Rank ``q``'s input and upstream gradient are fixed functions of ``q``, so every rank can compute
what every collective and its backward must give without communicating. Values are float64
multiples of 0.25 in a small range, so sums and products are exact and errors must be 0.
Each case returns the largest absolute errors of the output and of the input's gradient; the
error cases return (exception type, message) pairs for test_distributed_ops.py to match.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

import bmtwrap as bmt
from bmtwrap import distributed as D
from common import raised, run

Tensor = torch.Tensor
LAYOUTS = ("contiguous", "transposed")


def values(q: int, shape: Tuple[int, ...]) -> Tensor:
    """Rank q's input: -2.5 … 3.5, never 0 (prod divides by it), with ties across ranks (max/min)."""
    n = math.prod(shape)
    return ((torch.arange(n) * (q + 2) + 3 * q) % 7 - 2.5).to(torch.float64).reshape(shape)


def upstream(q: int, shape: Tuple[int, ...]) -> Tensor:
    """Rank q's gradient of the output: distinct on every rank and element, never 0."""
    return torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) * 0.25 + q + 1


def inputs(shape: Tuple[int, int], layout: str) -> List[Tensor]:
    """Every rank's input of ``shape``; "transposed": a non-contiguous view of a (b, a) tensor."""
    if layout == "contiguous":
        return [values(q, shape) for q in range(bmt.world_size())]
    return [values(q, shape[::-1]).t() for q in range(bmt.world_size())]


def err(got: Tensor, expected: Tensor) -> float:
    if got.shape != expected.shape:
        return math.inf
    return (got.double() - expected.double()).abs().max().item()


def check(call: Callable[[Tensor], Tensor], shape: Tuple[int, int], layout: str,
          expected_out: Callable[[List[Tensor]], Tensor],
          expected_grad: Callable[[List[Tensor], List[Tensor], Tensor], Tensor]) -> Dict[str, Any]:
    """Run ``call`` on this rank's input; compare its output and the input's gradient with the formulas.

    ``expected_grad(xs, gs, out)`` gets every rank's input, every rank's upstream gradient and the
    expected output.
    """
    rank = bmt.rank()
    xs = inputs(shape, layout)
    x = xs[rank].clone().requires_grad_() if layout == "contiguous" else xs[rank].t().clone().requires_grad_().t()
    before = x.detach().clone()
    out = call(x)
    want = expected_out(xs)
    gs = [upstream(q, tuple(want.shape)) for q in range(bmt.world_size())]
    (grad,) = torch.autograd.grad(out, x, gs[rank])
    return across_ranks({"fwd": err(out, want), "grad": err(grad, expected_grad(xs, gs, want)),
                         "contiguous_input": x.is_contiguous(), "x_untouched": torch.equal(x.detach(), before),
                         "new_tensor": out.data_ptr() != x.data_ptr()})


def across_ranks(result: Dict[str, Any]) -> Dict[str, Any]:
    """The worst of every rank's ``result`` (rank 0 reports): the largest error; a flag true only if true everywhere.

    Reduced with torch.distributed itself, not with the module under test.
    """
    keys = sorted(result)
    worst = torch.tensor([float(not result[k]) if isinstance(result[k], bool) else float(result[k]) for k in keys],
                         dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {k: (v == 0.0 if isinstance(result[k], bool) else v) for k, v in zip(keys, worst.tolist())}


def all_reduce_case(op: str, layout: str) -> Dict[str, Any]:
    rank, world = bmt.rank(), bmt.world_size()
    reduce = {"sum": lambda s: s.sum(0), "avg": lambda s: s.mean(0), "max": lambda s: s.amax(0),
              "min": lambda s: s.amin(0), "prod": lambda s: s.prod(0)}[op]
    grads = {
        "sum": lambda xs, gs, out: gs[rank],
        "avg": lambda xs, gs, out: gs[rank] / world,
        "max": lambda xs, gs, out: torch.where(xs[rank] == out, gs[rank], 0.0),
        "min": lambda xs, gs, out: torch.where(xs[rank] == out, gs[rank], 0.0),
        "prod": lambda xs, gs, out: gs[rank] * out / xs[rank],
    }
    return check(lambda x: D.all_reduce(x, op), (3, 4), layout, lambda xs: reduce(torch.stack(xs)), grads[op])


def all_gather_case(layout: str) -> Dict[str, Any]:
    rank = bmt.rank()
    return check(D.all_gather, (3, 4), layout, torch.stack, lambda xs, gs, out: gs[rank][rank])


def reduce_scatter_case(op: str, layout: str) -> Dict[str, Any]:
    rank, world = bmt.rank(), bmt.world_size()
    div = world if op == "avg" else 1
    return check(lambda x: D.reduce_scatter(x, op), (2 * world, 3), layout,
                 lambda xs: torch.stack(xs).sum(0)[2 * rank : 2 * rank + 2] / div,
                 lambda xs, gs, out: torch.cat(gs) / div)


def broadcast_case(layout: str) -> Dict[str, Any]:
    """Every rank as the root in turn; the worst errors over all of them."""
    results = [check(lambda x: D.broadcast(x, root), (3, 4), layout, lambda xs: xs[root],
                     lambda xs, gs, out: torch.stack(gs).sum(0)) for root in range(bmt.world_size())]
    return {key: max(r[key] for r in results) if key in ("fwd", "grad") else all(r[key] for r in results)
            for key in results[0]}


def integers() -> Dict[str, Any]:
    """int64 tensors (no gradient): sum, avg (truncated, see [Note: averages]) and max, exactly."""
    world = bmt.world_size()
    xs = [torch.arange(6, dtype=torch.int64) * (q + 1) - 2 * q - 3 for q in range(world)]
    total = torch.stack(xs).sum(0)
    x = xs[bmt.rank()]
    return {"sum": torch.equal(D.all_reduce(x, "sum"), total),
            "avg": torch.equal(D.all_reduce(x, "avg"), torch.div(total, world, rounding_mode="trunc")),
            "max": torch.equal(D.all_reduce(x, "max"), torch.stack(xs).amax(0)),
            "gather": torch.equal(D.all_gather(x), torch.stack(xs)),
            "dtype": str(D.all_reduce(x, "avg").dtype)}


def subgroup() -> Dict[str, Any]:
    """comm=a ProcessGroup: ranks {0, last} (at world size 3, global rank 2 is group rank 1), and
    rank 0 calling on the group of ranks 1 … that it is not in."""
    rank, world = bmt.rank(), bmt.world_size()
    members = sorted({0, world - 1})
    group = dist.new_group(members)  # every rank must call new_group, member or not
    outside_of_0 = dist.new_group(list(range(1, world))) if world > 1 else None
    found: Dict[str, Any] = {"members": len(members)}
    if outside_of_0 is not None and rank == 0:
        found["non_member"] = raised(lambda: D.all_reduce(values(0, (2,)), comm=outside_of_0))
    errors = dict.fromkeys(("gather", "gather_grad", "sum", "bcast", "bcast_grad"), 0.0)
    if rank in members:
        n, me = len(members), members.index(rank)
        xs = [values(g, (2, 3)) for g in members]
        x = xs[me].clone().requires_grad_()
        gathered = D.all_gather(x, comm=group)
        upstream_by_row = torch.ones_like(gathered) * torch.arange(n).view(-1, 1, 1)  # row r's gradient: r
        (g_gather,) = torch.autograd.grad(gathered, x, upstream_by_row)
        sent = D.broadcast(x, n - 1, comm=group)  # root counted in the group: the last member
        (g_bcast,) = torch.autograd.grad(sent, x, torch.full_like(sent, float(me + 1)))
        errors = {"gather": err(gathered, torch.stack(xs)), "gather_grad": err(g_gather, torch.full((2, 3), float(me))),
                  "sum": err(D.all_reduce(x, comm=group), torch.stack(xs).sum(0)),
                  "bcast": err(sent, xs[-1]), "bcast_grad": err(g_bcast, torch.full((2, 3), n * (n + 1) / 2))}
    return {**found, **across_ranks(errors)}


def errors() -> Dict[str, Any]:
    world = bmt.world_size()
    x = torch.ones(2 * world, 2)
    found = {
        "all_reduce_op": raised(lambda: D.all_reduce(x, op="mean")),
        "reduce_scatter_op": raised(lambda: D.reduce_scatter(x, op="max")),
        "scalar": raised(lambda: D.reduce_scatter(torch.tensor(1.0))),
        "comm_str": raised(lambda: D.all_gather(x, comm="nccl")),
        "comm_object": raised(lambda: D.all_reduce(x, comm=object())),
        "root": raised(lambda: D.broadcast(x, world)),
        "not_tensor": raised(lambda: D.all_gather([1.0, 2.0])),
        "send": raised(lambda: D.send_activations(x, world, None)),
        "recv": raised(lambda: D.recv_activations(-1, None)),
        "double_backward": raised(lambda: double_backward(x)),
    }
    if world > 1:
        found["dim0"] = raised(lambda: D.reduce_scatter(torch.ones(world + 1, 2)))
    return found


def double_backward(x: Tensor) -> None:
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad((D.all_reduce(x) ** 2).sum(), x, create_graph=True)  # d/dx depends on x
    g.sum().backward()


CASES: Dict[str, Callable[[], Dict[str, Any]]] = {}
for _layout in LAYOUTS:
    CASES[f"all_gather-{_layout}"] = lambda l=_layout: all_gather_case(l)
    for _op in ("sum", "avg", "max", "min", "prod"):
        CASES[f"all_reduce-{_op}-{_layout}"] = lambda o=_op, l=_layout: all_reduce_case(o, l)
    for _op in ("sum", "avg"):
        CASES[f"reduce_scatter-{_op}-{_layout}"] = lambda o=_op, l=_layout: reduce_scatter_case(o, l)
    CASES[f"broadcast-{_layout}"] = lambda l=_layout: broadcast_case(l)
CASES.update(integers=integers, subgroup=subgroup, errors=errors)

if __name__ == "__main__":
    run(CASES)
