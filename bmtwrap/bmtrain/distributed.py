"""``bmt.distributed``: BMTrain's autograd-aware collectives, over ``torch.distributed``.

BMTrain 1.0.1 offers :func:`all_gather`, :func:`all_reduce`, :func:`reduce_scatter` and
:func:`broadcast` as differentiable functions: each returns a new tensor and, in backward, sends
the gradient back across ranks the way the chain rule asks (an all-gather's gradient is this rank's
slice; a broadcast's is the sum of every rank's gradient). They are for model code written by hand,
such as a loss computed over the whole job; the engine's own gathers and reductions live in
:mod:`bmtwrap.engine.collectives` and are not autograd-aware.

Every function here must be called by every rank of the group, in the same order, with tensors of
the same shape and dtype on every rank. CUDA tensors go through NCCL, CPU tensors through gloo; a
world of one copies locally.

[Note: comm]
BMTrain's ``comm`` argument takes one of its own NCCL communicators, which bmtwrap does not have
(``bmt.config["comm"]`` raises). Here ``comm`` is either ``None``, the whole job's group
(:attr:`bmtwrap.engine.dist.DistContext.group`), or a ``torch.distributed.ProcessGroup`` (for example made
by ``torch.distributed.new_group``), in which case ranks, the world size and ``broadcast``'s
``root`` are counted within that group. Anything else raises ``TypeError``.

[Note: averages]
NCCL averages inside the collective. gloo has no AVG, so for CPU tensors the sum is divided by the
world size afterwards, integer tensors with truncation toward zero (as C's integer division).

[Note: second derivatives]
As in BMTrain, the backward of each function is not itself differentiable: differentiating
through it twice (``create_graph=True`` and a second backward) raises torch's ``RuntimeError``.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, NoReturn, Optional, Tuple

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx, once_differentiable

from ..engine import dist as _dist
from ..engine.collectives import all_gather_single, reduce_scatter_single

__all__ = ["all_gather", "all_reduce", "broadcast", "gather_result", "recv_activations", "reduce_scatter",
           "send_activations"]

_ALL_REDUCE_OPS = ("sum", "avg", "max", "min", "prod")  # BMTrain's names
_REDUCE_SCATTER_OPS = ("sum", "avg")
_TORCH_OP: Mapping[str, dist.ReduceOp] = MappingProxyType({
    "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT,
})  # "sum" and "avg": see _sum_op and [Note: averages]


class _Comm(NamedTuple):
    """The group a call runs on, with this rank's place in it."""

    group: dist.ProcessGroup
    rank: int
    world_size: int


def _resolve(comm: Optional[dist.ProcessGroup], caller: str) -> _Comm:
    """``comm`` as a :class:`_Comm` (see [Note: comm]); raises RuntimeError before init_distributed."""
    ctx = _dist.current()
    if comm is None:
        return _Comm(ctx.group, ctx.rank, ctx.world_size)
    if isinstance(comm, int) and comm == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"bmt.distributed.{caller}: this rank ({ctx.rank}) is not a member of the group passed as comm; "
            "call the collective only on the ranks that torch.distributed.new_group(ranks) was given"
        )
    if not isinstance(comm, dist.ProcessGroup):
        raise TypeError(
            f"bmt.distributed.{caller}: comm must be None (the whole job's group) or a "
            f"torch.distributed.ProcessGroup, got {type(comm).__name__}; BMTrain's NCCL communicators "
            "do not exist in bmtwrap, so pass comm=None"
        )
    return _Comm(comm, dist.get_rank(comm), dist.get_world_size(comm))


def _check_tensor(x: Any, caller: str, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"bmt.distributed.{caller}: {name} must be a torch.Tensor, got {type(x).__name__}")


def _check_op(op: Any, allowed: Tuple[str, ...], caller: str) -> None:
    if op not in allowed:
        raise ValueError(f"bmt.distributed.{caller}: op must be one of {', '.join(map(repr, allowed))}, got {op!r}")


