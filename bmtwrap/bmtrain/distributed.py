"""``bmt.distributed``: BMTrain's autograd-aware collectives, over ``torch.distributed``.

BMTrain 1.0.1 offers :func:`all_gather`, :func:`all_reduce`, :func:`reduce_scatter` and
:func:`broadcast` as differentiable functions: each returns a new tensor and, in backward, sends
the gradient back across ranks the way the chain rule asks (an all-gather's gradient is this rank's
slice; a broadcast's is the sum of every rank's gradient). They are for model code written by hand,
such as a loss computed over the whole job; the engine's own gathers and reductions live in
:mod:`bmtwrap.engine.collectives` and are not autograd-aware. Beside them: BMTrain's pipeline hand-over
(:func:`send_activations`, :func:`recv_activations`) and its object collectives (:func:`allgather_object`,
:func:`broadcast_object`, which BMTrain keeps in ``bmtrain.store``).

Every function here must be called by every rank of the group, in the same order, with tensors of
the same shape and dtype on every rank. CUDA tensors go through NCCL, CPU tensors through gloo; a
world of one copies locally.

[Note: comm]
BMTrain's ``comm`` argument takes one of its communicators (``bmt.config["comm"]``, ``["zero_comm"]``,
``["tp_comm"]``, ...). Here ``comm`` is such a :class:`~bmtwrap.bmtrain.comm.Communicator`, ``None``
(every rank, ``bmt.config["comm"]``), or a ``torch.distributed.ProcessGroup`` (for example made by
``torch.distributed.new_group``); ranks, the world size and ``broadcast``'s ``root`` are counted within
that group. A communicator of one rank (``tp_comm``, ``pipe_comm``) runs locally. Anything else raises
``TypeError``.

[Note: averages]
NCCL averages inside the collective. gloo has no AVG, so for CPU tensors the sum is divided by the
world size afterwards, integer tensors with truncation toward zero (as C's integer division).

[Note: second derivatives]
As in BMTrain, the backward of each function is not itself differentiable: differentiating
through it twice (``create_graph=True`` and a second backward) raises torch's ``RuntimeError``.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, List, Mapping, Tuple

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx, once_differentiable

from ..engine import dist as _dist
from ..engine.collectives import all_gather_single, reduce_scatter_single
from .comm import CommLike, Communicator, as_communicator

__all__ = ["all_gather", "all_gather_object", "all_reduce", "allgather_object", "broadcast", "broadcast_object",
           "gather_result", "recv_activations", "reduce_scatter", "send_activations"]

_ALL_REDUCE_OPS = ("sum", "avg", "max", "min", "prod")  # BMTrain's names
_REDUCE_SCATTER_OPS = ("sum", "avg")
_TORCH_OP: Mapping[str, dist.ReduceOp] = MappingProxyType({
    "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT,
})  # "sum" and "avg": see _sum_op and [Note: averages]


def _resolve(comm: CommLike, caller: str) -> Communicator:
    """``comm`` as a :class:`Communicator` (see [Note: comm]); raises RuntimeError before init_distributed."""
    return as_communicator(comm, f"bmt.distributed.{caller}")


def _check_tensor(x: Any, caller: str, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"bmt.distributed.{caller}: {name} must be a torch.Tensor, got {type(x).__name__}")


def _check_op(op: Any, allowed: Tuple[str, ...], caller: str) -> None:
    if op not in allowed:
        raise ValueError(f"bmt.distributed.{caller}: op must be one of {', '.join(map(repr, allowed))}, got {op!r}")


def _copy(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor equal to ``x`` (which may be non-contiguous)."""
    return x.clone(memory_format=torch.contiguous_format)


def _sum_op(op: str, x: torch.Tensor, comm: Communicator) -> Tuple[dist.ReduceOp, int]:
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


def _all_reduce_(x: torch.Tensor, op: str, comm: Communicator) -> torch.Tensor:
    """Reduce the contiguous ``x`` over ``comm`` in place and return it."""
    if comm.world_size == 1:
        return x
    if op in ("sum", "avg"):
        torch_op, divisor = _sum_op(op, x, comm)
        dist.all_reduce(x, op=torch_op, group=comm.group)
        return _divide(x, divisor)
    dist.all_reduce(x, op=_TORCH_OP[op], group=comm.group)
    return x


