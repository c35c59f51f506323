"""Values for a wrapped model built on the meta device: :func:`materialize` initialises it group by group,
:func:`restore_buffers` recomputes the non-persistent buffers that loading a checkpoint cannot give.
"""

from __future__ import annotations

from typing import List, Set, Tuple

import torch
from torch import nn

from ..group import ParamGroup
from .convert import Wrapped, wrapped_record

__all__ = ["materialize", "restore_buffers"]


@torch.no_grad()
def restore_buffers(model: nn.Module) -> None:
    """Recompute the non-persistent buffers a model built on the meta device lost (after loading).

    Only modules without parameters of their own are re-initialised (rotary embeddings are such
    modules), so no loaded weight is touched.
    """
    record = wrapped_record(model)
    if record is None or not record.stale_buffers:
        return
    initialise = record.adapter.initializer(model)
    for module in record.stale_buffers:
        if not any(True for _ in module.parameters(recurse=False)):
            initialise(module)
    record.stale_buffers = []


def _groups_of(record: Wrapped, model: nn.Module) -> List[Tuple[ParamGroup, List[nn.Module]]]:
    """Each group with the modules whose own parameters and buffers it covers."""
    inside: Set[int] = set()
    out = []
    for module, runner in record.runners:
        modules = list(module.modules())
        inside.update(id(m) for m in modules)
        out.append((runner.group, modules))
    rest = [m for m in model.modules() if id(m) not in inside]
    return [(record.root.group, rest)] + out


@torch.no_grad()
def materialize(model: nn.Module) -> nn.Module:
    """Give a wrapped model built on the meta device its initial values, one group at a time.

    Each group is gathered (uninitialised), every module it covers is initialised at full shape
    (Hugging Face models with their own ``_init_weights``, which also restores rotary
    ``inv_freq``; other modules with ``reset_parameters()``), and each rank keeps its piece.
    Every rank draws the same random numbers, so the pieces fit together. A collective.

    Raises:
        ValueError: ``model`` was not wrapped by :func:`wrap`.
    """
    record = wrapped_record(model)
    if record is None:
        raise ValueError("materialize expects a model returned by bmtwrap.wrap()")
    initialise = record.adapter.initializer(model)
    for group, modules in _groups_of(record, model):
        for buffer in group.buffers:
            buffer.initialized = True
        group.ensure_gathered()
        group.swap_in([view.detach() for view in group.unshard()])
        try:
            for module in modules:
                initialise(module)
        finally:
            group.swap_out()
        record.stale_buffers = [m for m in record.stale_buffers if all(m is not x for x in modules)]
        for buffer in group.buffers:
            buffer.keep_own_piece()
        group.release()
    return model
