"""The model's side of a Hugging Face checkpoint: its state-dict entries and transformers' key conversions.

Shared by import (``hf``) and export (``hf_export``): which tensors the model holds (sharded or
full, at their full shapes), and how transformers maps the model's keys to a checkpoint's keys.

[Note: key conversion]
Transformers 5 renames keys and fuses weights on load (``block_sparse_moe`` → ``mlp``, one file
tensor per expert → one 3-D parameter, ``LayerNorm.gamma`` → ``weight``), and reverts that on
save. We do not repeat those rules: ``transformers.conversion_mapping`` gives the model's
``WeightRenaming``/``WeightConverter`` list and ``transformers.core_model_loading`` applies it to
names (its ``rename_source_key`` function and each transform's method of that name; the base-model prefix is
added or stripped there too). A plain rename is streamed by row ranges (see [Note: streaming an
HF folder into shards] in ``hf``); a converted target (a fused tensor) reads its source tensors
whole, runs the converter's own operations on them, and keeps this rank's slice, so its cost is
bounded by one parameter. Shapes are checked beforehand by running the same converters on meta
tensors. Saving reverses the conversions the way ``revert_weight_conversion`` does, group by group.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from ..engine import dist as _dist
from ..engine.full_state import tp_full_shape
from ..engine.group import FlatBuffer, ParamSlot
from ..engine.schedule import engine

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


# --- records -------------------------------------------------------------------------------------


class _Entry(NamedTuple):
    """One state-dict entry of the model: a sharded parameter (``slot`` set) or a full tensor."""

    value: torch.Tensor
    shape: torch.Size  # the full shape
    buffer: Optional[FlatBuffer]
    slot: Optional[ParamSlot]


@dataclass
class _Group:
    """Tensors that transformers converts together: N inputs → M outputs (1 → 1 for a plain rename).

    On load the inputs are checkpoint keys and the outputs model keys; on save the reverse.
    """

    key: str  # the name transformers files the group under
    converter: Any  # a WeightConverter template, or None for a plain (possibly renamed) copy
    sources: List[Tuple[str, str, str]] = field(default_factory=list)  # (renamed, input key, pattern)

    def run(self, fetch: Callable[[str], torch.Tensor], model: Any, config: Any,
            rename: Callable[[str], str] = lambda name: name) -> Dict[str, torch.Tensor]:
        """Apply the converter's own operations to the inputs ``fetch`` returns; ``rename`` its outputs."""
        if self.converter is None:
            return {self.key: fetch(self.sources[0][1])}
        converter = copy.deepcopy(self.converter)  # collects tensors: one instance per group
        for renamed, key, pattern in self.sources:
            # A callable is read when the converter materialises its inputs, not before.
            converter.add_tensor(renamed, key, pattern, functools.partial(fetch, key))
        out = converter.convert(self.key, model=model, config=config)
        return {rename(name): (value[0] if isinstance(value, list) else value) for name, value in out.items()}


class _FullShapes:
    """The model as conversion operations see it: parameters answered at their full shapes.

    ``Split`` asks the model for its targets' shapes; a sharded parameter is a 1-D piece, so it is
    answered with a meta tensor of the full shape instead. Everything else is the model's own.
    """

    def __init__(self, hf: nn.Module, entries: Dict[str, _Entry]) -> None:
        self._hf = hf
        self._entries = entries

    def get_parameter(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        return torch.empty(entry.shape, dtype=entry.value.dtype, device="meta")

    get_parameter_or_buffer = get_parameter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hf, name)


# --- the model's side --------------------------------------------------------------------------


def _hf_model(model: nn.Module, verb: str) -> nn.Module:
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"{verb} expects a Hugging Face transformers model (a PreTrainedModel, wrapped by bmtwrap or not), got "
            f"{type(model).__name__}; save and load other models with bmtwrap's own checkpoint functions")
    return model


def _entries(model: nn.Module) -> Dict[str, _Entry]:
    """Every state-dict entry with its full shape and, for a sharded parameter, its buffer slot."""
    registry = engine().registry if _dist.is_initialized() else None
    out: Dict[str, _Entry] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if registry is not None and isinstance(value, nn.Parameter) and registry.is_sharded(value):
            buffer, slot = registry.slot_of(engine().ctx, value)
            out[key] = _Entry(value, tp_full_shape(slot), buffer, slot)
        else:
            out[key] = _Entry(value, value.shape, None, None)
    return out


def _conversions(hf: nn.Module, *, for_save: bool) -> List[Any]:
    """The model's weight transforms, as transformers' from_pretrained / save_pretrained pick them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    if not for_save:
        return get_model_conversion_mapping(hf)
    used = getattr(hf, "_weight_conversions", None)  # what loading this model applied, if it was loaded
    if used is not None:
        return list(used)
    # Built from scratch: the model's own mapping, without legacy renames or prefix changes (as
    # transformers' revert_weight_conversion does).
    return [c for c in get_model_conversion_mapping(hf, add_legacy=False) if not isinstance(c, PrefixChange)]


def _apply_converters(key: str, converters: List[Any]) -> Tuple[str, Optional[str]]:
    """``key`` renamed by the first converter matching it, and that converter's source pattern (or ``None``).

    Transformers has these two loops as ``apply_converters``/``apply_renamings`` only from 5.23;
    every transformers 5 has each transform's ``rename_source_key``, which they are made of.
    """
    for converter in converters:
        renamed, pattern = converter.rename_source_key(key)
        if pattern is not None:
            return renamed, pattern
    return key, None


def _apply_renamings(key: str, renamings: List[Any]) -> str:
    """``key`` renamed by every renaming in turn."""
    for renaming in renamings:
        key, _ = renaming.rename_source_key(key)
    return key


def _split(transforms: List[Any]) -> Tuple[List[Any], List[Any], Dict[str, Any]]:
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters, {p: c for c in converters for p in c.source_patterns}
