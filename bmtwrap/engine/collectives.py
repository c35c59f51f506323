"""The collectives the engine issues, as free functions over ``torch.distributed``.

Each returns a handle whose ``wait()`` makes the caller's current stream (CUDA) or thread (CPU)
wait for the result. On CUDA, ProcessGroupNCCL runs the collective on its own stream, ordered
after the work already queued on the caller's stream when it was issued; everything queued on the
caller's stream afterwards runs concurrently with it. That is the overlap the engine relies on.

Each collective is counted and named (``label``: the flat buffer's) by the context's watchdog, so
that its failure raises :class:`bmtwrap.CollectiveError` naming the operation and the ranks at
fault (see ``bmtwrap/engine/watchdog.py``); with ``check_collectives`` every rank first checks that all
ranks issue the same one (:func:`agree`).

[Note: hybrid sharding]
``init_distributed(shard_size=S)`` cuts the world of W ranks into W / S shard groups of S
consecutive ranks (one node each, by default, when the job spans several). Each shard group holds
the whole model: every flat buffer is laid out over S ranks (``ctx.shard_size``), and a rank holds
piece ``ctx.shard_rank`` of it. The ranks with the same ``shard_rank`` (one per group: the replica
group) hold the same pieces. Gathers run in the shard group, so a block's parameters never cross
the slower links between nodes. A gradient is reduce-scattered in the shard group (the mean over
its S ranks), then the shard is averaged over the replica group (the mean of those means is the
mean over all W ranks): :func:`reduce_scatter_mean` returns one handle for the chain. On CUDA the
all-reduce is issued from ``ctx.reduce_stream()`` once the reduce-scatter is done, so the
computation waits for neither until the handle's ``wait()``; on gloo the chain runs in turn. The
replicas then apply the same update to the same shard with the same state, and stay identical;
what sums over shards (a gradient's norm, the count of non-finite values) sums over one shard
group, or over the world divided by the replicas. ``shard_size == world_size`` (the default on one
node) makes no sub-group and runs exactly as before: one reduce-scatter over the world.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .dist import DistContext
from .watchdog import CollectiveError, Operation, Peers, Watchdog, describe

__all__ = ["Pending", "agree", "all_gather", "reduce_scatter_mean", "all_reduce_mean", "tp_sum", "traffic"]

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """An issued collective: ``wait()`` once, then read its output.

    ``divisor`` is applied after the wait where the backend cannot average by itself. ``watch``:
    the watchdog that numbered the collective, its number, operation and peers (the ranks of its
    sub-group, ``None`` for every rank); the wait's failure then raises :class:`bmtwrap.CollectiveError`.
    """

    __slots__ = ("_work", "output", "_divisor", "_watch")

    def __init__(self, work: Optional[dist.Work], output: torch.Tensor, divisor: int = 1,
                 watch: Optional[Tuple[Watchdog, int, Operation, Optional[Peers]]] = None) -> None:
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
                watchdog, seq, op, peers = self._watch
                watchdog.wait(work, seq, op, peers)
            if self._divisor != 1:
                self.output.div_(self._divisor)
                self._divisor = 1
        return self.output


def traffic(ctx: DistContext, reset: bool = False) -> Dict[str, Tuple[int, float]]:
    """What the engine's collectives moved on this rank: {operation: (calls, bytes this rank sent)}, counting a
    ring's share (an all-gather or reduce-scatter of n bytes over g ranks: n (g - 1) / g; an all-reduce: twice
    that). ``reset``: start counting again."""
    out = {op: (int(calls), sent) for op, (calls, sent) in ctx.traffic.items()}
    if reset:
        ctx.traffic.clear()
    return out


def _count(ctx: DistContext, op: str, nbytes: int, ranks: int, factor: int = 1) -> None:
    entry = ctx.traffic.setdefault(op, [0, 0.0])
    entry[0] += 1
    entry[1] += factor * nbytes * (ranks - 1) / ranks


def _issue(ctx: DistContext, op: Operation, start: Callable[[], Pending], peers: Optional[Peers] = None) -> Pending:
    """Number ``op``, check it with the other ranks if asked, then ``start()`` it; a watched :class:`Pending`.

    ``peers``: the ranks of the sub-group it runs in (``None``: every rank), whom a failure blames first.
    """
    watchdog = ctx.watchdog
    if watchdog is None:
        return start()
    seq = watchdog.begin(op)
    if watchdog.check_collectives:
        agree(ctx, watchdog, seq, op)
    pending = start()
    pending._watch = (watchdog, seq, op, peers)
    return pending


def all_gather(ctx: DistContext, full: torch.Tensor, local: torch.Tensor, *, label: str = "") -> Pending:
    """Gather the ``local`` shards of this rank's shard group into ``full`` (``shard_size * local.numel()``
    elements; see [Note: hybrid sharding]).

    ``local`` may be this rank's slice of ``full`` itself (a gather in place). ``label`` names the
    buffer in errors.
    """
    assert full.numel() == local.numel() * ctx.shard_size, (
        f"rank {ctx.rank}: gather of {local.numel()} x {ctx.shard_size} into {full.numel()} elements"
    )
    if ctx.shard_size == 1:
        if full.data_ptr() != local.data_ptr():  # a gather in place needs no copy
            full.copy_(local)
        return Pending(None, full)
    _count(ctx, "all-gather", full.numel() * full.element_size(), ctx.shard_size)
    return _issue(ctx, ("all-gather", label),
                  lambda: Pending(all_gather_single(full, local, group=ctx.shard_group, async_op=True), full),
                  ctx.shard_peers)


def _mean_op(ctx: DistContext, size: int) -> tuple:
    # NCCL averages inside the collective; gloo only sums, so we divide after the wait.
    if ctx.device.type == "cuda":
        return dist.ReduceOp.AVG, 1
    return dist.ReduceOp.SUM, size


def reduce_scatter_mean(ctx: DistContext, shard: torch.Tensor, full: torch.Tensor, *, label: str = "",
                        one_stage: bool = False) -> Pending:
    """``shard`` = this rank's slice of the mean of every rank's ``full``; ``label`` names the buffer in errors.

    Under hybrid sharding, a reduce-scatter in the shard group and then an all-reduce of the shard over
    the replica group, as one handle (see [Note: hybrid sharding]). ``one_stage``: the buffer of a pipeline
    stage's layer, which the replica group's other ranks do not hold: divided by the replicas instead (see
    [Note: pipeline layout] in ``stages.py``).
    """
    assert full.numel() == shard.numel() * ctx.shard_size, (
        f"rank {ctx.rank}: reduce-scatter of {full.numel()} into {shard.numel()} x {ctx.shard_size} elements"
    )
    if ctx.shard_size == 1:
        if shard.data_ptr() != full.data_ptr():  # the caller may pass the full buffer as its own shard
            shard.copy_(full)
        if one_stage:
            shard.div_(ctx.replicas)
        scattered = Pending(None, shard)
    else:
        op, divisor = _mean_op(ctx, ctx.shard_size)
        _count(ctx, "reduce-scatter", full.numel() * full.element_size(), ctx.shard_size)
        scattered = _issue(ctx, ("reduce-scatter", label), lambda: Pending(
            reduce_scatter_single(shard, full, op=op, group=ctx.shard_group, async_op=True), shard,
            divisor * (ctx.replicas if one_stage else 1)), ctx.shard_peers)
    if ctx.replicas == 1 or one_stage:
        return scattered
    op, divisor = _mean_op(ctx, ctx.replicas)
    _count(ctx, "all-reduce over replicas", shard.numel() * shard.element_size(), ctx.replicas, factor=2)
    if ctx.device.type != "cuda":
        scattered.wait()
        return _issue(ctx, ("all-reduce", f"{label} over replicas"), lambda: Pending(
            dist.all_reduce(shard, op=op, group=ctx.replica_group, async_op=True), shard, divisor),
            ctx.replica_peers)
    # The side stream waits for the reduce-scatter and issues the all-reduce; the caller's stream waits
    # for the chain only in wait().
    side = ctx.reduce_stream()
    side.wait_stream(torch.cuda.current_stream(ctx.device))
    with torch.cuda.stream(side):
        scattered.wait()
        return _issue(ctx, ("all-reduce", f"{label} over replicas"), lambda: Pending(
            dist.all_reduce(shard, op=op, group=ctx.replica_group, async_op=True), shard, divisor),
            ctx.replica_peers)


def tp_sum(ctx: DistContext, full: torch.Tensor, keep: Sequence[Tuple[int, int]]) -> None:
    """Sum ``full`` (a flat gradient buffer) over the tensor-parallel group, in place, except the ``keep``
    ranges ``[start, end)``: the gradients of BMTrain's ``tp_mode`` parameters (see [Note: tensor
    parallelism] in ``bmtwrap/engine/tp.py``). Blocking.
    """
    kept = [full[start:end].clone() for start, end in keep]
    _count(ctx, "all-reduce over the tensor-parallel group", full.numel() * full.element_size(), ctx.tp_size,
           factor=2)
    _issue(ctx, ("all-reduce", "gradient over the tensor-parallel group"), lambda: Pending(
        dist.all_reduce(full, op=dist.ReduceOp.SUM, group=ctx.tp_group, async_op=True), full),
        tuple(range(ctx.rank - ctx.tp_rank, ctx.rank - ctx.tp_rank + ctx.tp_size))).wait()
    for (start, end), value in zip(keep, kept):
        full[start:end].copy_(value)


def all_reduce_mean(ctx: DistContext, tensor: torch.Tensor, *, label: str = "") -> Pending:
    """Average ``tensor`` over every rank, in place (a replicated tensor's gradient); ``label`` names it in errors."""
    if ctx.world_size == 1:
        return Pending(None, tensor)
    op, divisor = _mean_op(ctx, ctx.world_size)
    _count(ctx, "all-reduce of replicated parameters", tensor.numel() * tensor.element_size(), ctx.world_size, 2)
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
