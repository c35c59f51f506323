"""The collectives the engine issues, as free functions over ``torch.distributed``.

Each returns a handle whose ``wait()`` makes the caller's current stream (CUDA) or thread (CPU)
wait for the result. On CUDA, ProcessGroupNCCL runs the collective on its own stream, ordered
after the work already queued on the caller's stream when it was issued; everything queued on the
caller's stream afterwards runs concurrently with it. That is the overlap the engine relies on.

Each collective is counted and named (``label``: the flat buffer's) by the context's watchdog, so
that its failure raises :class:`bmtwrap.CollectiveError` naming the operation and the ranks at
fault (see ``bmtwrap/engine/watchdog.py``); with ``check_collectives`` every rank first checks that all
ranks issue the same one (:func:`agree`).
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .dist import DistContext
from .watchdog import CollectiveError, Operation, Watchdog, describe

__all__ = ["Pending", "agree", "all_gather", "reduce_scatter_mean", "all_reduce_mean"]

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """An issued collective: ``wait()`` once, then read its output.

    ``divisor`` is applied after the wait where the backend cannot average by itself. ``watch``:
    the watchdog that numbered the collective, its number and operation; the wait's failure then
    raises :class:`bmtwrap.CollectiveError`.
    """

    __slots__ = ("_work", "output", "_divisor", "_watch")

    def __init__(self, work: Optional[dist.Work], output: torch.Tensor, divisor: int = 1,
                 watch: Optional[Tuple[Watchdog, int, Operation]] = None) -> None:
        self._work = work
        self.output = output
        self._divisor = divisor
        self._watch = watch

    def wait(self) -> torch.Tensor:
        """Wait for the collective; returns its output.

        Raises:
            CollectiveError: the collective failed or timed out (a rank died or stopped taking part).
        """
        if self._work is not None:
            work, self._work = self._work, None
            if self._watch is None:
                work.wait()
            else:
                watchdog, seq, op = self._watch
                watchdog.wait(work, seq, op)
            if self._divisor != 1:
                self.output.div_(self._divisor)
                self._divisor = 1
        return self.output


def _issue(ctx: DistContext, op: Operation, start: Callable[[], Pending]) -> Pending:
    """Number ``op``, check it with the other ranks if asked, then ``start()`` it; a watched :class:`Pending`."""
    watchdog = ctx.watchdog
    if watchdog is None:
        return start()
    seq = watchdog.begin(op)
    if watchdog.check_collectives:
        agree(ctx, watchdog, seq, op)
    pending = start()
    pending._watch = (watchdog, seq, op)
    return pending


def all_gather(ctx: DistContext, full: torch.Tensor, local: torch.Tensor, *, label: str = "") -> Pending:
    """Gather every rank's ``local`` shard into ``full`` (``world_size * local.numel()`` elements).

    ``local`` may be this rank's slice of ``full`` itself (a gather in place). ``label`` names the
    buffer in errors.
    """
    assert full.numel() == local.numel() * ctx.world_size, (
        f"rank {ctx.rank}: gather of {local.numel()} x {ctx.world_size} into {full.numel()} elements"
    )
    if ctx.world_size == 1:
        if full.data_ptr() != local.data_ptr():  # a gather in place needs no copy
            full.copy_(local)
        return Pending(None, full)
    return _issue(ctx, ("all-gather", label),
                  lambda: Pending(all_gather_single(full, local, group=ctx.group, async_op=True), full))


def _mean_op(ctx: DistContext) -> tuple:
    # NCCL averages inside the collective; gloo only sums, so we divide after the wait.
    if ctx.device.type == "cuda":
        return dist.ReduceOp.AVG, 1
    return dist.ReduceOp.SUM, ctx.world_size


def reduce_scatter_mean(ctx: DistContext, shard: torch.Tensor, full: torch.Tensor, *, label: str = "") -> Pending:
    """``shard`` = this rank's slice of the mean of every rank's ``full``; ``label`` names the buffer in errors."""
    assert full.numel() == shard.numel() * ctx.world_size, (
        f"rank {ctx.rank}: reduce-scatter of {full.numel()} into {shard.numel()} x {ctx.world_size} elements"
    )
    if ctx.world_size == 1:
        shard.copy_(full)
        return Pending(None, shard)
    op, divisor = _mean_op(ctx)
    return _issue(ctx, ("reduce-scatter", label), lambda: Pending(
        reduce_scatter_single(shard, full, op=op, group=ctx.group, async_op=True), shard, divisor))


def all_reduce_mean(ctx: DistContext, tensor: torch.Tensor, *, label: str = "") -> Pending:
    """Average ``tensor`` over ranks, in place; ``label`` names it in errors."""
    if ctx.world_size == 1:
        return Pending(None, tensor)
    op, divisor = _mean_op(ctx)
    return _issue(ctx, ("all-reduce", label),
                  lambda: Pending(dist.all_reduce(tensor, op=op, group=ctx.group, async_op=True), tensor, divisor))


def agree(ctx: DistContext, watchdog: Watchdog, seq: int, op: Operation) -> None:
    """``check_collectives``: every rank is about to issue ``op`` as its collective number ``seq``.

    A collective itself (every rank calls it before each engine collective): the ranks all-gather
    (number, checksum of the operation); where they differ, they all-gather the operations' text
    and every rank raises the same error.

    Raises:
        CollectiveError: the ranks issue different collectives; the message lists each operation and
            the ranks that issue it.
    """
    text = describe(op)
    mine = torch.tensor([seq, zlib.crc32(text.encode())], dtype=torch.int64, device=ctx.device)
    every = torch.empty(2 * ctx.world_size, dtype=torch.int64, device=ctx.device)
    watchdog.wait(all_gather_single(every, mine, group=ctx.group, async_op=True), seq, op)
    rows = every.view(ctx.world_size, 2).tolist()
    if all(row == rows[ctx.rank] for row in rows):
        return
    issued: List[Any] = [None] * ctx.world_size
    with ctx.watched("all-gather", "check_collectives"):
        dist.all_gather_object(issued, (seq, text), group=ctx.group)
    by_operation: dict = {}
    for rank, (number, what) in enumerate(issued):
        by_operation.setdefault((number, what), []).append(rank)
    sides = "; ".join(f"{_ranks(ranks)} run{'s' if len(ranks) == 1 else ''} #{number}, {what}"
                      for (number, what), ranks in by_operation.items())
    others = [r for r, entry in enumerate(issued) if tuple(entry) != (seq, text)]
    raise CollectiveError(
        f"the ranks issue different collectives (found by check_collectives=True): {sides}. Every rank must run the "
        "same blocks in the same order in a step; look for control flow that depends on the rank or its data "
        "(a skipped layer, an early exit, a block run twice).",
        operation=text, ranks=others)


def _ranks(ranks: List[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"
