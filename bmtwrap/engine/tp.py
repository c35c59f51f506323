"""Tensor parallelism: the autograd functions BMTrain's tensor-parallel layers are made of.

Each function moves activations between the ranks of this rank's tensor-parallel group
(``init_distributed(tp_size=T)``, ``ctx.tp_group``) in forward, and their gradients back in
backward. With ``tp_size`` 1 every one of them is the identity, so a model built from them runs
unchanged in one process.

[Note: tensor parallelism]
BMTrain's layout, which these functions keep: an activation between layers is one of

    rows     (S) each rank of the group holds its own rows (dimension 0) of the tensor;
    columns  (F) each rank holds its own slice of the last dimension (a column-parallel output,
                 vocabulary-parallel logits);
    whole    (R) every rank holds all of it.

A gradient is held the same way, with one rule for ``whole`` tensors: the gradient each rank holds
is the true one (the loss is the same on every rank, and each rank calls ``backward()`` on it). A
function whose forward joins the group's pieces into a whole tensor receives, in backward, the
gradient of the whole and hands each rank the true gradient of its piece.

Parameters follow: one made with ``DistributedParameter(tp_mode=True)`` (a column or row slice,
a vocabulary slice, or a row-parallel bias after an all-reduce) is used on whole or column
tensors, so its gradient on each rank is already the true one; every other parameter is used on
row pieces (BMTrain's models cut the embedding's output to the rank's rows and keep every norm and
bias of the blocks on rows), so the true gradient is the sum of the group's. The engine therefore
sums the gradients of parameters not in ``tp_mode`` over the tensor-parallel group before the
reduce-scatter (``collectives.tp_sum``), and shards every parameter over the ranks with the same
tensor-parallel place (the ``shard`` group, BMTrain's ``tp_zero_comm``): the group's ranks hold
different slices, so none replicates another.

Hugging Face's layout (``wrap(model, tp_size=T)``, from the model's ``tp_plan``; see
``bmtwrap/wrap/tensor_parallel.py``) keeps every activation between layers whole: a colwise linear
takes the whole input (:func:`copy_whole`) and gives this rank's columns (its attention heads, its
slice of the MLP), a rowwise one takes those columns and all-reduces its output
(:func:`all_reduce_whole`). Norms, biases of rowwise layers and the LM head are used on whole
tensors, so every rank of the group already holds their true gradient, and the split weights'
gradients are their slices' true ones: nothing is summed over the group. A buffer says which
layout its parameters follow (:class:`TpLayout`); only ``ROWS`` sums.
"""

from __future__ import annotations

import enum
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from . import dist as _dist

__all__ = ["TpLayout", "all_reduce_whole", "copy_whole", "gather_along", "gather_columns", "gather_rows",
           "gather_rows_split_columns", "own_rows", "parallel_cross_entropy", "reduce_scatter_rows"]


class TpLayout(enum.Enum):
    """How activations lie between the layers of a flat buffer's parameters (see [Note: tensor parallelism])."""

    ROWS = "rows"  # BMTrain's: on rows; gradients of parameters not in tp_mode are summed over the group
    WHOLE = "whole"  # Hugging Face's: whole on every rank; every rank's gradient is already the true one


def _size() -> int:
    return _dist.current().tp_size


def _gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Every rank's ``x`` of the group, joined along ``dim`` in rank order."""
    ctx = _dist.current()
    if ctx.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(ctx.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=ctx.tp_group)
    return torch.cat(parts, dim=dim)


def _all_reduce(x: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    ctx = _dist.current()
    if ctx.tp_size == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, op=op, group=ctx.tp_group)
    return out


