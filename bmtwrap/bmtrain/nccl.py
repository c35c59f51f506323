"""``bmt.nccl``: BMTrain's NCCL entry points, run on ``torch.distributed`` process groups.

BMTrain binds NCCL itself; bmtwrap ships no binding and runs each call on the communicator's
``torch.distributed`` group instead (NCCL on GPUs, gloo on CPUs), with BMTrain's signatures and
meaning: buffers are storages (``tensor.storage()``, ``tensor.untyped_storage()``) or tensors, ranks
(``root``, ``peer``) are counted within the communicator, ``src is dst`` works in place, and
``groupStart()``/``groupEnd()`` batch point-to-point calls.

[Note: buffers]
BMTrain hands NCCL the whole memory of a storage. Here a buffer becomes a flat tensor: a tensor's
own elements (a non-contiguous one through a contiguous copy, copied back into it when written), or
a view of a storage's whole memory. A typed storage gives its dtype; an untyped one has none, so it
takes the other buffer's dtype, or is read as bytes where the call only moves data (``allGather``,
``broadcast``, ``send``, ...). Reductions of two untyped storages raise: their sum of bytes means
nothing.

[Note: groups]
NCCL runs the calls between ``groupStart()`` and ``groupEnd()`` together, so that a rank may post a
send and a receive that wait on each other. ``torch.distributed``'s ``send``/``recv`` block, so here the
point-to-point calls of a group are queued and issued together at the outermost ``groupEnd()``
(``torch.distributed.batch_isend_irecv``, one batch per communicator), which returns once they are
done; their buffers hold the received data only then, as with NCCL. Collectives inside a group run at
once, in the order called, which every rank shares. The group is per thread, as NCCL's is.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, NamedTuple, NoReturn, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..engine.collectives import all_gather_single, reduce_scatter_single
from .comm import Communicator, CommLike, as_communicator
from .distributed import _divide, _sum_op

__all__ = ["NCCLCommunicator", "all2all", "all2one", "allGather", "allReduce", "broadcast", "commCount",
           "commDestroy", "commInitRank", "commRank", "getUniqueId", "groupEnd", "groupStart", "recv", "reduce",
           "reduceScatter", "send"]

NCCLCommunicator = Communicator
"""BMTrain's class of communicators; here :class:`~bmtwrap.bmtrain.comm.Communicator`."""

Buffer = Union[torch.Tensor, torch.TypedStorage, torch.UntypedStorage]

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}  # "avg": see _reduce_op


class _Flat(NamedTuple):
    """A buffer as a flat tensor (see [Note: buffers]); ``target``: the tensor to copy the result back into."""

    tensor: torch.Tensor
    target: Optional[torch.Tensor]

    def write_back(self) -> None:
        if self.target is not None:
            self.target.copy_(self.tensor.view(self.target.shape))


def _dtype_of(buffer: Buffer) -> Optional[torch.dtype]:
    return None if isinstance(buffer, torch.UntypedStorage) else buffer.dtype


