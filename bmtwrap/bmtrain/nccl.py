"""``bmt.nccl``: BMTrain's NCCL bindings, each raising ``NotImplementedError`` that names its replacement.

bmtwrap communicates through ``torch.distributed`` and ships no NCCL bindings; a program that
called ``bmt.nccl`` directly should call the ``torch.distributed`` function named in the error,
on tensors rather than storages, with ``group=None`` for bmtwrap's group.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["allGather", "allReduce", "broadcast", "commDestroy", "commInitRank", "getUniqueId", "groupEnd",
           "groupStart", "recv", "reduce", "reduceScatter", "send"]


def _refuse(name: str, replacement: str) -> NoReturn:
    raise NotImplementedError(
        f"bmt.nccl.{name} is not available: bmtwrap has no NCCL bindings; use {replacement} instead"
    )


def allGather(*args: Any, **kwargs: Any) -> NoReturn:
    """Raises ``NotImplementedError``: use ``torch.distributed.all_gather_into_tensor(output, input)``."""
    _refuse("allGather", "torch.distributed.all_gather_into_tensor(output, input)")


def allReduce(*args: Any, **kwargs: Any) -> NoReturn:
    """Raises ``NotImplementedError``: use ``torch.distributed.all_reduce(tensor, op=ReduceOp.SUM)``."""
    _refuse("allReduce", "torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)")


def broadcast(*args: Any, **kwargs: Any) -> NoReturn:
    """Raises ``NotImplementedError``: use ``torch.distributed.broadcast(tensor, src)``."""
    _refuse("broadcast", "torch.distributed.broadcast(tensor, src)")


def reduce(*args: Any, **kwargs: Any) -> NoReturn:
    """Raises ``NotImplementedError``: use ``torch.distributed.reduce(tensor, dst, op)``."""
    _refuse("reduce", "torch.distributed.reduce(tensor, dst, op)")


def reduceScatter(*args: Any, **kwargs: Any) -> NoReturn:
    """Raises ``NotImplementedError``: use ``torch.distributed.reduce_scatter_tensor(output, input)``."""
    _refuse("reduceScatter", "torch.distributed.reduce_scatter_tensor(output, input)")


def send(*args: Any, **kwargs: Any) -> NoReturn:
    """Raises ``NotImplementedError``: use ``torch.distributed.send(tensor, dst)``."""
    _refuse("send", "torch.distributed.send(tensor, dst)")


def recv(*args: Any, **kwargs: Any) -> NoReturn:
    """Raises ``NotImplementedError``: use ``torch.distributed.recv(tensor, src)``."""
    _refuse("recv", "torch.distributed.recv(tensor, src)")


def groupStart(*args: Any, **kwargs: Any) -> NoReturn:
    """Raises ``NotImplementedError``: use ``torch.distributed.batch_isend_irecv`` or ``async_op=True`` handles."""
    _refuse("groupStart", "torch.distributed.batch_isend_irecv(ops) or collectives with async_op=True")


def groupEnd(*args: Any, **kwargs: Any) -> NoReturn:
    """Raises ``NotImplementedError``: use ``torch.distributed.batch_isend_irecv`` or ``async_op=True`` handles."""
    _refuse("groupEnd", "torch.distributed.batch_isend_irecv(ops) or collectives with async_op=True")


def getUniqueId(*args: Any, **kwargs: Any) -> NoReturn:
    """Raises ``NotImplementedError``: ``torch.distributed.init_process_group`` makes the communicator."""
    _refuse("getUniqueId", "torch.distributed.init_process_group (through bmt.init_distributed)")


def commInitRank(*args: Any, **kwargs: Any) -> NoReturn:
    """Raises ``NotImplementedError``: use ``torch.distributed.new_group(ranks)``."""
    _refuse("commInitRank", "torch.distributed.new_group(ranks)")


def commDestroy(*args: Any, **kwargs: Any) -> NoReturn:
    """Raises ``NotImplementedError``: use ``torch.distributed.destroy_process_group(group)``."""
    _refuse("commDestroy", "torch.distributed.destroy_process_group(group)")