def _gather(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
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
    def forward(ctx: FunctionCtx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.rank = comm.rank
        return _gather(x, comm)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return grad[ctx.rank], None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, op: str, comm: Communicator) -> torch.Tensor:
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
    def forward(ctx: FunctionCtx, x: torch.Tensor, op: str, comm: Communicator) -> torch.Tensor:
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
    def forward(ctx: FunctionCtx, src: torch.Tensor, root: int, comm: Communicator) -> torch.Tensor:
        out = _copy(src)
        ctx.comm = comm
        if comm.world_size > 1:
            dist.broadcast(out, group=comm.group, group_src=root)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        return _all_reduce_(_copy(grad), "sum", ctx.comm), None, None


def all_gather(x: torch.Tensor, comm: CommLike = None) -> torch.Tensor:
    """Every rank's ``x``, stacked in rank order; differentiable.

    Args:
        x: this rank's tensor; the same shape and dtype on every rank. May be non-contiguous.
        comm: a communicator of ``bmt.config`` (``bmt.config["zero_comm"]``, ...), ``None`` for every
            rank, or a ``torch.distributed.ProcessGroup`` this rank belongs to (see [Note: comm] in this module).

    Returns:
        A new tensor of shape ``(world_size, *x.shape)`` whose ``[r]`` is rank ``r``'s ``x``. In
        backward, ``x`` receives only this rank's slice ``grad[rank]`` of the incoming gradient:
        nothing is reduced across ranks (each rank's loss is taken to be its own).

    Raises:
        RuntimeError: before :func:`bmtwrap.init_distributed`.
        TypeError: ``x`` is not a tensor, or ``comm`` is not a communicator, ``None`` or a ProcessGroup.
        ValueError: ``comm`` is a group this rank is not a member of.

    Example::

        rows = bmt.distributed.all_gather(torch.full((2,), float(bmt.rank())))  # (world_size, 2)
    """
    c = _resolve(comm, "all_gather")
    _check_tensor(x, "all_gather")
    return _AllGather.apply(x, c)


def all_reduce(x: torch.Tensor, op: str = "sum", comm: CommLike = None) -> torch.Tensor:
    """The elementwise reduction of every rank's ``x``; differentiable. ``x`` itself is left untouched.

    Args:
        x: this rank's tensor; the same shape and dtype on every rank. May be non-contiguous.
        op: ``"sum"`` (default), ``"avg"``, ``"max"``, ``"min"`` or ``"prod"``.
        comm: a communicator of ``bmt.config`` (``bmt.config["zero_comm"]``, ...), ``None`` for every
            rank, or a ``torch.distributed.ProcessGroup`` this rank belongs to (see [Note: comm] in this module).

    Returns:
        A new tensor of ``x``'s shape, the same on every rank. Its backward gives ``x``:
        ``"sum"``: the incoming gradient unchanged; ``"avg"``: the gradient divided by the world
        size; ``"max"``/``"min"``: the gradient where this rank's ``x`` equals the result (on every
        rank that ties) and 0 elsewhere; ``"prod"``: ``grad * result / x`` (inf or nan where ``x``
        is 0). The gradient is not reduced across ranks, as in BMTrain.

    Raises:
        RuntimeError: before :func:`bmtwrap.init_distributed`.
        TypeError: ``x`` is not a tensor, or ``comm`` is not a communicator, ``None`` or a ProcessGroup.
        ValueError: ``op`` is not one of the five above; ``comm`` is a group this rank is not in.

    Example::

        total = bmt.distributed.all_reduce(local_loss, "sum")
        top = bmt.distributed.all_reduce(scores, op="max")
    """
    c = _resolve(comm, "all_reduce")
    _check_tensor(x, "all_reduce")
    _check_op(op, _ALL_REDUCE_OPS, "all_reduce")
    return _AllReduce.apply(x, op, c)


def reduce_scatter(x: torch.Tensor, op: str = "sum", comm: CommLike = None) -> torch.Tensor:
    """This rank's chunk (along dim 0) of the reduction of every rank's ``x``; differentiable.

    Args:
        x: this rank's tensor, at least 1-D, with ``x.shape[0]`` divisible by the world size; the
            same shape and dtype on every rank. May be non-contiguous.
        op: ``"sum"`` (default) or ``"avg"``.
        comm: a communicator of ``bmt.config`` (``bmt.config["zero_comm"]``, ...), ``None`` for every
            rank, or a ``torch.distributed.ProcessGroup`` this rank belongs to (see [Note: comm] in this module).

    Returns:
        A new tensor of shape ``(x.shape[0] // world_size, *x.shape[1:])``: rows
        ``rank * n : (rank + 1) * n`` of the reduction, ``n`` being that first size. In backward,
        every rank's incoming gradient is all-gathered along dim 0 (and divided by the world size
        for ``"avg"``) to give ``x``'s gradient.

    Raises:
        RuntimeError: before :func:`bmtwrap.init_distributed`.
        TypeError: ``x`` is not a tensor, or ``comm`` is not a communicator, ``None`` or a ProcessGroup.
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


def broadcast(src: torch.Tensor, root: int, comm: CommLike = None) -> torch.Tensor:
    """Rank ``root``'s ``src``, on every rank; differentiable.

    Args:
        src: the tensor to send on ``root``; on the other ranks a tensor of the same shape and
            dtype, whose values are ignored. May be non-contiguous.
        root: the sending rank, counted within ``comm``'s group.
        comm: a communicator of ``bmt.config`` (``bmt.config["zero_comm"]``, ...), ``None`` for every
            rank, or a ``torch.distributed.ProcessGroup`` this rank belongs to (see [Note: comm] in this module).

    Returns:
        A new tensor equal to ``root``'s ``src``. In backward, every rank's incoming gradient is
        all-reduced (summed) and the total is returned to ``src`` on every rank, root or not, as
        BMTrain does.

    Raises:
        RuntimeError: before :func:`bmtwrap.init_distributed`.
        TypeError: ``src`` is not a tensor, or ``comm`` is not a communicator, ``None`` or a ProcessGroup.
        ValueError: ``root`` is not a rank of the group; ``comm`` is a group this rank is not in.

    Example::

        weights = bmt.distributed.broadcast(weights, root=0)
    """
    c = _resolve(comm, "broadcast")
    _check_tensor(src, "broadcast", "src")
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < c.world_size:
        raise ValueError(f"bmt.distributed.broadcast: root must be a rank from 0 to {c.world_size - 1}, got {root!r}")
    return _Broadcast.apply(src, root, c)


# BMTrain's order of the dtypes an activation may have; the receiver learns a tensor's dtype by its index here.
_ACTIVATION_DTYPES = (torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                      torch.int8, torch.bfloat16, torch.bool)
_META_LENGTH = 50  # (number of dimensions, dtype index, *shape), padded: up to 48 dimensions


def _peer(comm: Communicator, peer: Any, caller: str, name: str) -> int:
    """``peer`` checked as another rank of ``comm``; its global rank."""
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < comm.size or peer == comm.rank:
        raise ValueError(
            f"bmt.distributed.{caller}: {name} must be another rank of the communicator (0 to {comm.size - 1}, "
            f"not this rank {comm.rank}), got {peer!r}; ranks are counted within comm, e.g. "
            "bmt.config['pipe_comm']")
    return comm.global_rank(peer)


def send_activations(hidden_state: torch.Tensor, next_rank: int, comm: CommLike) -> None:
    """Send ``hidden_state`` to rank ``next_rank`` of ``comm``, which receives it with :func:`recv_activations`.

    BMTrain's pipeline hand-over: the receiver learns the shape and dtype from a small message sent
    first, so it needs to know neither. Blocks until the receiver has taken both messages (gloo) or
    they are queued on the current stream (NCCL).

    Args:
        hidden_state: the tensor to send, of one of BMTrain's dtypes (float64/32/16, bfloat16,
            int64/32/16/8, bool) and at most 48 dimensions. May be non-contiguous.
        next_rank: the receiving rank, counted within ``comm``.
        comm: a communicator of ``bmt.config``, ``None`` (every rank) or a ProcessGroup.

    Raises:
        TypeError: ``hidden_state`` is not a tensor, has another dtype, or ``comm`` is not a communicator.
        ValueError: ``next_rank`` is not another rank of ``comm``; more than 48 dimensions.

    Example::

        if bmt.rank() == 0:
            bmt.distributed.send_activations(hidden, 1, bmt.config["comm"])
        else:
            hidden = bmt.distributed.recv_activations(0, bmt.config["comm"])
    """
    c = _resolve(comm, "send_activations")
    _check_tensor(hidden_state, "send_activations", "hidden_state")
    dst = _peer(c, next_rank, "send_activations", "next_rank")
    if hidden_state.dtype not in _ACTIVATION_DTYPES or hidden_state.dim() > _META_LENGTH - 2:
        raise (TypeError if hidden_state.dim() <= _META_LENGTH - 2 else ValueError)(
            f"bmt.distributed.send_activations: hidden_state must have one of the dtypes "
            f"{', '.join(map(str, _ACTIVATION_DTYPES))} and at most {_META_LENGTH - 2} dimensions, got "
            f"{hidden_state.dtype} with {hidden_state.dim()}")
    meta = torch.zeros(_META_LENGTH, dtype=torch.int64, device=hidden_state.device)
    shape = [hidden_state.dim(), _ACTIVATION_DTYPES.index(hidden_state.dtype), *hidden_state.shape]
    meta[:len(shape)] = torch.tensor(shape, dtype=torch.int64)
    dist.send(meta, dst=dst, group=c.group)
    dist.send(hidden_state.contiguous(), dst=dst, group=c.group)


def recv_activations(prev_rank: int, comm: CommLike) -> torch.Tensor:
    """The tensor rank ``prev_rank`` of ``comm`` sends with :func:`send_activations`, on this process's device.

    Args:
        prev_rank: the sending rank, counted within ``comm``.
        comm: a communicator of ``bmt.config``, ``None`` (every rank) or a ProcessGroup.

    Returns:
        A new tensor of the sender's shape and dtype, on the device bmtwrap runs on (the GPU, or the CPU).

    Raises:
        TypeError: ``comm`` is not a communicator, ``None`` or a ProcessGroup.
        ValueError: ``prev_rank`` is not another rank of ``comm``.

    Example::

        hidden = bmt.distributed.recv_activations(stage - 1, bmt.config["pipe_comm"])
    """
    c = _resolve(comm, "recv_activations")
    src = _peer(c, prev_rank, "recv_activations", "prev_rank")
    device = _dist.current().device
    meta = torch.zeros(_META_LENGTH, dtype=torch.int64, device=device)
    dist.recv(meta, src=src, group=c.group)
    ndim, dtype, *shape = meta.tolist()
    hidden_state = torch.empty(shape[:ndim], dtype=_ACTIVATION_DTYPES[dtype], device=device)
    dist.recv(hidden_state, src=src, group=c.group)
    return hidden_state


def allgather_object(obj: Any, comm: CommLike = None) -> List[Any]:
    """Every rank's ``obj`` (any picklable object), in rank order (BMTrain's ``bmtrain.store.allgather_object``).

    Args:
        obj: this rank's object.
        comm: a communicator of ``bmt.config``, ``None`` (every rank) or a ProcessGroup.

    Returns:
        A list with one object per rank of ``comm``, the same on every rank.

    Raises:
        TypeError: ``comm`` is not a communicator, ``None`` or a ProcessGroup.

    Example::

        assert bmt.distributed.allgather_object(bmt.rank(), bmt.config["comm"]) == list(range(bmt.world_size()))
    """
    c = _resolve(comm, "allgather_object")
    if c.size == 1:
        return [obj]
    gathered: List[Any] = [None] * c.size
    dist.all_gather_object(gathered, obj, group=c.group)
    return gathered


all_gather_object = allgather_object
"""torch.distributed's spelling of :func:`allgather_object` (the same function)."""


def broadcast_object(obj: Any, comm: CommLike = None, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` (any picklable object), on every rank (BMTrain's ``bmtrain.store.broadcast_object``).

    Args:
        obj: the object to send on ``src``; ignored on the other ranks.
        comm: a communicator of ``bmt.config``, ``None`` (every rank) or a ProcessGroup.
        src: the sending rank, counted within ``comm``.

    Raises:
        TypeError: ``comm`` is not a communicator, ``None`` or a ProcessGroup.
        ValueError: ``src`` is not a rank of ``comm``.

    Example::

        settings = bmt.distributed.broadcast_object(settings if bmt.rank() == 0 else None, bmt.config["comm"])
    """
    c = _resolve(comm, "broadcast_object")
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < c.size:
        raise ValueError(f"bmt.distributed.broadcast_object: src must be a rank from 0 to {c.size - 1}, got {src!r}")
    if c.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=c.global_rank(src), group=c.group)
    return box[0]


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