def _copy(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor equal to ``x`` (which may be non-contiguous)."""
    return x.clone(memory_format=torch.contiguous_format)


def _sum_op(op: str, x: torch.Tensor, comm: _Comm) -> Tuple[dist.ReduceOp, int]:
    """The torch op for ``op`` ("sum" or "avg") on ``x``, and what to divide its result by after."""
    if op == "sum":
        return dist.ReduceOp.SUM, 1
    # See [Note: averages]. A group may name a backend per device ("cpu:gloo,cuda:nccl").
    if x.is_cuda and "nccl" in dist.get_backend(comm.group):
        return dist.ReduceOp.AVG, 1
    return dist.ReduceOp.SUM, comm.world_size


def _divide(x: torch.Tensor, divisor: int) -> torch.Tensor:
    """``x /= divisor`` in place (truncating for integer dtypes); returns ``x``."""
    if divisor != 1:
        exact = x.is_floating_point() or x.is_complex()
        x.div_(divisor, rounding_mode=None if exact else "trunc")
    return x


def _all_reduce_(x: torch.Tensor, op: str, comm: _Comm) -> torch.Tensor:
    """Reduce the contiguous ``x`` over ``comm`` in place and return it."""
    if comm.world_size == 1:
        return x
    if op in ("sum", "avg"):
        torch_op, divisor = _sum_op(op, x, comm)
        dist.all_reduce(x, op=torch_op, group=comm.group)
        return _divide(x, divisor)
    dist.all_reduce(x, op=_TORCH_OP[op], group=comm.group)
    return x


def _gather(x: torch.Tensor, comm: _Comm) -> torch.Tensor:
    """Every rank's ``x`` stacked in rank order: shape ``(world_size, *x.shape)``."""
    x = x.contiguous()
    out = x.new_empty((comm.world_size, *x.shape))
    if comm.world_size == 1:
        out[0].copy_(x)
    else:
        # Flat views: gloo wants the output as the inputs concatenated along dim 0, NCCL any shape.
        all_gather_single(out.view(-1), x.view(-1), group=comm.group)
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, comm: _Comm) -> torch.Tensor:
        ctx.rank = comm.rank
        return _gather(x, comm)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return grad[ctx.rank], None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, op: str, comm: _Comm) -> torch.Tensor:
        out = _all_reduce_(_copy(x), op, comm)
        ctx.op, ctx.world_size = op, comm.world_size
        if ctx.needs_input_grad[0] and op in ("max", "min"):
            ctx.save_for_backward(x == out)  # where this rank holds the winning value
        elif ctx.needs_input_grad[0] and op == "prod":
            ctx.save_for_backward(out / x)  # d(prod)/dx; inf or nan where x is 0, as in BMTrain
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        if ctx.op == "sum":
            return grad, None, None
        if ctx.op == "avg":
            return grad / ctx.world_size, None, None
        (saved,) = ctx.saved_tensors
        if ctx.op == "prod":
            return grad * saved, None, None
        return grad.masked_fill(~saved, 0), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, op: str, comm: _Comm) -> torch.Tensor:
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // comm.world_size, *x.shape[1:]))
        ctx.op, ctx.comm = op, comm
        if comm.world_size == 1:
            return out.copy_(x)
        torch_op, divisor = _sum_op(op, x, comm)
        reduce_scatter_single(out.view(-1), x.view(-1), op=torch_op, group=comm.group)  # flat, as in _gather
        return _divide(out, divisor)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        full = _gather(grad, ctx.comm).flatten(0, 1)  # (world_size * n, ...): rank r's chunk at r * n
        if ctx.op == "avg":
            full = full / ctx.comm.world_size
        return full, None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, src: torch.Tensor, root: int, comm: _Comm) -> torch.Tensor:
        out = _copy(src)
        ctx.comm = comm
        if comm.world_size > 1:
            dist.broadcast(out, group=comm.group, group_src=root)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        return _all_reduce_(_copy(grad), "sum", ctx.comm), None, None


