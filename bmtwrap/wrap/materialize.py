"""Values for a wrapped model built on the meta device: :func:`materialize` initialises it group by group,
:func:`restore_buffers` computes the buffers that loading a checkpoint did not give.

[Note: buffers of a model built on the meta device]
A buffer made on the meta device has no value, and a checkpoint holds only the persistent ones.
The others are computed by the model's own code: rotary ``inv_freq``, Gemma's ``embed_scale``
(√hidden, made in the embedding's constructor), ``position_ids``. Transformers 5 builds on the meta
device too and gets them back by running ``_init_weights`` over every module, with the loaded
tensors flagged so that its init functions skip them. bmtwrap does the same without flags: the
initialiser runs on a module whose parameters and already-written buffers (and those of every
module under it) are swapped for meta stand-ins of their full shapes for the duration, so it can
write only the buffers still missing, whatever it does to the rest. wrap() fills those with NaN
and watches their version counters (``convert.StaleBuffer``); one still unwritten after the
initialiser ran is an error, never a silent garbage value.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Set, Tuple

import torch
from torch import nn

from ..engine.full_state import tp_cut, tp_full_shape
from ..engine.group import ParamGroup
from .convert import StaleBuffer, Wrapped, wrapped_record

__all__ = ["materialize", "restore_buffers"]


def _full_shapes(record: Wrapped) -> Dict[int, torch.Size]:
    """id(parameter) → its full shape (joined over tensor parallelism), for every parameter the wrap sharded (at
    rest they are 1-D pieces)."""
    groups = [record.root.group] + [runner.group for _, runner in record.runners]
    return {id(slot.param): tp_full_shape(slot) for group in groups for slot in group.slots}


@contextlib.contextmanager
def _only_writing(module: nn.Module, targets: Set[Tuple[int, str]], shapes: Dict[int, torch.Size]) -> Iterator[None]:
    """Within: every parameter and every buffer not in ``targets`` ((id(module), name) pairs) under
    ``module`` is a meta stand-in of its full shape, so an initialiser run now writes only the targets."""
    swapped: List[Tuple[Dict[str, torch.Tensor], str, torch.Tensor]] = []
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                shape = shapes.get(id(param), param.shape)
                stand_in = nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"), param.requires_grad)
                swapped.append((sub._parameters, name, param))
                sub._parameters[name] = stand_in
        for name, buf in sub._buffers.items():
            if buf is not None and (id(sub), name) not in targets:
                swapped.append((sub._buffers, name, buf))
                sub._buffers[name] = torch.empty_like(buf, device="meta")
    try:
        yield
    finally:
        for table, name, value in swapped:
            table[name] = value


def _unset_error(model: nn.Module, unset: List[StaleBuffer]) -> ValueError:
    paths = {id(m): n for n, m in model.named_modules()}
    named = [f"'{paths[id(s.module)] + '.' if paths.get(id(s.module)) else ''}{s.name}' ({type(s.module).__name__})"
             for s in unset]
    more = f" and {len(named) - 8} more" if len(named) > 8 else ""
    return ValueError(
        f"buffer {', '.join(named[:8])}{more} of this {type(model).__name__} was built on the meta device and has no "
        "value: the checkpoint does not hold it and the module's initialiser (Hugging Face models: _init_weights; "
        "others: reset_parameters()) does not compute it. Build the model on a real device (or the CPU) before "
        "bmtwrap.wrap(), or give the module a reset_parameters() that sets it")


@torch.no_grad()
def restore_buffers(model: nn.Module) -> None:
    """Compute the buffers of a model built on the meta device that loading did not write.

    Each such buffer's module is initialised by the model's own initialiser with everything else
    out of its reach (see [Note: buffers of a model built on the meta device]), so no loaded
    parameter or buffer changes. No collective: every rank computes the same values.

    Raises:
        ValueError: a buffer that neither the checkpoint nor the initialiser set, named (it
            would otherwise hold no value).
    """
    record = wrapped_record(model)
    if record is None or not record.stale_buffers:
        return
    unset = [s for s in record.stale_buffers if not s.written]
    if unset:
        initialise = record.adapter.initializer(model)
        shapes = _full_shapes(record)
        modules = list({id(s.module): s.module for s in unset}.values())
        targets = {(id(s.module), s.name) for s in unset}
        for module in modules:
            with _only_writing(module, targets, shapes):
                initialise(module)
    record.stale_buffers = [s for s in unset if not s.written]
    if record.stale_buffers:
        raise _unset_error(model, record.stale_buffers)


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
    (Hugging Face models with their own ``_init_weights``, which also computes buffers such as
    rotary ``inv_freq``; other modules with ``reset_parameters()``), and each rank keeps its piece;
    a parameter split by tensor parallelism is initialised whole, and each rank keeps its slice.
    Every rank draws the same random numbers, so the pieces fit together. A collective.

    Raises:
        ValueError: ``model`` was not wrapped by :func:`wrap`; a buffer built on the meta device
            that the initialiser does not compute (named).
    """
    record = wrapped_record(model)
    if record is None:
        raise ValueError("materialize expects a model returned by bmtwrap.wrap()")
    initialise = record.adapter.initializer(model)
    for group, modules in _groups_of(record, model):
        for buffer in group.buffers:
            buffer.initialized = True
        group.ensure_gathered()
        views = [view.detach() for view in group.unshard()]
        # A parameter split by tensor parallelism is initialised whole and cut: its slices then differ between
        # the ranks of the group (its attention heads, say), as they would in the unwrapped model.
        whole = [view if slot.tp_split_dim is None else view.new_empty(tp_full_shape(slot))
                 for slot, view in zip(group.slots, views)]
        group.swap_in(whole)
        try:
            for module in modules:
                initialise(module)
        finally:
            group.swap_out()
        for slot, view, value in zip(group.slots, views, whole):
            if value is not view:
                view.copy_(tp_cut(slot, value))
        for buffer in group.buffers:
            buffer.keep_own_piece()
        group.release()
    restore_buffers(model)
    return model
