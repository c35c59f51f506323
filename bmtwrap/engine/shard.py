"""Sharding a module's parameters into a group: one flat buffer per (dtype, requires_grad).

:func:`build_group` lays the parameters under a module end to end (see [Note: flat layout] in
``param.py``), keeps this rank's slice, and turns every parameter object into a 1-D view of its
piece; :func:`lone_group` makes a group of DistributedParameters that keep their own buffers (the
root of a hand-written model). What a group then does, gather, release and reduce, is ``group.py``'s.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .dist import DistContext
from .group import FlatBuffer, GradSink, Owner, ParamGroup, ParamRegistry, ParamSlot, full_value
from .offload import OffloadPolicy
from .param import DistributedParameter, build_layout

__all__ = ["build_group", "find_owners", "lone_group", "unshard_group"]


def find_owners(module: nn.Module) -> Dict[int, List[Tuple[str, Owner]]]:
    """Every registration of every parameter under ``module``: id → [(qualified name, (module, attr))]."""
    owners: Dict[int, List[Tuple[str, Owner]]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr, param in sub._parameters.items():
            if param is not None:
                qualified = f"{prefix}.{attr}" if prefix else attr
                owners.setdefault(id(param), []).append((qualified, (sub, attr)))
    return owners


def _is_lone(param: nn.Parameter) -> bool:
    """A DistributedParameter sharded on its own (its value is spread over the ranks, not in ``param``)."""
    return isinstance(param, DistributedParameter) and param._standalone is not None


def _check_devices(ctx: DistContext, named: Sequence[Tuple[str, nn.Parameter]], where: str, allow_meta: bool) -> None:
    devices: Dict[torch.device, str] = {}
    for name, param in named:
        devices.setdefault(param.device, name)
    if len(devices) > 1:
        listed = ", ".join(f"'{n}' on {d}" for d, n in devices.items())
        raise ValueError(f"{where} mixes devices ({listed}); move the module to one device before sharding it")
    for device, name in devices.items():
        if device.type == "meta" and not allow_meta:
            raise NotImplementedError(
                f"{where}: parameter '{name}' is on the meta device; materialise it (e.g. module.to_empty(device=...)) "
                "and initialise it before sharding"
            )
        if device.type not in ("cpu", "meta") and device != ctx.device:
            raise ValueError(
                f"{where}: parameter '{name}' is on {device}, but this process computes on {ctx.device}; "
                f"move the module to {ctx.device} or to the CPU first"
            )


def build_group(ctx: DistContext, registry: ParamRegistry, module: nn.Module, name: str,
                on_reduce: GradSink, reduce_dtype: Optional[torch.dtype] = None,
                exclude: Iterable[int] = (), allow_meta: bool = False,
                offload: OffloadPolicy = OffloadPolicy()) -> ParamGroup:
    """Shard every parameter under ``module`` (except ids in ``exclude``) into a new group.

    Plain parameters are sliced locally; a lone :class:`DistributedParameter` (already sharded
    at construction) is gathered once and re-laid into the group's buffers.

    With ``allow_meta``, parameters on the meta device get uninitialised shards, to be filled by
    materialisation or loading. ``offload`` says what every buffer of the group keeps on the host
    (see [Note: offloaded shards]).

    Raises:
        ValueError: parameters on several devices, or on a device other than this process's
            (or the CPU); a parameter that another group already owns.
        NotImplementedError: parameters on the meta device without ``allow_meta``.
    """
    excluded = set(exclude)
    owners = find_owners(module)
    named: List[Tuple[str, nn.Parameter]] = []
    for qualified, param in module.named_parameters():
        if id(param) in excluded:
            continue
        if registry.lookup(param) is not None and not _is_lone(param):  # a lone one's own buffer is superseded
            raise ValueError(
                f"parameter '{qualified}' of {name} already belongs to another block; a parameter can be "
                "sharded by one block only"
            )
        named.append((qualified, param))
    _check_devices(ctx, [(n, p) for n, p in named if not _is_lone(p)], name, allow_meta)
    on_meta = any(p.device.type == "meta" for _, p in named)

    by_kind: Dict[Tuple[torch.dtype, bool], List[Tuple[str, nn.Parameter]]] = {}
    for qualified, param in named:
        by_kind.setdefault((param.dtype, param.requires_grad), []).append((qualified, param))

    buffers = []
    for (dtype, requires_grad), members in by_kind.items():
        shapes = [p._original_shape if _is_lone(p) else p.shape for _, p in members]
        layout = build_layout([s.numel() for s in shapes], ctx.shard_size, torch.empty((), dtype=dtype).element_size())
        local = offload.new_shard(layout.shard_size, dtype, ctx.device, zeroed=not on_meta)
        slots = []
        for index, ((qualified, param), shape) in enumerate(zip(members, shapes)):
            piece = layout.piece(index, ctx.shard_rank)
            if not on_meta:
                if _is_lone(param):
                    value = full_value(ctx, registry, param)
                else:
                    value = param.detach()
                with torch.no_grad():
                    local[piece.shard_start : piece.shard_end].copy_(
                        value.reshape(-1)[piece.param_start : piece.param_end])
            view = local[piece.shard_start : piece.shard_end]
            old_grad, param.grad = param.grad, None
            if param.is_meta:
                # .data cannot turn a meta tensor into a real one; swapping keeps the object (and ties).
                torch.utils.swap_tensors(param, nn.Parameter(view, requires_grad=param.requires_grad))
            else:
                param.data = view
            if old_grad is not None:
                # A gradient from before sharding: keep this rank's piece of it (not averaged over ranks).
                param.grad = old_grad.reshape(-1)[piece.param_start : piece.param_end].to(view.device).clone()
            if isinstance(param, DistributedParameter):
                param._standalone = None  # its lone shard is superseded by this buffer
                param._lone_buffer = None
            regs = tuple(owner for _, owner in owners[id(param)])
            split = param.tp_split_dim if isinstance(param, DistributedParameter) else None
            slots.append(ParamSlot(param, qualified, torch.Size(shape), layout.offsets[index], piece, regs, split))
        buffer = FlatBuffer(ctx, layout, local, slots, requires_grad, reduce_dtype if requires_grad else None,
                            label=name, offload=offload)
        buffer.initialized = not on_meta
        registry.add(buffer)
        buffers.append(buffer)
    return ParamGroup(name, buffers, on_reduce)


def lone_group(ctx: DistContext, registry: ParamRegistry, params: Sequence[Tuple[str, DistributedParameter]],
               owners: Dict[int, List[Tuple[str, Owner]]], name: str, on_reduce: GradSink) -> ParamGroup:
    """A group over DistributedParameters that stay in their own buffers (the root of a hand-written model)."""
    buffers = []
    for qualified, param in params:
        buffer, _ = registry.buffer_of(ctx, param)
        slot = buffer.slots[0]
        slot.name = qualified
        slot.owners = tuple(owner for _, owner in owners[id(param)])
        buffers.append(buffer)
    return ParamGroup(name, buffers, on_reduce)


@torch.no_grad()
def unshard_group(registry: ParamRegistry, group: ParamGroup) -> None:
    """Give every parameter of ``group`` its full value back, in place, and dissolve the group.

    A collective (one gather per buffer). Each parameter object stays the same and holds its
    full-shaped value on this process's device, ready to be sharded again by another group (a
    model wrapped on its own, then put inside a :class:`~bmtwrap.Block`). Gradients of the
    pieces are dropped: they have no full-shaped meaning on one rank.
    """
    for buffer in group.buffers:
        with buffer.gathered() as flat:
            values = [slot.view_in(flat).clone() for slot in buffer.slots]
        registry.remove(buffer)
        for slot, value in zip(buffer.slots, values):
            slot.param.grad = None
            slot.param.data = value
    group.dissolve()
