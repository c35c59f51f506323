"""Recording intermediate tensors inside ``with inspect_tensor()``, and their statistics over ranks.

[Note: the active inspector]
``record_tensor(x, name)`` is called deep inside a model, with no handle to pass. The inspector
of the enclosing ``with inspect_tensor()`` is found on the process context
(``DistContext.inspector``): set on entry, cleared on exit. Outside any ``with``, recording does
nothing, as in BMTrain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ...engine import dist as _dist

__all__ = ["InspectTensor", "inspect_tensor", "record_tensor"]


@dataclass
class _Record:
    name: str
    group: Optional[str]
    requires_grad: bool
    tensor: torch.Tensor
    shape: tuple
    stats: Optional[Dict[str, float]] = None
    grad_stats: Optional[Dict[str, float]] = None


def _active() -> Optional["InspectTensor"]:
    return _dist.current().inspector if _dist.is_initialized() else None


def _reduced_stats(x: torch.Tensor) -> Dict[str, float]:
    """BMTrain's statistics of a tensor split over ranks: mean and variance averaged, max and min over all."""
    ctx = _dist.current()
    x = x.detach().float()
    moments = torch.stack([x.mean(), x.var()]).to(ctx.device)
    extremes = torch.stack([x.max(), -x.min()]).to(ctx.device)
    dist.all_reduce(moments, op=dist.ReduceOp.SUM, group=ctx.group)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=ctx.group)
    moments /= ctx.world_size
    return {"mean": moments[0].item(), "std": math.sqrt(moments[1].item()),
            "max": extremes[0].item(), "min": -extremes[1].item()}


class InspectTensor:
    """What ``with inspect_tensor() as inspector`` gives: the tensors recorded inside the ``with``.

    Attributes:
        summary: BMTrain's list of the records, filled when the ``with`` ends (empty before): one
            dict per :func:`record_tensor` call, in call order, with keys ``name`` (as given),
            ``summary_name`` (the name :meth:`get_summary` shows), ``group``, ``shape`` (this
            rank's), ``requires_grad`` (whether its gradient is recorded) and ``tensor`` (the
            recorded tensor itself, still in the autograd graph: a loss built from it
            back-propagates into the model). Its statistics are :meth:`get_summary`'s.

    Example::

        with bmt.inspect.inspect_tensor() as inspector:
            loss = model(x)
            loss.backward()
        bmt.print_rank(bmt.inspect.format_summary(inspector.get_summary()))
    """

    def __init__(self) -> None:
        self._records: List[_Record] = []
        self._entered = False
        self.summary: List[Dict[str, Any]] = []

    def __enter__(self) -> "InspectTensor":
        ctx = _dist.current()
        if ctx.inspector is not None:
            raise RuntimeError("inspect_tensor() is already active; nested inspect_tensor() blocks are not supported")
        if self._entered:
            raise RuntimeError("this inspector was already used; call bmt.inspect.inspect_tensor() again")
        self._entered = True
        ctx.inspector = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _dist.current().inspector = None
        given_names = [record.name for record in self._records]
        self._name_records()
        self.summary = [{"name": given, "summary_name": record.name, "group": record.group,
                         "shape": tuple(record.tensor.shape), "requires_grad": record.requires_grad,
                         "tensor": record.tensor}
                        for given, record in zip(given_names, self._records)]
        # Tensors without gradients are summarised now; the others after backward, in get_summary.
        for record in self._records:
            if not record.requires_grad:
                record.stats = _reduced_stats(record.tensor)

    def _record(self, record: _Record) -> None:
        self._records.append(record)

    def _name_records(self) -> None:
        # A name recorded more than once in a group gets its index: "group.3.name" (BMTrain's naming).
        counts: Dict[tuple, int] = {}
        for record in self._records:
            counts[(record.group, record.name)] = counts.get((record.group, record.name), 0) + 1
        seen: Dict[tuple, int] = {}
        for record in self._records:
            key = (record.group, record.name)
            index = seen.get(key, 0)
            seen[key] = index + 1
            prefix = f"{record.group}." if record.group is not None else ""
            record.name = f"{prefix}{index}.{record.name}" if counts[key] > 1 else f"{prefix}{record.name}"

    def get_summary(self) -> List[Dict[str, Any]]:
        """Statistics of every recorded tensor, and of its gradient where backward produced one.

        A collective (statistics are reduced over ranks): call it on every rank, after the ``with``.

        Returns:
            One dict per record with keys ``name``, ``min``, ``max``, ``mean``, ``std``,
            ``shape`` (the first dimension times the world size: records are taken as split over
            ranks by batch), ``grad_mean``, ``grad_std`` (``None`` without a gradient).

        Raises:
            RuntimeError: called inside the ``with``.
        """
        if _active() is self:
            raise RuntimeError("get_summary() must be called after the `with inspect_tensor()` block")
        out = []
        for record in self._records:
            if record.stats is None:
                record.stats = _reduced_stats(record.tensor)
            grad = record.tensor.grad if record.requires_grad else None
            if grad is not None and record.grad_stats is None:
                record.grad_stats = _reduced_stats(grad)
            grad_stats = record.grad_stats or {}
            out.append({"name": record.name, **record.stats, "shape": record.shape,
                        "grad_mean": grad_stats.get("mean"), "grad_std": grad_stats.get("std")})
        return out

    def get_tensor(self, name: str, group: Optional[str] = None, index: Optional[int] = None) -> Optional[torch.Tensor]:
        """The tensor recorded as ``name`` in ``group`` (the ``index``-th of that name), or ``None``.

        Args:
            name: the name given to :func:`record_tensor`.
            group: the group given to :func:`record_tensor`.
            index: which of several records of that name; ``None``: the only one, or the first.
        """
        prefix = f"{group}." if group is not None else ""
        names = {f"{prefix}{name}", f"{prefix}0.{name}"} if index is None else {f"{prefix}{index}.{name}"}
        for record in self._records:
            if record.name in names:
                return record.tensor
        return None


