"""Full-shaped state of a sharded model: full tensors in (a load hook), gathered tensors out.

A sharded model's parameters are this rank's pieces. These are the engine's helpers that cross
between pieces and full shapes for whole models:

- :func:`shard_full_tensors`, a load-state-dict pre-hook: a full-shaped tensor given for a sharded
  parameter is cut to this rank's piece, so ``load_state_dict`` takes the unwrapped model's state;
- :func:`gather_full_tensors`, a state-dict post-hook: ``state_dict()`` of a sharded model holds
  full-shaped copies on the CPU, as an unwrapped model's does (BMTrain's semantics);
- :func:`full_state_dict` and :func:`full_grad_dict`: every parameter (or gradient) gathered to its
  full shape, under the unwrapped model's keys. They are collectives.

[Note: state_dict of a sharded model]
``model.state_dict()`` is a collective: every rank calls it and every rank gets every parameter at
its full shape, as a CPU tensor, under the unwrapped model's keys, so ``torch.save(model.state_dict())``
writes a file plain torch loads. The hook sits on each module that owns a group (a block, the root
of a wrapped or hand-written model) and gathers one flat buffer at a time, copying out to the CPU
before the next, so the GPU never holds more than one buffer beyond what training holds. Inner
hooks run first (a block before its model's root); an outer hook leaves the entries an inner one
already replaced. ``state_dict(keep_vars=True)`` asks for the live objects: it returns the sharded
parameters themselves (this rank's 1-D pieces), which bmtwrap's own checkpoint code reads.

Streaming a model to or from a file one buffer at a time is :mod:`bmtwrap.checkpoint`'s.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from .collectives import all_gather
from .group import FlatBuffer, ParamSlot
from .tp import gather_along
from .schedule import engine

__all__ = ["full_grad_dict", "full_state_dict", "gather_full_tensors", "register_full_state_dict",
           "shard_full_tensors", "tp_full_shape", "tp_join", "tp_cut"]

# (module, key prefix) -> (state-dict key, parameter) for the parameters under the module.
NamedParams = Callable[[nn.Module, str], Iterable[Tuple[str, nn.Parameter]]]


def tp_full_shape(slot: ParamSlot) -> torch.Size:
    """The shape of ``slot``'s parameter whole: joined over the tensor-parallel group where it is split."""
    if slot.tp_split_dim is None:
        return slot.shape
    shape = list(slot.shape)
    shape[slot.tp_split_dim] *= engine().ctx.tp_size
    return torch.Size(shape)


def tp_join(slot: ParamSlot, value: torch.Tensor) -> torch.Tensor:
    """``value`` (``slot``'s parameter at the shape this rank holds) joined over the tensor-parallel group where the
    parameter is split (a collective of the group; see [Note: tensor parallelism] in ``tp.py``), else itself."""
    return value if slot.tp_split_dim is None else gather_along(value, slot.tp_split_dim)