def _own(x: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's piece of ``x`` along ``dim`` (the size must divide by ``tp_size``)."""
    ctx = _dist.current()
    if x.shape[dim] % ctx.tp_size:
        raise ValueError(f"tensor parallelism: dimension {dim} of a tensor of shape {tuple(x.shape)} does not divide "
                         f"among tp_size={ctx.tp_size} ranks; give sizes that are multiples of {ctx.tp_size}")
    return x.chunk(ctx.tp_size, dim=dim)[ctx.tp_rank].contiguous()


def _reduce_scatter_rows(x: torch.Tensor) -> torch.Tensor:
    """The sum over the group of ``x``, this rank's rows of it."""
    return _own(_all_reduce(x), 0) if _size() > 1 else x


class _GatherRows(torch.autograd.Function):
    """rows -> whole (forward: all-gather along dimension 0). The gradient of the whole coming back is each
    rank's part of a sum (it went through this rank's slice of a parallel weight): summed, then cut to rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _gather(x, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _reduce_scatter_rows(grad)


class _GatherRowsSplitColumns(torch.autograd.Function):
    """rows of whole columns -> every row, this rank's columns (a row-parallel layer's ``split_input``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _own(_gather(x, 0), -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _own(_gather(grad, -1), 0)


class _ReduceScatterRows(torch.autograd.Function):
    """partial sums -> rows (each rank's rows of the group's sum); backward gathers the rows' true gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _reduce_scatter_rows(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _gather(grad, 0)


class _OwnRows(torch.autograd.Function):
    """whole -> this rank's rows, the rest computed by the other ranks; backward gathers the rows' gradients into
    the whole's (each rank's rows went through its own computation only)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _own(x, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _gather(grad, 0)


class _AllReduceWhole(torch.autograd.Function):
    """partial sums -> whole (the group's sum); the whole's gradient is the true one on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _CopyWhole(torch.autograd.Function):
    """whole -> whole, used through a parallel slice: forward is the identity, backward sums the parts."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _all_reduce(grad)


class _GatherColumns(torch.autograd.Function):
    """columns -> whole (all-gather along the last dimension); backward keeps this rank's columns."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _gather(x, -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _own(grad, -1) if _size() > 1 else grad


def gather_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The group's ``x`` joined along ``dim``, without autograd (checkpoints: a split parameter made whole)."""
    return _gather(x.detach(), dim)


def gather_rows(x: torch.Tensor) -> torch.Tensor:
    """The group's rows of ``x`` joined along dimension 0 (rows -> whole; see [Note: tensor parallelism])."""
    return _GatherRows.apply(x)


def gather_rows_split_columns(x: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of ``x`` joined, then this rank's slice of the last dimension."""
    return _GatherRowsSplitColumns.apply(x)


def reduce_scatter_rows(x: torch.Tensor) -> torch.Tensor:
    """This rank's rows of the group's sum of ``x`` (partial sums -> rows)."""
    return _ReduceScatterRows.apply(x)


def own_rows(x: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a whole ``x`` (the rows must divide among the group), for work split by rows; the
    whole's gradient is the rows' gradients gathered."""
    return _OwnRows.apply(x)


def all_reduce_whole(x: torch.Tensor) -> torch.Tensor:
    """The group's sum of ``x`` (partial sums -> whole)."""
    return _AllReduceWhole.apply(x)


def copy_whole(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself, whose gradient will come back in parts, one per rank's slice of a weight."""
    return _CopyWhole.apply(x)


def gather_columns(x: torch.Tensor) -> torch.Tensor:
    """The group's slices of ``x``'s last dimension, joined (columns -> whole)."""
    return _GatherColumns.apply(x)


class _ParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy per row of vocabulary-parallel logits: ``lse(z) - (1 - eps) z[t] - eps mean(z)``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                label_smoothing: float) -> torch.Tensor:
        z = logits.float()  # (N, V / T)
        part = z.shape[-1]
        vocab = part * _size()
        start = _dist.current().tp_rank * part
        top = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX)  # (N,)
        exp = torch.exp(z - top.unsqueeze(-1))
        total = _all_reduce(exp.sum(dim=-1))
        lse = top + torch.log(total)
        local = target - start
        mine = (local >= 0) & (local < part)
        index = torch.where(mine, local, torch.zeros_like(local)).long()
        picked = torch.where(mine, z.gather(-1, index.unsqueeze(-1)).squeeze(-1), torch.zeros_like(lse))
        loss = lse - (1.0 - label_smoothing) * _all_reduce(picked)
        if label_smoothing:
            loss = loss - label_smoothing * _all_reduce(z.sum(dim=-1)) / vocab
        kept = target != ignore_index
        loss = torch.where(kept, loss, torch.zeros_like(loss))
        ctx.save_for_backward(exp / total.unsqueeze(-1), index, mine & kept, kept)
        ctx.label_smoothing, ctx.vocab, ctx.dtype = label_smoothing, vocab, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        softmax, index, mine, kept = ctx.saved_tensors
        eps = ctx.label_smoothing
        out = softmax - eps / ctx.vocab
        out.scatter_add_(-1, index.unsqueeze(-1), -(1.0 - eps) * mine.to(out.dtype).unsqueeze(-1))
        out = out * (grad * kept.to(grad.dtype)).unsqueeze(-1)
        return out.to(ctx.dtype), None, None, None


def parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                           label_smoothing: float = 0.0) -> torch.Tensor:
    """The fp32 cross-entropy of each row of ``logits`` (N, V / T), this rank's slice of the vocabulary
    (rank ``r`` holds classes ``r * V / T`` to ``(r + 1) * V / T - 1``), against ``target`` (N), the same
    on every rank of the group; 0 where ``target == ignore_index``. The same on every rank of the group."""
    return _ParallelCrossEntropy.apply(logits, target, ignore_index, label_smoothing)
