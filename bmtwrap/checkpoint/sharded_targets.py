"""What a sharded checkpoint names: each state dict entry of the model, as this rank holds it, and each
parameter an optimizer holds, by the name the model gives it."""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Tuple

import torch
from torch import nn

from ..engine.schedule import engine


class _Target(NamedTuple):
    """One state dict entry of the model as this rank holds it."""

    tensor: torch.Tensor  # the parameter (a 1-D piece when sharded) or buffer
    shape: Tuple[int, ...]  # the full shape
    start: int  # the flat range [start, end) of the full tensor this rank holds
    end: int
    sharded: bool


def _target_of(value: torch.Tensor) -> _Target:
    eng = engine()
    if isinstance(value, nn.Parameter) and eng.registry.is_sharded(value):
        slot = eng.registry.slot_of(eng.ctx, value)[1]
        return _Target(value, tuple(slot.shape), slot.piece.param_start, slot.piece.param_end, True)
    return _Target(value, tuple(value.shape), 0, value.numel(), False)


def _model_targets(model: nn.Module) -> Dict[str, _Target]:
    """Every state dict key with its value and the flat range this rank holds of it."""
    return {key: _target_of(value) for key, value in model.state_dict(keep_vars=True).items()}


def _param_names(model: nn.Module, targets: Dict[str, _Target]) -> Tuple[Dict[int, str], Dict[str, _Target]]:
    """id(parameter) → its name, and name → target, for every parameter an optimizer may hold.

    A parameter's name is the first state dict key holding it (a Block adds no ``_module.``);
    a parameter that the state dict hides is named as ``named_parameters()`` names it.
    """
    names: Dict[int, str] = {}
    by_name = dict(targets)
    for key, target in targets.items():
        if isinstance(target.tensor, nn.Parameter):
            names.setdefault(id(target.tensor), key)
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in names:
            names[id(param)] = ".".join(part for part in name.split(".") if part != "_module")
            by_name.setdefault(names[id(param)], _target_of(param))
    return names, by_name


def _optimizer_params(optimizer: torch.optim.Optimizer, names: Dict[int, str], i: int) -> List[List[str]]:
    """The names of each parameter group's parameters (in the order ``state_dict()`` numbers them)."""
    groups: List[List[str]] = []
    for g, group in enumerate(optimizer.param_groups):
        unknown = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if unknown:
            raise ValueError(f"optimizer {i} ({type(optimizer).__name__}), group {g}: {len(unknown)} parameters "
                             f"(shapes {unknown[:5]}) are not parameters of the model; a sharded checkpoint "
                             "stores optimizer state by parameter name, so build the optimizer from "
                             "model.parameters()")
        groups.append([names[id(p)] for p in group["params"]])
    return groups