def inspect_tensor() -> InspectTensor:
    """A context manager that records what :func:`record_tensor` is given inside it.

    Call ``backward()`` inside the ``with`` for gradients to be recorded too, and
    :meth:`InspectTensor.get_summary` after it.

    Returns:
        A fresh :class:`InspectTensor`, to use once.

    Raises:
        RuntimeError: (on entry) another ``inspect_tensor()`` is active.

    Example::

        with bmt.inspect.inspect_tensor() as inspector:
            loss = model(x)
            loss.backward()
        summary = inspector.get_summary()
    """
    return InspectTensor()


def record_tensor(x: torch.Tensor, name: str, group: Optional[str] = None, requires_grad: bool = True) -> None:
    """Record ``x`` for the enclosing ``with inspect_tensor()``; does nothing outside one.

    Args:
        x: an intermediate tensor (not a parameter), taken as split over ranks by its first dimension.
        name: its name in the summary.
        group: an optional group name, put in front of ``name``.
        requires_grad: also record its gradient (when ``x`` requires one).

    Raises:
        TypeError: ``x`` is a parameter (inspect those with :func:`inspect_model`) or not a tensor.
    """
    if isinstance(x, torch.nn.Parameter) or not isinstance(x, torch.Tensor):
        raise TypeError(f"record_tensor expects an intermediate tensor, got {type(x).__name__}; "
                        "inspect parameters with bmt.inspect.inspect_model")
    inspector = _active()
    if inspector is None:
        return
    world = _dist.current().world_size
    shape = (x.size(0) * world,) + tuple(x.shape[1:]) if x.dim() > 0 else ()
    keep_grad = requires_grad and x.requires_grad
    if keep_grad:
        x.retain_grad()
    inspector._record(_Record(name=name, group=group, requires_grad=keep_grad, tensor=x, shape=shape))
