"""The collectives the engine issues, as free functions over ``torch.distributed``.

Each returns a handle whose ``wait()`` makes the caller's current stream (CUDA) or thread (CPU)
wait for the result. On CUDA, ProcessGroupNCCL runs the collective on its own stream, ordered
after the work already queued on the caller's stream when it was issued; everything queued on the
caller's stream afterwards runs concurrently with it. That is the overlap the engine relies on.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .dist import DistContext

__all__ = ["Pending", "all_gather", "reduce_scatter_mean", "all_reduce_mean"]

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """An issued collective: ``wait()`` once, then read its output.

    ``divisor`` is applied after the wait where the backend cannot average by itself.
    """

    __slots__ = ("_work", "output", "_divisor")

    def __init__(self, work: Optional[dist.Work], output: torch.Tensor, divisor: int = 1) -> None:
        self._work = work
        self.output = output
        self._divisor = divisor

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._divisor != 1:
                self.output.div_(self._divisor)
                self._divisor = 1
        return self.output


def all_gather(ctx: DistContext, full: torch.Tensor, local: torch.Tensor) -> Pending:
    """Gather every rank's ``local`` shard into ``full`` (``world_size * local.numel()`` elements).

    ``local`` may be this rank's slice of ``full`` itself (a gather in place).
    """
    assert full.numel() == local.numel() * ctx.world_size, (
        f"rank {ctx.rank}: gather of {local.numel()} x {ctx.world_size} into {full.numel()} elements"
    )
    if ctx.world_size == 1:
        if full.data_ptr() != local.data_ptr():  # a gather in place needs no copy
            full.copy_(local)
        return Pending(None, full)
    work = all_gather_single(full, local, group=ctx.group, async_op=True)
    return Pending(work, full)


def _mean_op(ctx: DistContext) -> tuple:
    # NCCL averages inside the collective; gloo only sums, so we divide after the wait.
    if ctx.device.type == "cuda":
        return dist.ReduceOp.AVG, 1
    return dist.ReduceOp.SUM, ctx.world_size


def reduce_scatter_mean(ctx: DistContext, shard: torch.Tensor, full: torch.Tensor) -> Pending:
    """``shard`` = this rank's slice of the mean of every rank's ``full``."""
    assert full.numel() == shard.numel() * ctx.world_size, (
        f"rank {ctx.rank}: reduce-scatter of {full.numel()} into {shard.numel()} x {ctx.world_size} elements"
    )
    if ctx.world_size == 1:
        shard.copy_(full)
        return Pending(None, shard)
    op, divisor = _mean_op(ctx)
    work = reduce_scatter_single(shard, full, op=op, group=ctx.group, async_op=True)
    return Pending(work, shard, divisor)


def all_reduce_mean(ctx: DistContext, tensor: torch.Tensor) -> Pending:
    """Average ``tensor`` over ranks, in place."""
    if ctx.world_size == 1:
        return Pending(None, tensor)
    op, divisor = _mean_op(ctx)
    work = dist.all_reduce(tensor, op=op, group=ctx.group, async_op=True)
    return Pending(work, tensor, divisor)
