"""Full (consolidated) state: loading an unwrapped model's state dict into a sharded model."""

from __future__ import annotations

from typing import Dict, List, Mapping

import torch
from torch import nn

from ..schedule import engine
from ..wrap.convert import restore_buffers

__all__ = ["load_state_dict"]


def _check_keys(expected: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor], strict: bool) -> None:
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    problems: List[str] = []
    if strict and missing:
        problems.append(f"missing keys ({len(missing)}): {', '.join(missing[:20])}{' …' if len(missing) > 20 else ''}")
    if strict and unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected[:20])}"
                        f"{' …' if len(unexpected) > 20 else ''}")
    shapes = [f"{k}: checkpoint {tuple(given[k].shape)}, model {tuple(_full_shape(v))}"
              for k, v in expected.items() if k in given and tuple(given[k].shape) != tuple(_full_shape(v))]
    if shapes:
        problems.append(f"shape mismatches ({len(shapes)}): {'; '.join(shapes[:20])}")
    if problems:
        raise ValueError("cannot load this state dict into the model, nothing was changed:\n  " + "\n  ".join(problems))


def _full_shape(value: torch.Tensor) -> torch.Size:
    eng = engine()
    if isinstance(value, nn.Parameter) and eng.registry.is_sharded(value):
        buffer, index = eng.registry.buffer_of(eng.ctx, value)
        return buffer.slots[index].shape
    return value.shape


@torch.no_grad()
def load_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy a full state dict (the unwrapped model's keys and shapes) into a sharded model.

    Each rank copies only the pieces it owns; nothing is communicated. Every key is checked before
    anything is written, so a mismatch leaves the model unchanged.

    Raises:
        ValueError: missing or unexpected keys (when ``strict``), or shape mismatches, each listed
            by name.
    """
    eng = engine()
    expected: Dict[str, torch.Tensor] = model.state_dict(keep_vars=True)
    _check_keys(expected, state_dict, strict)
    for key, target in expected.items():
        if key not in state_dict:
            continue
        value = state_dict[key]
        if isinstance(target, nn.Parameter) and eng.registry.is_sharded(target):
            buffer, index = eng.registry.buffer_of(eng.ctx, target)
            piece = buffer.slots[index].piece
            flat = value.detach().reshape(-1)[piece.param_start : piece.param_end]
            target.copy_(flat.to(device=target.device, dtype=target.dtype))
            buffer.initialized = True
        else:
            target.copy_(value.to(device=target.device, dtype=target.dtype))
    restore_buffers(model)