def tp_cut(slot: ParamSlot, value: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the whole ``value`` of a parameter split by tensor parallelism (else ``value``)."""
    if slot.tp_split_dim is None or tuple(value.shape) != tuple(tp_full_shape(slot)):
        return value
    ctx = engine().ctx
    return value.chunk(ctx.tp_size, dim=slot.tp_split_dim)[ctx.tp_rank]


def _named_parameters(module: nn.Module, prefix: str) -> Iterable[Tuple[str, nn.Parameter]]:
    return module.named_parameters(prefix=prefix, remove_duplicate=False)


def shard_full_tensors(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any,
                       strict: bool, missing_keys: List[str], unexpected_keys: List[str], error_msgs: List[str]) -> None:
    """Load-state-dict pre-hook: a full-shaped tensor for a sharded parameter becomes this rank's piece.

    So ``model.load_state_dict(unwrapped_state_dict)`` works on a sharded model, as it does in
    BMTrain. Pieces (what ``state_dict(keep_vars=True)`` of a sharded model holds) pass through unchanged.
    """
    eng = engine()
    named = module.named_parameters(prefix=prefix[:-1], remove_duplicate=False)
    for key, param in named:
        if key not in state_dict or not eng.registry.is_sharded(param):
            continue
        buffer, slot = eng.registry.slot_of(eng.ctx, param)
        buffer.wait_writes()  # an optimizer's update still in flight would land after the loaded value
        value = tp_cut(slot, state_dict[key])
        if tuple(value.shape) == tuple(slot.shape):
            state_dict[key] = value.reshape(-1)[slot.piece.param_start : slot.piece.param_end]
            buffer.initialized = True
        elif tuple(value.shape) != tuple(param.shape):
            error_msgs.append(f"size mismatch for {key.replace('_module.', '')}: the checkpoint has shape "
                              f"{tuple(value.shape)}, the model {tuple(tp_full_shape(slot))}")
            state_dict[key] = param.detach()  # reported above; keep torch from reporting the local shape too


@torch.no_grad()
def gather_full_tensors(named: NamedParams, module: nn.Module, state_dict: Dict[str, Any], prefix: str,
                        local_metadata: Any) -> None:
    """State-dict post-hook: this rank's pieces under ``module`` become full-shaped CPU tensors.

    ``named(module, prefix)`` lists ``(state-dict key, parameter)`` for the module's parameters (a
    :class:`~bmtwrap.Block` names them without its ``_module.`` level); bound by
    :func:`register_full_state_dict`. See [Note: state_dict of a sharded model].
    """
    eng = engine()
    by_buffer: Dict[int, Tuple[FlatBuffer, List[Tuple[str, ParamSlot]]]] = {}
    for key, param in named(module, prefix[:-1]):
        value = state_dict.get(key)
        if value is None or value is param or not eng.registry.is_sharded(param):
            continue  # absent, kept as a live object (keep_vars=True), or not sharded
        buffer, slot = eng.registry.slot_of(eng.ctx, param)
        if value.untyped_storage().data_ptr() != buffer.local.untyped_storage().data_ptr():
            continue  # an inner module's hook has gathered it already
        by_buffer.setdefault(id(buffer), (buffer, []))[1].append((key, slot))
    for buffer, entries in by_buffer.values():
        with buffer.gathered() as flat:
            for key, slot in entries:
                state_dict[key] = tp_join(slot, slot.view_in(flat)).to("cpu", copy=True)


def register_full_state_dict(module: nn.Module, named: NamedParams = _named_parameters) -> Any:
    """Give ``module.state_dict()`` full-shaped values (see [Note: state_dict of a sharded model]).

    ``named`` defaults to the module's own ``named_parameters``; returns the hook's handle.
    """
    return module.register_state_dict_post_hook(functools.partial(gather_full_tensors, named))


@torch.no_grad()
def full_state_dict(model: nn.Module, *, with_buffers: bool = True,
                    select: Optional[Callable[[str], bool]] = None) -> Dict[str, torch.Tensor]:
    """The model's state dict with every sharded parameter gathered to its full shape.

    A collective: every rank must call it; every rank gets the whole result. Keys are the
    unwrapped model's (a :class:`~bmtwrap.Block` adds no ``_module.`` level).

    Args:
        model: a model sharded by bmtwrap (or any module: unsharded tensors are copied).
        with_buffers: include buffers as well as parameters.
        select: keep only the keys for which it returns ``True``; only the flat buffers holding
            such keys are gathered (e.g. the trainable adapters of a frozen model, without
            gathering the model). Every rank must pass the same selection.

    Example::

        adapters = bmt.full_state_dict(model, select=lambda key: "lora_" in key)
    """
    eng = engine()
    entries = model.state_dict(keep_vars=True)
    if select is not None:
        entries = {name: value for name, value in entries.items() if select(name)}
    # Each flat buffer is gathered once for all of its parameters (in the same order on every rank).
    by_buffer: Dict[int, Tuple[FlatBuffer, List[Tuple[str, ParamSlot]]]] = {}
    for name, value in entries.items():
        if isinstance(value, nn.Parameter) and eng.registry.is_sharded(value):
            buffer, slot = eng.registry.slot_of(eng.ctx, value)
            by_buffer.setdefault(id(buffer), (buffer, []))[1].append((name, slot))
    gathered: Dict[str, torch.Tensor] = {}
    for buffer, names in by_buffer.values():
        with buffer.gathered() as flat:
            for name, slot in names:
                gathered[name] = tp_join(slot, slot.view_in(flat)).clone()
    out: Dict[str, torch.Tensor] = {}
    for name, value in entries.items():
        if name in gathered:
            out[name] = gathered[name]
        elif isinstance(value, nn.Parameter) or with_buffers:
            out[name] = value.detach().clone()
    return out


@torch.no_grad()
def full_grad_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter's gradient at its full shape (zeros where no rank holds one).

    A collective: every rank must call it; every rank gets the whole result. Keys are parameter
    names as the unwrapped model has them.
    """
    eng = engine()
    ctx = eng.ctx
    gathered: Dict[int, torch.Tensor] = {}
    out: Dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        key = ".".join(part for part in name.split(".") if part != "_module")
        if not eng.registry.is_sharded(param):
            out[key] = param.grad.detach().clone() if param.grad is not None else torch.zeros_like(param)
            continue
        buffer, slot = eng.registry.slot_of(ctx, param)
        if id(buffer) not in gathered:
            shard = torch.zeros(buffer.layout.shard_size, dtype=buffer.dtype, device=ctx.device)
            for other in buffer.slots:
                if other.param.grad is not None:
                    shard[other.piece.shard_start : other.piece.shard_end] = other.param.grad
            full = torch.empty(buffer.layout.padded_total, dtype=buffer.dtype, device=shard.device)
            all_gather(ctx, full, shard).wait()
            gathered[id(buffer)] = full
        out[key] = tp_join(slot, slot.view_in(gathered[id(buffer)])).clone()
    return out
