"""The Adam that ``wrap``'s memory options call for (:func:`auto_adam`)."""

from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch

from ..engine.dist import is_initialized
from ..engine.schedule import engine
from .adam import AdamOptimizer
from .adam_offload import AdamOffloadOptimizer

__all__ = ["auto_adam", "wants_offload"]

# AdamOffloadOptimizer's own arguments, dropped when auto_adam builds AdamOptimizer.
OFFLOAD_ONLY = frozenset(inspect.signature(AdamOffloadOptimizer).parameters) - set(
    inspect.signature(AdamOptimizer).parameters)


def wants_offload(params: Iterable[torch.Tensor]) -> bool:
    """Whether the state of ``params`` should be free to leave the GPU: a GPU budget is set
    (``wrap(max_gpu_memory=...)``), or some of them live in host memory beside a GPU (``offload_params``)."""
    params = list(params)
    if not any(p.is_cuda for p in params):
        return False  # nothing on a GPU: no GPU memory to spare
    budget = is_initialized() and engine().max_gpu_memory is not None
    return budget or any(p.device.type == "cpu" for p in params)


def auto_adam(params: Iterable[Any], lr: float = 1e-3, **kwargs: Any) -> AdamOptimizer:
    """Adam(W), placed where ``wrap``'s memory options call for.

    With a GPU budget (``wrap(max_gpu_memory=...)``) or parameters in host memory (``wrap``'s
    ``offload_params``, chosen or ``"auto"``): :class:`AdamOffloadOptimizer` with
    ``offload_fraction="auto"``, so the state that fits under the budget stays on the GPU and the rest
    is updated by the CPU; otherwise :class:`AdamOptimizer`, all on the device. The other arguments
    are the optimizer's; the offload optimizer's own (``step_in_backward=True`` overlaps the CPU's share
    with backward, where no gradient clipping or accumulation is needed; ``cpu_threads``, ...) are
    dropped when :class:`AdamOptimizer` is chosen.

    Example::

        model = bmtwrap.wrap(model, max_gpu_memory="24GiB")
        optimizer = bmtwrap.optim.auto_adam(model.parameters(), lr=1e-4)
    """
    params = list(params)
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    tensors = [p for group in groups for p in group["params"]]
    if wants_offload(tensors):
        kwargs.setdefault("offload_fraction", "auto")
        return AdamOffloadOptimizer(params, lr=lr, **kwargs)
    for name in OFFLOAD_ONLY:
        kwargs.pop(name, None)
    return AdamOptimizer(params, lr=lr, **kwargs)