def all_gather(x: torch.Tensor, comm: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Every rank's ``x``, stacked in rank order; differentiable.

    Args:
        x: this rank's tensor; the same shape and dtype on every rank. May be non-contiguous.
        comm: ``None`` for the whole job's group, or a ``torch.distributed.ProcessGroup`` this
            rank belongs to (see [Note: comm] in this module).

    Returns:
        A new tensor of shape ``(world_size, *x.shape)`` whose ``[r]`` is rank ``r``'s ``x``. In
        backward, ``x`` receives only this rank's slice ``grad[rank]`` of the incoming gradient:
        nothing is reduced across ranks (each rank's loss is taken to be its own).

    Raises:
        RuntimeError: before :func:`bmtwrap.init_distributed`.
        TypeError: ``x`` is not a tensor, or ``comm`` is neither ``None`` nor a ProcessGroup.
        ValueError: ``comm`` is a group this rank is not a member of.

    Example::

        rows = bmt.distributed.all_gather(torch.full((2,), float(bmt.rank())))  # (world_size, 2)
    """
    c = _resolve(comm, "all_gather")
    _check_tensor(x, "all_gather")
    return _AllGather.apply(x, c)


def all_reduce(x: torch.Tensor, op: str = "sum", comm: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The elementwise reduction of every rank's ``x``; differentiable. ``x`` itself is left untouched.

    Args:
        x: this rank's tensor; the same shape and dtype on every rank. May be non-contiguous.
        op: ``"sum"`` (default), ``"avg"``, ``"max"``, ``"min"`` or ``"prod"``.
        comm: ``None`` for the whole job's group, or a ``torch.distributed.ProcessGroup`` this
            rank belongs to (see [Note: comm] in this module).

    Returns:
        A new tensor of ``x``'s shape, the same on every rank. Its backward gives ``x``:
        ``"sum"``: the incoming gradient unchanged; ``"avg"``: the gradient divided by the world
        size; ``"max"``/``"min"``: the gradient where this rank's ``x`` equals the result (on every
        rank that ties) and 0 elsewhere; ``"prod"``: ``grad * result / x`` (inf or nan where ``x``
        is 0). The gradient is not reduced across ranks, as in BMTrain.

    Raises:
        RuntimeError: before :func:`bmtwrap.init_distributed`.
        TypeError: ``x`` is not a tensor, or ``comm`` is neither ``None`` nor a ProcessGroup.
        ValueError: ``op`` is not one of the five above; ``comm`` is a group this rank is not in.

    Example::

        total = bmt.distributed.all_reduce(local_loss, "sum")
        top = bmt.distributed.all_reduce(scores, op="max")
    """
    c = _resolve(comm, "all_reduce")
    _check_tensor(x, "all_reduce")
    _check_op(op, _ALL_REDUCE_OPS, "all_reduce")
    return _AllReduce.apply(x, op, c)


def reduce_scatter(x: torch.Tensor, op: str = "sum", comm: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """This rank's chunk (along dim 0) of the reduction of every rank's ``x``; differentiable.

    Args:
        x: this rank's tensor, at least 1-D, with ``x.shape[0]`` divisible by the world size; the
            same shape and dtype on every rank. May be non-contiguous.
        op: ``"sum"`` (default) or ``"avg"``.
        comm: ``None`` for the whole job's group, or a ``torch.distributed.ProcessGroup`` this
            rank belongs to (see [Note: comm] in this module).

    Returns:
        A new tensor of shape ``(x.shape[0] // world_size, *x.shape[1:])``: rows
        ``rank * n : (rank + 1) * n`` of the reduction, ``n`` being that first size. In backward,
        every rank's incoming gradient is all-gathered along dim 0 (and divided by the world size
        for ``"avg"``) to give ``x``'s gradient.

    Raises:
        RuntimeError: before :func:`bmtwrap.init_distributed`.
        TypeError: ``x`` is not a tensor, or ``comm`` is neither ``None`` nor a ProcessGroup.
        ValueError: ``op`` is not ``"sum"`` or ``"avg"``; ``x`` is 0-dimensional or its first
            size is not divisible by the world size; ``comm`` is a group this rank is not in.

    Example::

        mine = bmt.distributed.reduce_scatter(torch.ones(4 * bmt.world_size(), 8), "sum")  # (4, 8)
    """
    c = _resolve(comm, "reduce_scatter")
    _check_tensor(x, "reduce_scatter")
    _check_op(op, _REDUCE_SCATTER_OPS, "reduce_scatter")
    if x.dim() == 0 or x.shape[0] % c.world_size:
        raise ValueError(
            f"bmt.distributed.reduce_scatter: x's first dimension must be divisible by the world size "
            f"{c.world_size}, got shape {tuple(x.shape)}; pad dim 0 to a multiple of {c.world_size}"
        )
    return _ReduceScatter.apply(x, op, c)


def broadcast(src: torch.Tensor, root: int, comm: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Rank ``root``'s ``src``, on every rank; differentiable.

    Args:
        src: the tensor to send on ``root``; on the other ranks a tensor of the same shape and
            dtype, whose values are ignored. May be non-contiguous.
        root: the sending rank, counted within ``comm``'s group.
        comm: ``None`` for the whole job's group, or a ``torch.distributed.ProcessGroup`` this
            rank belongs to (see [Note: comm] in this module).

    Returns:
        A new tensor equal to ``root``'s ``src``. In backward, every rank's incoming gradient is
        all-reduced (summed) and the total is returned to ``src`` on every rank, root or not, as
        BMTrain does.

    Raises:
        RuntimeError: before :func:`bmtwrap.init_distributed`.
        TypeError: ``src`` is not a tensor, or ``comm`` is neither ``None`` nor a ProcessGroup.
        ValueError: ``root`` is not a rank of the group; ``comm`` is a group this rank is not in.

    Example::

        weights = bmt.distributed.broadcast(weights, root=0)
    """
    c = _resolve(comm, "broadcast")
    _check_tensor(src, "broadcast", "src")
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < c.world_size:
        raise ValueError(f"bmt.distributed.broadcast: root must be a rank from 0 to {c.world_size - 1}, got {root!r}")
    return _Broadcast.apply(src, root, c)


def _no_pipeline(name: str) -> NoReturn:
    raise NotImplementedError(
        f"bmt.distributed.{name} is not available: pipeline parallelism is not supported by bmtwrap. "
        "Train in one process group without a pipeline (bmtwrap shards parameters over all ranks), "
        "or exchange tensors yourself with torch.distributed.send / torch.distributed.recv"
    )


def send_activations(hidden_state: torch.Tensor, next_rank: int, comm: Any) -> NoReturn:
    """BMTrain's pipeline send; raises ``NotImplementedError`` (bmtwrap has no pipeline parallelism).

    Args:
        hidden_state: ignored.
        next_rank: ignored.
        comm: ignored.

    Raises:
        NotImplementedError: always; the message names ``torch.distributed.send`` and training
            without a pipeline as the replacements.

    Example::

        torch.distributed.send(hidden_state.contiguous(), dst=next_rank)  # instead
    """
    _no_pipeline("send_activations")


def recv_activations(prev_rank: int, comm: Any) -> NoReturn:
    """BMTrain's pipeline receive; raises ``NotImplementedError`` (bmtwrap has no pipeline parallelism).

    Args:
        prev_rank: ignored.
        comm: ignored.

    Raises:
        NotImplementedError: always; the message names ``torch.distributed.recv`` and training
            without a pipeline as the replacements.

    Example::

        torch.distributed.recv(buffer, src=prev_rank)  # instead, into a buffer of known shape
    """
    _no_pipeline("recv_activations")


def gather_result(result: torch.Tensor) -> torch.Tensor:
    """Every rank's ``result`` concatenated along dimension 0, in rank order (BMTrain's name).

    A collective: every rank calls it with a tensor of the same shape and dtype. The result is on
    ``result``'s device (a CPU tensor goes through this process's device and comes back).

    Example::

        all_predictions = bmt.gather_result(predictions)   # (world_size * B, ...)
    """
    ctx = _dist.current()
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"gather_result expects a tensor, got {type(result).__name__}")
    local = result.detach().to(ctx.device).reshape(-1, *result.shape[1:]).contiguous()  # a scalar as (1,)
    out = torch.empty((ctx.world_size * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=ctx.device)
    all_gather_single(out.view(-1), local.view(-1), group=ctx.group)  # flat: gloo gathers 1-D tensors
    return out.to(result.device)
