"""Statistics of a model's parameters and gradients, at full shape."""

from __future__ import annotations

import fnmatch
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ...engine.dist import agree_max, current
from ...engine.full_state import full_grad_dict, full_state_dict
from ..pipeline import share_stage_grads

__all__ = ["inspect_model"]


def _stats(value: torch.Tensor) -> Dict[str, float]:
    value = value.float()
    return {"max": value.max().item(), "min": value.min().item(), "std": value.std().item(),
            "mean": value.mean().item()}


@torch.no_grad()
def inspect_model(model: nn.Module, param_name: str, prefix: str = "") -> List[Dict[str, Any]]:
    """Statistics of the parameters whose names match ``param_name``, gathered to full shape.

    A collective: every rank must call it with the same arguments; every rank gets the same
    result. Names are the unwrapped model's (as :func:`bmtwrap.full_state_dict` has them), with
    ``prefix`` in front, matched by ``fnmatch`` (``*`` matches dots too, as in BMTrain).

    Args:
        model: a model sharded by bmtwrap, or any module.
        param_name: a shell-style pattern, e.g. ``"*.linear*"``.
        prefix: put in front of every name before matching (BMTrain's argument).

    Returns:
        One dict per matching parameter, in ``named_parameters`` order, with keys ``name``,
        ``shape``, ``std``, ``mean``, ``grad_std``, ``grad_mean``, ``max``, ``min``; the gradient
        statistics are ``0.0`` when the parameter has no gradient, as in BMTrain (a table then
        shows ``0.0000``). ``std`` is the unbiased one (``nan`` for a one-element parameter).

    Example::

        text = bmt.inspect.format_summary(bmt.inspect.inspect_model(model, "*.weight"))
        bmt.print_rank(text)
    """
    params = dict(model.named_parameters())
    full_names = {name: ".".join(p for p in name.split(".") if p != "_module") for name in params}
    chosen = [name for name, full in full_names.items() if fnmatch.fnmatch(prefix + full, param_name)]
    wanted = {full_names[name] for name in chosen}
    values = full_state_dict(model, with_buffers=False, select=lambda key: key in wanted)
    # Gathering gradients is model-wide; done only when some chosen parameter has one (on some rank: another
    # pipeline stage may hold it).
    has_grad = any(params[name].grad is not None for name in chosen)
    if current().pipe_size > 1:
        has_grad = bool(agree_max([int(has_grad)], "inspect_model")[0])
    grads: Optional[Dict[str, torch.Tensor]] = full_grad_dict(model) if has_grad else None
    elsewhere = share_stage_grads(model, grads) if grads is not None and current().pipe_size > 1 else set()
    out = []
    for name in chosen:
        full = full_names[name]
        value = values[full]
        entry: Dict[str, Any] = {"name": prefix + full, "shape": tuple(value.shape), **_stats(value),
                                 "grad_std": 0.0, "grad_mean": 0.0}
        if grads is not None and (params[name].grad is not None or full in elsewhere):
            grad = grads[full].float()
            entry["grad_std"] = grad.std().item()
            entry["grad_mean"] = grad.mean().item()
        out.append(entry)
    return out
