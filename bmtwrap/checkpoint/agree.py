"""Agreeing across ranks before a checkpoint changes anything: every rank raises when any rank failed.

A rank raises its own error; the others rebuild the first failing rank's (its type when it is one of
the common ones, with the rank named), so no rank goes on alone and none waits in a collective.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, List, Optional, Sequence, Tuple

import torch.distributed as dist

from ..engine.dist import DistContext

__all__: List[str] = []  # private to the checkpoint package


_ERRORS = MappingProxyType({cls.__name__: cls for cls in (ValueError, TypeError, FileNotFoundError,
                                                          NotImplementedError, OSError, RuntimeError, KeyError)})


def _describe(error: Optional[BaseException]) -> Optional[Tuple[str, str]]:
    return None if error is None else (type(error).__name__, str(error))


def _agree(ctx: DistContext, own: Optional[BaseException]) -> None:
    """A collective: if any rank hit an error, every rank raises (so no rank changes anything alone).

    A rank raises its own error; the others rebuild the first failing rank's.
    """
    reports: List[Optional[Tuple[str, str]]] = [None] * ctx.world_size
    dist.all_gather_object(reports, _describe(own), group=ctx.group)
    _raise(own, _first_failure(reports))


def _raise(own: Optional[BaseException], failure: Optional[Tuple[str, str]]) -> None:
    if own is not None:
        raise own
    if failure is not None:
        raise _ERRORS.get(failure[0], RuntimeError)(failure[1])


def _broadcast(ctx: DistContext, value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0, group=ctx.group)
    return box[0]


def _first_failure(reports: Sequence[Optional[Tuple[str, str]]]) -> Optional[Tuple[str, str]]:
    for rank, report in enumerate(reports):
        if report is not None:
            return report[0], f"{report[1]} (on rank {rank})"
    return None


def _agree_quoting(ctx: DistContext, failure: Optional[BaseException], what: str) -> None:
    """A collective: raise on every rank if any rank has a ``failure`` (see [Note: failing together] in
    ``full``).

    A rank raises its own error; the others a RuntimeError quoting the first failing rank's.
    """
    report = None if failure is None else f"{type(failure).__name__}: {failure}"
    reports: List[Optional[str]] = [report]
    if ctx.world_size > 1:
        reports = [None] * ctx.world_size
        dist.all_gather_object(reports, report, group=ctx.group)
    if failure is not None:
        raise failure
    failed = [(rank, text) for rank, text in enumerate(reports) if text is not None]
    if failed:
        raise RuntimeError(f"{what} failed on another rank: rank {failed[0][0]} raised {failed[0][1]}")
