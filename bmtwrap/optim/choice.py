"""The Adam that ``wrap``'s memory options call for (:func:`auto_adam`)."""

from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch

from .adam import AdamOptimizer
from .adam_offload import AdamOffloadOptimizer

__all__ = ["auto_adam", "wants_offload"]

# AdamOffloadOptimizer's own arguments, dropped when auto_adam builds AdamOptimizer.
OFFLOAD_ONLY = frozenset(inspect.signature(AdamOffloadOptimizer).parameters) - set(
    inspect.signature(AdamOptimizer).parameters)


def wants_offload(params: Iterable[torch.Tensor]) -> bool:
    """Whether the state of ``params`` should be free to leave the GPU: some of them are on a GPU, or live in host
    memory beside one (``wrap(offload_params=...)``). A machine without a GPU has no GPU memory to spare."""
    return any(p.is_cuda for p in params)


def auto_adam(params: Iterable[Any], lr: float = 1e-3, **kwargs: Any) -> AdamOptimizer:
    """Adam(W), with its state where it fits: the optimizer to use unless you know better.

    On a GPU: :class:`AdamOffloadOptimizer` with ``offload_fraction="auto"`` and ``step_in_backward="auto"``.
    At its first step, before it makes any state, it measures what the step needs and keeps on the GPU as
    much state as fits on the card (or under ``wrap(max_gpu_memory=...)``), all of it where everything
    fits (then it runs as :class:`AdamOptimizer` does); the rest lives in host memory and is updated by the
    CPU, starting during backward (see [Note: automatic offload fraction] and [Note: speculative updates]
    in ``bmtwrap/engine/placement.py``). So a model whose optimizer state does not fit the card trains
    without an option, and one whose state fits loses nothing. Without a GPU: :class:`AdamOptimizer`.
    The other arguments are the optimizer's; the offload optimizer's own (``step_in_backward``,
    ``cpu_threads``, ``offload_fraction``, ...) are dropped when :class:`AdamOptimizer` is chosen.

    Example::

        model = bmtwrap.wrap(model)
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