def _flat(buffer: Any, fn: str, name: str, dtype: Optional[torch.dtype] = None) -> _Flat:
    """``buffer`` as a flat tensor of ``dtype`` (an untyped storage's; the others have their own)."""
    if isinstance(buffer, torch.Tensor):
        if buffer.is_contiguous():
            return _Flat(buffer.view(-1), None)
        return _Flat(buffer.contiguous().view(-1), buffer)
    if isinstance(buffer, torch.TypedStorage):
        memory, dtype = buffer._untyped_storage, buffer.dtype
    elif isinstance(buffer, torch.UntypedStorage):
        memory, dtype = buffer, dtype or torch.uint8
    else:
        raise TypeError(f"bmt.nccl.{fn}: {name} must be a tensor or a storage (tensor.storage()), "
                        f"got {type(buffer).__name__}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if memory.nbytes() % itemsize:
        raise ValueError(f"bmt.nccl.{fn}: {name} is an untyped storage of {memory.nbytes()} bytes, not a whole "
                         f"number of {dtype} elements ({itemsize} bytes each); pass the tensor or tensor.storage()")
    view = torch.empty(0, dtype=dtype, device=memory.device).set_(memory, 0, (memory.nbytes() // itemsize,))
    return _Flat(view, None)


def _pair(src: Any, dst: Any, fn: str, *, reduces: bool) -> Tuple[_Flat, _Flat]:
    """``src`` and ``dst`` as flat tensors of one dtype on one device (see [Note: buffers])."""
    src_dtype, dst_dtype = (_dtype_of(b) if isinstance(b, (torch.Tensor, torch.TypedStorage)) else None
                            for b in (src, dst))
    if src_dtype is not None and dst_dtype is not None and src_dtype != dst_dtype:
        raise TypeError(f"bmt.nccl.{fn}: src holds {src_dtype} and dst holds {dst_dtype}; both buffers must "
                        f"have one dtype (make dst with dtype={src_dtype})")
    dtype = src_dtype or dst_dtype
    if dtype is None and reduces and isinstance(src, torch.UntypedStorage) and isinstance(dst, torch.UntypedStorage):
        raise TypeError(f"bmt.nccl.{fn}: src and dst are both untyped storages, so the dtype to reduce in is "
                        "unknown; pass tensors or typed storages (tensor.storage())")
    a, b = _flat(src, fn, "src", dtype), _flat(dst, fn, "dst", dtype)
    if a.tensor.device != b.tensor.device:
        raise ValueError(f"bmt.nccl.{fn}: src is on {a.tensor.device} and dst on {b.tensor.device}; "
                         "both buffers must be on one device")
    return a, b


def _same_memory(a: _Flat, b: _Flat) -> bool:
    return a.tensor.data_ptr() == b.tensor.data_ptr() and a.tensor.numel() == b.tensor.numel()


def _reduce_op(op: Any, fn: str, x: torch.Tensor, comm: Communicator) -> Tuple[dist.ReduceOp, int]:
    """torch's op for BMTrain's ``op`` name, and what to divide the result by after (gloo has no average)."""
    if op not in _OPS:
        raise ValueError(f"bmt.nccl.{fn}: unknown op {op!r}; use one of {', '.join(map(repr, _OPS))}")
    if comm.size == 1:
        return _OPS[op], 1  # nothing is reduced: the result is this rank's buffer
    if op in ("sum", "avg"):
        return _sum_op(op, x, comm)
    return _OPS[op], 1


def _root(root: Any, comm: Communicator, fn: str, name: str = "root") -> int:
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < comm.size:
        raise ValueError(f"bmt.nccl.{fn}: {name} must be a rank of the communicator, 0 to {comm.size - 1} "
                         f"(counted within it, not globally), got {root!r}")
    return root


def _sizes(fn: str, what: str, src: torch.Tensor, dst: torch.Tensor) -> NoReturn:
    raise ValueError(f"bmt.nccl.{fn}: mismatched sizes: src has {src.numel()} elements and dst {dst.numel()}; "
                     f"{what}")


def allReduce(src: Buffer, dst: Buffer, op: str, comm: CommLike) -> None:
    """Reduce every rank's ``src`` elementwise into every rank's ``dst`` (NCCL's ``ncclAllReduce``).

    Args:
        src: this rank's buffer: a tensor or a storage (see [Note: buffers] in this module).
        dst: the result's buffer, as many elements as ``src``, same dtype and device; ``src`` itself
            (or the same storage) reduces in place.
        op: ``"sum"``, ``"avg"``, ``"max"``, ``"min"`` or ``"prod"``.
        comm: a communicator of ``bmt.config`` (``bmt.config["comm"]``, ...) or a ProcessGroup.

    Raises:
        ValueError: an unknown ``op``; ``src`` and ``dst`` of different sizes or devices.
        TypeError: buffers of different dtypes, two untyped storages, or something else.

    Example::

        bmt.nccl.allReduce(norm.storage(), norm.storage(), "sum", bmt.config["comm"])
    """
    c = as_communicator(comm, "bmt.nccl.allReduce")
    a, b = _pair(src, dst, "allReduce", reduces=True)
    torch_op, divisor = _reduce_op(op, "allReduce", b.tensor, c)
    if a.tensor.numel() != b.tensor.numel():
        _sizes("allReduce", "they must be equal", a.tensor, b.tensor)
    if not _same_memory(a, b):
        b.tensor.copy_(a.tensor)
    if c.size > 1:
        dist.all_reduce(b.tensor, op=torch_op, group=c.group)
        _divide(b.tensor, divisor)
    b.write_back()


def allGather(src: Buffer, dst: Buffer, comm: CommLike) -> None:
    """Every rank's ``src``, concatenated in rank order, into every rank's ``dst`` (``ncclAllGather``).

    ``dst`` holds at least ``size * len(src)`` elements (``size``: the communicator's ranks); the first
    ``size * len(src)`` are written, rank ``r``'s ``src`` at ``r * len(src)``.

    Raises:
        ValueError: ``dst`` smaller than ``size * len(src)``; different devices.
        TypeError: buffers of different dtypes, or something else.

    Example::

        bmt.nccl.allGather(mine.storage(), every.storage(), bmt.config["comm"])
    """
    c = as_communicator(comm, "bmt.nccl.allGather")
    a, b = _pair(src, dst, "allGather", reduces=False)
    n = a.tensor.numel()
    if b.tensor.numel() < n * c.size:
        _sizes("allGather", f"dst must hold {c.size} x {n} = {n * c.size} (the communicator's ranks x src)",
               a.tensor, b.tensor)
    if c.size == 1:
        b.tensor[:n].copy_(a.tensor)
    else:
        mine = a.tensor.clone() if _overlaps(a, b) else a.tensor
        all_gather_single(b.tensor[:n * c.size], mine, group=c.group)
    b.write_back()


def reduceScatter(src: Buffer, dst: Buffer, op: str, comm: CommLike) -> None:
    """Rank ``r``'s ``dst`` gets chunk ``r`` of the reduction of every rank's ``src`` (``ncclReduceScatter``).

    ``src`` holds at least ``size * len(dst)`` elements; its first ``size * len(dst)`` are reduced, in
    chunks of ``len(dst)``.

    Raises:
        ValueError: an unknown ``op``; ``src`` smaller than ``size * len(dst)``; different devices.
        TypeError: buffers of different dtypes, two untyped storages, or something else.

    Example::

        bmt.nccl.reduceScatter(grads.storage(), my_grads.storage(), "avg", bmt.config["zero_comm"])
    """
    c = as_communicator(comm, "bmt.nccl.reduceScatter")
    a, b = _pair(src, dst, "reduceScatter", reduces=True)
    torch_op, divisor = _reduce_op(op, "reduceScatter", a.tensor, c)
    n = b.tensor.numel()
    if a.tensor.numel() < n * c.size:
        _sizes("reduceScatter", f"src must hold {c.size} x {n} = {n * c.size} (the communicator's ranks x dst)",
               a.tensor, b.tensor)
    full = a.tensor[:n * c.size]
    if c.size == 1:
        b.tensor.copy_(full)
    else:
        reduce_scatter_single(b.tensor, full.clone() if _overlaps(a, b) else full, op=torch_op, group=c.group)
        _divide(b.tensor, divisor)
    b.write_back()


def broadcast(src: Buffer, dst: Buffer, root: int, comm: CommLike) -> None:
    """Rank ``root``'s ``src`` into every rank's ``dst`` (``ncclBroadcast``); ``src`` is read on ``root`` only.

    Args:
        root: the sending rank, counted within ``comm``.

    Raises:
        ValueError: ``root`` not a rank of ``comm``; ``src`` and ``dst`` of different sizes or devices.
        TypeError: buffers of different dtypes, or something else.

    Example::

        bmt.nccl.broadcast(weights.storage(), weights.storage(), 0, bmt.config["comm"])
    """
    c = as_communicator(comm, "bmt.nccl.broadcast")
    a, b = _pair(src, dst, "broadcast", reduces=False)
    _root(root, c, "broadcast")
    if a.tensor.numel() != b.tensor.numel():
        _sizes("broadcast", "they must be equal", a.tensor, b.tensor)
    if c.rank == root and not _same_memory(a, b):
        b.tensor.copy_(a.tensor)
    if c.size > 1:
        dist.broadcast(b.tensor, src=c.global_rank(root), group=c.group)
    b.write_back()


def reduce(src: Buffer, dst: Buffer, op: str, root: int, comm: CommLike) -> None:
    """The elementwise reduction of every rank's ``src`` into ``dst`` on rank ``root`` (``ncclReduce``).

    ``dst`` is written on ``root`` only; the other ranks' ``dst`` (and every ``src``) are left as they were.

    Raises:
        ValueError: an unknown ``op``; ``root`` not a rank of ``comm``; different sizes or devices.
        TypeError: buffers of different dtypes, two untyped storages, or something else.

    Example::

        bmt.nccl.reduce(loss.storage(), total.storage(), "sum", 0, bmt.config["comm"])
    """
    c = as_communicator(comm, "bmt.nccl.reduce")
    a, b = _pair(src, dst, "reduce", reduces=True)
    torch_op, divisor = _reduce_op(op, "reduce", a.tensor, c)
    _root(root, c, "reduce")
    if a.tensor.numel() != b.tensor.numel():
        _sizes("reduce", "they must be equal", a.tensor, b.tensor)
    result = a.tensor.clone()  # torch may overwrite the input of a reduce on every rank; NCCL does not
    if c.size > 1:
        dist.reduce(result, dst=c.global_rank(root), op=torch_op, group=c.group)
    if c.rank == root:
        b.tensor.copy_(_divide(result, divisor))
        b.write_back()


def all2all(src: Buffer, dst: Buffer, comm: CommLike) -> None:
    """Chunk ``j`` of rank ``i``'s ``src`` becomes chunk ``i`` of rank ``j``'s ``dst`` (BMTrain's ``all2all``).

    ``src`` and ``dst`` have the same size, divisible by the communicator's ranks.

    Raises:
        ValueError: different sizes, or a size not divisible by the ranks.

    Example::

        bmt.nccl.all2all(x.storage(), y.storage(), bmt.config["comm"])
    """
    c = as_communicator(comm, "bmt.nccl.all2all")
    a, b = _pair(src, dst, "all2all", reduces=False)
    if a.tensor.numel() != b.tensor.numel() or a.tensor.numel() % c.size:
        _sizes("all2all", f"they must be equal and divisible by the communicator's {c.size} ranks", a.tensor, b.tensor)
    if c.size == 1:
        b.tensor.copy_(a.tensor)
    else:
        dist.all_to_all_single(b.tensor, a.tensor.clone() if _overlaps(a, b) else a.tensor, group=c.group)
    b.write_back()


def all2one(src: Buffer, dst: Buffer, rank: int, comm: CommLike) -> None:
    """Rank ``rank``'s ``dst`` gets, as chunk ``i``, chunk ``rank`` of rank ``i``'s ``src`` (BMTrain's ``all2one``).

    ``src`` and ``dst`` have the same size, divisible by the communicator's ranks; only ``rank``'s
    ``dst`` is written.

    Raises:
        ValueError: ``rank`` not a rank of ``comm``; different sizes, or not divisible by the ranks.

    Example::

        bmt.nccl.all2one(x.storage(), y.storage(), 0, bmt.config["comm"])
    """
    c = as_communicator(comm, "bmt.nccl.all2one")
    a, b = _pair(src, dst, "all2one", reduces=False)
    _root(rank, c, "all2one", "rank")
    if a.tensor.numel() != b.tensor.numel() or a.tensor.numel() % c.size:
        _sizes("all2one", f"they must be equal and divisible by the communicator's {c.size} ranks", a.tensor, b.tensor)
    chunk = a.tensor.numel() // c.size
    piece = a.tensor[rank * chunk:(rank + 1) * chunk].clone()
    if c.rank != rank:
        dist.gather(piece, None, dst=c.global_rank(rank), group=c.group)
        return
    received = [torch.empty_like(piece) for _ in range(c.size)]
    if c.size == 1:
        received[0].copy_(piece)
    else:
        dist.gather(piece, received, dst=c.global_rank(rank), group=c.group)
    torch.cat(received, out=b.tensor)
    b.write_back()


def _overlaps(a: _Flat, b: _Flat) -> bool:
    """Whether the two flat tensors share memory (torch's collectives take distinct input and output)."""
    a_start, b_start = a.tensor.data_ptr(), b.tensor.data_ptr()
    a_end = a_start + a.tensor.numel() * a.tensor.element_size()
    b_end = b_start + b.tensor.numel() * b.tensor.element_size()
    return a.tensor.device == b.tensor.device and a_start < b_end and b_start < a_end


class _PointToPoint(NamedTuple):
    comm: Communicator
    op: Callable[..., Any]  # dist.isend or dist.irecv
    buffer: _Flat
    peer: int  # global rank


class _GroupState(threading.local):
    """The calls queued between ``groupStart()`` and ``groupEnd()`` on this thread (see [Note: groups])."""

    def __init__(self) -> None:
        self.depth = 0
        self.queued: List[_PointToPoint] = []


_GROUP = _GroupState()


def _point_to_point(fn: str, buffer: Buffer, peer: int, comm: CommLike, op: Callable[..., Any]) -> None:
    c = as_communicator(comm, f"bmt.nccl.{fn}")
    flat = _flat(buffer, fn, "src" if fn == "send" else "dst")
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < c.size or peer == c.rank:
        raise ValueError(f"bmt.nccl.{fn}: peer must be another rank of the communicator (0 to {c.size - 1}, counted "
                         f"within it, not this rank {c.rank}), got {peer!r}")
    call = _PointToPoint(c, op, flat, c.global_rank(peer))
    if _GROUP.depth:
        _GROUP.queued.append(call)
    else:
        _run_point_to_point([call])


def _run_point_to_point(calls: List[_PointToPoint]) -> None:
    """Issue ``calls`` together, one batch per communicator, and wait for all of them."""
    batches: dict = {}
    for call in calls:
        batches.setdefault(call.comm, []).append(call)
    works = []
    for comm, batch in batches.items():
        works += dist.batch_isend_irecv([dist.P2POp(call.op, call.buffer.tensor, call.peer, group=comm.group)
                                         for call in batch])
    for work in works:
        work.wait()
    for call in calls:
        if call.op is dist.irecv:
            call.buffer.write_back()


def send(src: Buffer, peer: int, comm: CommLike) -> None:
    """Send ``src`` to rank ``peer`` of ``comm``, which calls :func:`recv` with a buffer as large (``ncclSend``).

    Inside ``groupStart()``/``groupEnd()`` it is queued and runs at ``groupEnd()`` (see [Note: groups]).

    Raises:
        ValueError: ``peer`` not another rank of ``comm``.
        TypeError: ``src`` is neither a tensor nor a storage, or ``comm`` not a communicator.

    Example::

        bmt.nccl.groupStart()
        bmt.nccl.send(mine.storage(), (me + 1) % n, comm)
        bmt.nccl.recv(theirs.storage(), (me - 1) % n, comm)
        bmt.nccl.groupEnd()
    """
    _point_to_point("send", src, peer, comm, dist.isend)


def recv(dst: Buffer, peer: int, comm: CommLike) -> None:
    """Receive into ``dst`` what rank ``peer`` of ``comm`` sends with :func:`send` (``ncclRecv``).

    Inside ``groupStart()``/``groupEnd()`` it is queued, and ``dst`` holds the data after ``groupEnd()``.

    Raises:
        ValueError: ``peer`` not another rank of ``comm``.
        TypeError: ``dst`` is neither a tensor nor a storage, or ``comm`` not a communicator.
    """
    _point_to_point("recv", dst, peer, comm, dist.irecv)


def groupStart() -> None:
    """Start a group: :func:`send` and :func:`recv` calls wait until the matching :func:`groupEnd` (``ncclGroupStart``).

    Groups nest; the outermost ``groupEnd()`` runs the queued calls (see [Note: groups]).
    """
    _GROUP.depth += 1


def groupEnd() -> None:
    """End a group; at the outermost one, run the queued :func:`send`/:func:`recv` calls together and wait for them.

    Raises:
        RuntimeError: no group was started.
    """
    if _GROUP.depth == 0:
        raise RuntimeError("bmt.nccl.groupEnd() without a groupStart(): call groupStart() before the sends and "
                           "receives to run together")
    _GROUP.depth -= 1
    if _GROUP.depth == 0:
        calls, _GROUP.queued = _GROUP.queued, []
        _run_point_to_point(calls)


def commCount(comm: CommLike) -> int:
    """The number of ranks of ``comm`` (``ncclCommCount``)."""
    return as_communicator(comm, "bmt.nccl.commCount").size


def commRank(comm: CommLike) -> int:
    """This rank's place in ``comm`` (``ncclCommUserRank``)."""
    return as_communicator(comm, "bmt.nccl.commRank").rank


def _refuse(name: str) -> NoReturn:
    raise NotImplementedError(
        f"bmt.nccl.{name} is not available: bmtwrap makes no NCCL communicators of its own. Use those of "
        "bmt.config (bmt.config['comm'], ['zero_comm'], ...), or pass a process group made by "
        "torch.distributed.new_group(ranks) wherever a communicator goes")


def getUniqueId(*args: Any, **kwargs: Any) -> NoReturn:
    """Raises ``NotImplementedError``: communicators come from ``bmt.config`` or ``torch.distributed.new_group``."""
    _refuse("getUniqueId")


def commInitRank(*args: Any, **kwargs: Any) -> NoReturn:
    """Raises ``NotImplementedError``: communicators come from ``bmt.config`` or ``torch.distributed.new_group``."""
    _refuse("commInitRank")


def commDestroy(*args: Any, **kwargs: Any) -> NoReturn:
    """Raises ``NotImplementedError``: ``torch.distributed.destroy_process_group(group)`` ends a group."""
    _refuse("commDestroy")
