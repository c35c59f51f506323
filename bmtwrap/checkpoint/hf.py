"""Hugging Face checkpoint folders: stream one into a sharded model, write one out of it.

[Note: streaming an HF folder into shards]
A folder holds ``model.safetensors``, or shard files listed by ``model.safetensors.index.json``.
Only the file headers (names, shapes, dtypes) are read up front; they are enough to match every
tensor to the model and check names and shapes before anything is written. Then each rank reads,
for every parameter, only the rows that cover its own flat range ``[param_start, param_end)``
(``get_slice(name)[r0:r1]``, trimmed to the range) and copies them into its shard; replicated
tensors and buffers are read whole. A file is opened (memory-mapped) for one parameter and closed
right after: safetensors returns the rows as a view of the map, so only those rows' pages are
touched, and they leave the process's memory when the view is dropped. (A file kept open would
keep every page read from it resident until it closes; safetensors' ``pread`` backend reads the
whole tensor for a slice.) Peak memory per rank is its shards plus one parameter's rows (see the
memory test in tests/dist_cases/checkpoint_hf.py). No rank ever holds the state dict.

[Note: key conversion]
Transformers 5 renames keys and fuses weights on load (``block_sparse_moe`` → ``mlp``, one file
tensor per expert → one 3-D parameter, ``LayerNorm.gamma`` → ``weight``), and reverts that on
save. We do not repeat those rules: ``transformers.conversion_mapping`` gives the model's
``WeightRenaming``/``WeightConverter`` list and ``transformers.core_model_loading`` applies it to
names (``rename_source_key``, ``apply_converters``, ``apply_renamings``; the base-model prefix is
added or stripped there too). A plain rename is streamed by row ranges as above; a converted
target (a fused tensor) reads its source tensors whole, runs the converter's own operations on
them, and keeps this rank's slice, so its cost is bounded by one parameter. Shapes are checked
beforehand by running the same converters on meta tensors. Saving reverses the conversions the
way ``revert_weight_conversion`` does, group by group.

[Note: atomic folder]
``save_pretrained`` writes the whole folder under a hidden sibling (``.name.tmp-*``) and then
swaps it in: the old folder is renamed to ``.name.old-*``, the new one renamed to ``name``, and
the old one deleted. A reader therefore sees the complete old folder, the complete new one, or
(in the instant between the two renames) no folder at all, never a half-written one. A crash in
that instant leaves both complete folders under their hidden names, to be renamed back by hand.
Other files of an existing folder (tokenizer, README) are carried over, as transformers' own
``save_pretrained`` leaves them in place; stale weight shards are not.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Set, Tuple, Type, Union

import torch
import torch.distributed as dist
from torch import nn

from .. import dist as _dist
from ..group import FlatBuffer, ParamSlot, ShardState
from ..schedule import engine
from ..wrap.convert import materialize, restore_buffers, wrap
from .io import atomic_file, fsync_dir, temporary_name

__all__ = ["from_pretrained", "load_pretrained", "save_pretrained"]

PathLike = Union[str, "os.PathLike[str]"]
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
_OURS = {WEIGHTS_NAME, INDEX_NAME, "config.json", "generation_config.json"}
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


# --- records -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _FileTensor:
    """One tensor of a checkpoint, as its file header describes it."""

    path: Path
    shape: Tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _Checkpoint:
    """A checkpoint folder's headers: every tensor's file, shape and dtype; its config.json."""

    folder: Path
    tensors: Dict[str, _FileTensor]
    config: Dict[str, Any]


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


# --- reading a folder --------------------------------------------------------------------------


class _Files:
    """Open checkpoint files, each opened on first use and all closed by :meth:`close`.

    Plain reads use a fresh ``_Files`` per tensor; a converter's group shares one for its
    sources (see [Note: streaming an HF folder into shards]).
    """

    def __init__(self) -> None:
        self._handles: Dict[Path, Any] = {}

    def read(self, key: str, spec: _FileTensor, span: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """The whole tensor, or the flat range ``span`` of it (1-D), reading only the rows it covers.

        The result may be a view of the file's memory map; it stays valid after :meth:`close`.
        """
        from safetensors import safe_open

        if spec.path not in self._handles:
            self._handles[spec.path] = safe_open(str(spec.path), framework="pt", device="cpu")
        sliced = self._handles[spec.path].get_slice(key)
        if span is None or len(spec.shape) == 0:
            whole = sliced[...]
            return whole if span is None else whole.reshape(-1)[span[0] : span[1]]
        start, end = span
        row = 1
        for size in spec.shape[1:]:
            row *= size
        if start >= end or row == 0:
            return torch.empty(0, dtype=spec.dtype)
        first, last = start // row, -(-end // row)
        rows = sliced[first:last].reshape(-1)  # (last - first) * row elements
        return rows[start - first * row : end - first * row]

    def close(self) -> None:
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.__exit__(None, None, None)


def _read_checkpoint(folder: Path) -> _Checkpoint:
    """Headers of every tensor of an HF folder (single file or index + shards).

    Raises:
        FileNotFoundError: no folder, no safetensors weights in it, or a shard file the index
            names is missing.
        ValueError: the index lists a tensor its shard file does not hold.
    """
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder} is not a folder; pass a local Hugging Face checkpoint folder (download one from the Hub "
            "with huggingface_hub.snapshot_download)")
    index_path = folder / INDEX_NAME
    if index_path.exists():
        weight_map: Dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        for name in files:
            if not (folder / name).is_file():
                raise FileNotFoundError(
                    f"{index_path.name} lists shard file '{name}', which is missing from {folder}; copy the "
                    "complete checkpoint (every shard the index names)")
    elif (folder / WEIGHTS_NAME).is_file():
        weight_map, files = {}, [WEIGHTS_NAME]
    else:
        found = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
        raise FileNotFoundError(
            f"{folder} holds neither {WEIGHTS_NAME} nor {INDEX_NAME} (weight files found: {found or 'none'}); only "
            "safetensors checkpoints can be streamed: load other formats once with transformers and save_pretrained()")
    from safetensors import safe_open

    tensors: Dict[str, _FileTensor] = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                sliced = handle.get_slice(key)
                dtype = _DTYPES.get(sliced.get_dtype())
                if dtype is None:
                    raise NotImplementedError(
                        f"tensor '{key}' in {name} has dtype {sliced.get_dtype()}, which bmtwrap cannot load")
                tensors[key] = _FileTensor(folder / name, tuple(sliced.get_shape()), dtype)
    stray = [k for k, f in weight_map.items() if k not in tensors or tensors[k].path.name != f]
    if stray:
        raise ValueError(f"{index_path} lists tensors its shard files do not hold: {', '.join(sorted(stray)[:10])}")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    return _Checkpoint(folder, tensors, config)


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
            buffer, index = registry.buffer_of(engine().ctx, value)
            slot = buffer.slots[index]
            out[key] = _Entry(value, slot.shape, buffer, slot)
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


def _split(transforms: List[Any]) -> Tuple[List[Any], List[Any], Dict[str, Any]]:
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters, {p: c for c in converters for p in c.source_patterns}


# --- loading -----------------------------------------------------------------------------------


@dataclass
class _LoadPlan:
    groups: List[_Group]
    missing: List[str]
    unexpected: List[str]
    mismatched: List[str]
    conversions: List[Any]
    tied_copies: Set[str]  # tie targets the checkpoint also holds: their tie's source wins, as after tie_weights()


def _plan_load(hf: nn.Module, entries: Dict[str, _Entry], checkpoint: _Checkpoint) -> _LoadPlan:
    """Match every checkpoint tensor to model keys, as transformers' loader does, and check shapes."""
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    conversions = _conversions(hf, for_save=False)
    renamings, converters, by_pattern = _split(conversions)
    prefix = hf.base_model_prefix
    groups: Dict[str, _Group] = {}
    unexpected: List[str] = []
    for key in sorted(checkpoint.tensors, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, entries)
        if renamed not in entries and key in entries:  # renamed by mistake: keep the name, maybe re-prefixed
            renamed, pattern = rename_source_key(key, [], [], prefix, entries)
        if renamed in entries:
            group = groups.setdefault(renamed, _Group(renamed, by_pattern[pattern] if pattern else None))
            if pattern is None and group.sources:
                unexpected.append(f"{key} (a second tensor for {renamed})")
                continue
            group.sources.append((renamed, key, pattern or key))
        elif pattern is not None:
            targets = by_pattern[pattern].target_patterns
            unexpected.extend(renamed.replace(targets[0], t) for t in targets)
        else:
            unexpected.append(renamed)

    view = _FullShapes(hf, entries)
    meta = lambda key: torch.empty(checkpoint.tensors[key].shape, dtype=checkpoint.tensors[key].dtype, device="meta")
    produced: Set[str] = set()  # model keys the checkpoint provides (at the right shape or not)
    mismatched: List[str] = []
    for group in groups.values():
        for name, value in group.run(meta, view, hf.config).items():
            if name not in entries:
                unexpected.append(name)
                continue
            produced.add(name)
            if tuple(value.shape) != tuple(entries[name].shape):
                mismatched.append(f"{name}: checkpoint {tuple(value.shape)}, model {tuple(entries[name].shape)}")

    tied: Dict[str, str] = dict(getattr(hf, "all_tied_weights_keys", None) or {})
    through_tie = {k for k in entries
                   if k in tied and tied[k] in produced and entries[tied[k]].value is entries[k].value}
    missing = [k for k in entries if k not in produced and k not in through_tie]
    # The model's own exceptions (_keys_to_ignore_on_load_*, old rotary inv_freq / position_ids keys).
    info = SimpleNamespace(missing_keys=set(missing), unexpected_keys=set(unexpected))
    if hasattr(hf, "_adjust_missing_and_unexpected_keys"):
        hf._adjust_missing_and_unexpected_keys(info)
    missing = [k for k in missing if k in info.missing_keys]
    unexpected = sorted({k for k in unexpected if k in info.unexpected_keys})
    return _LoadPlan(list(groups.values()), missing, unexpected, mismatched, conversions, through_tie & produced)


def _listed(title: str, names: List[str]) -> str:
    more = f" … and {len(names) - 20} more" if len(names) > 20 else ""
    return f"{title} ({len(names)}): {', '.join(names[:20])}{more}"


def _check_plan(hf: nn.Module, plan: _LoadPlan, checkpoint: _Checkpoint, strict: bool) -> None:
    """Raise, naming every problem, before anything is written."""
    problems = []
    if strict and plan.missing:
        problems.append(_listed("missing from the checkpoint", plan.missing))
    if strict and plan.unexpected:
        problems.append(_listed("in the checkpoint but not in the model", plan.unexpected))
    if plan.mismatched:
        problems.append(_listed("shape mismatches", plan.mismatched))
    theirs, ours = checkpoint.config.get("model_type"), hf.config.model_type
    other_arch = theirs is not None and theirs != ours and (plan.missing or plan.unexpected or plan.mismatched)
    if other_arch or not plan.groups:
        arch = "/".join(checkpoint.config.get("architectures") or [theirs or "unknown"])
        raise ValueError(
            f"the checkpoint in {checkpoint.folder} is of another architecture ({theirs or 'no config.json'}: {arch}) "
            f"than the model ({ours}: {type(hf).__name__}); {len(plan.groups)} of its {len(checkpoint.tensors)} "
            "tensors match the model's keys. Build the model from this checkpoint's config "
            "(bmtwrap.from_pretrained(folder)), nothing was loaded")
    if problems:
        raise ValueError(f"cannot load {checkpoint.folder} into {type(hf).__name__}, nothing was loaded:\n  "
                         + "\n  ".join(problems))


@torch.no_grad()
def _write(entry: _Entry, value: torch.Tensor, is_piece: bool) -> None:
    target = entry.value
    if entry.slot is not None and not is_piece:
        piece = entry.slot.piece
        value = value.reshape(-1)[piece.param_start : piece.param_end]
    target.copy_(value.reshape(target.shape).to(device=target.device, dtype=target.dtype))


def _stream(hf: nn.Module, entries: Dict[str, _Entry], checkpoint: _Checkpoint, plan: _LoadPlan) -> None:
    """Read each rank's pieces and copy them into the model (see [Note: streaming an HF folder into shards])."""
    view = _FullShapes(hf, entries)
    written: Set[int] = set()
    for group in plan.groups:
        files = _Files()
        try:
            if group.converter is None:  # a plain (maybe renamed) tensor: read only this rank's rows
                entry, source = entries[group.key], group.sources[0][1]
                span = (entry.slot.piece.param_start, entry.slot.piece.param_end) if entry.slot else None
                outputs = {} if group.key in plan.tied_copies else {
                    group.key: (files.read(source, checkpoint.tensors[source], span), span is not None)}
            else:
                fetch = functools.partial(_read_from, files, checkpoint)
                converted = group.run(fetch, view, hf.config)
                outputs = {name: (value, False) for name, value in converted.items()
                           if name in entries and name not in plan.tied_copies}
                del converted
        finally:
            files.close()
        for name, (value, is_piece) in outputs.items():
            if id(entries[name].value) not in written:
                _write(entries[name], value, is_piece)
                written.add(id(entries[name].value))
        del outputs


def _read_from(files: _Files, checkpoint: _Checkpoint, key: str) -> torch.Tensor:
    return files.read(key, checkpoint.tensors[key])


def _load(model: nn.Module, checkpoint: _Checkpoint, *, strict: bool) -> None:
    hf = _hf_model(model, "load_pretrained")
    entries = _entries(model)
    meta = [k for k, e in entries.items() if e.slot is None and e.value.is_meta]
    if meta:
        raise ValueError(f"'{meta[0]}' of this {type(hf).__name__} is on the meta device and not sharded; wrap the "
                         "model with bmtwrap.wrap(model) first (or materialise it with to_empty())")
    plan = _plan_load(hf, entries, checkpoint)
    _check_plan(hf, plan, checkpoint, strict)
    missing = {id(entries[k].value) for k in plan.missing}
    if any(e.buffer is not None and not e.buffer.initialized and id(e.value) in missing for e in entries.values()):
        # Parameters the checkpoint lacks have no values on a model built on the meta device:
        # initialise everything first (a collective, decided alike on every rank), as
        # transformers initialises missing weights; the checkpoint then overwrites the rest.
        materialize(model)
    if (plan.missing or plan.unexpected) and (not _dist.is_initialized() or _dist.current().rank == 0):
        kinds = (("initialised, not loaded", plan.missing), ("ignored", plan.unexpected))
        listed = [_listed(title, names) for title, names in kinds if names]
        warnings.warn(f"loading {checkpoint.folder} into {type(hf).__name__} with strict=False: " + "; ".join(listed),
                      stacklevel=3)
    _stream(hf, entries, checkpoint, plan)
    for entry in entries.values():
        if entry.buffer is not None:
            entry.buffer.initialized = True
    restore_buffers(model)
    # Kept, as transformers keeps them, so that saving writes the checkpoint's own layout back.
    hf._weight_conversions = [c for c in plan.conversions if c.was_used()]


def load_pretrained(model: nn.Module, folder: PathLike, *, strict: bool = True) -> None:
    """Stream a Hugging Face checkpoint folder into a (wrapped) transformers model.

    Each rank reads only the rows of each tensor that cover its own shard, so no rank ever holds
    the whole state dict; replicated tensors and buffers are read whole. Keys
    are converted by transformers' own rules (renamed keys, fused MoE experts, the base-model
    prefix present or absent), tied weights absent from the file are filled through their tie, and
    non-persistent buffers (rotary ``inv_freq``) of a model built on the meta device are
    recomputed. Every name and shape is checked before anything is written. No collective runs
    unless ``strict=False`` meets a missing weight in a model built on the meta device (then every
    rank initialises the model first with :func:`bmtwrap.materialize`).

    Args:
        model: a transformers ``PreTrainedModel``, wrapped by :func:`bmtwrap.wrap` (possibly built
            on the meta device) or not.
        folder: a local folder with ``model.safetensors``, or shards and
            ``model.safetensors.index.json``; every rank must see it.
        strict: raise on weights missing from the checkpoint or present only there; with
            ``False`` they are listed in a warning (missing ones keep their values, or are
            initialised on a meta-built model). Shape mismatches always raise.

    Raises:
        TypeError: ``model`` is not a transformers model.
        FileNotFoundError: no folder, no safetensors weights in it, a shard file missing.
        ValueError: missing/unexpected keys (``strict``) or shape mismatches, each listed by name;
            a checkpoint of another architecture. Nothing is written then.

    Example::

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        model = bmtwrap.wrap(model)
        bmtwrap.checkpoint.hf.load_pretrained(model, path)
    """
    _load(model, _read_checkpoint(Path(folder)), strict=strict)


def _resolve_dtype(torch_dtype: Any, config: Any, checkpoint: _Checkpoint) -> torch.dtype:
    """``None``/``"auto"``: the config's dtype, else the checkpoint's first floating one (transformers 5's default)."""
    if isinstance(torch_dtype, torch.dtype):
        return torch_dtype
    if torch_dtype not in (None, "auto"):
        resolved = getattr(torch, str(torch_dtype), None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"torch_dtype must be a torch.dtype, its name or 'auto', got {torch_dtype!r}")
        return resolved
    configured = getattr(config, "dtype", None)
    if isinstance(configured, str):
        configured = getattr(torch, configured, None)
    if isinstance(configured, torch.dtype):
        return configured
    floats = [t.dtype for t in checkpoint.tensors.values() if t.dtype.is_floating_point]
    return floats[0] if floats else torch.get_default_dtype()


def from_pretrained(path: PathLike, *, model_class: Optional[Type[nn.Module]] = None, torch_dtype: Any = None,
                    config: Any = None, strict: bool = False, **wrap_options: Any) -> nn.Module:
    """Build a transformers model on the meta device, wrap it, and stream a checkpoint folder into it.

    The one call for fine-tuning an HF checkpoint: no rank ever materialises the whole model.

    Args:
        path: a local Hugging Face checkpoint folder (``config.json`` and safetensors weights).
        model_class: the class to build, an ``AutoModel*`` class or a concrete one; default
            ``transformers.AutoModelForCausalLM``.
        torch_dtype: the parameters' dtype (a ``torch.dtype`` or its name); default ``"auto"``, as
            in transformers 5: the config's ``dtype``, else the checkpoint's.
        config: a transformers config to build from instead of the folder's ``config.json``.
        strict: raise on missing or unexpected weights; default ``False``, as transformers:
            missing weights are initialised, unexpected ones ignored, both listed in a warning.
        **wrap_options: passed to :func:`bmtwrap.wrap` (``checkpoint``, ``zero_level``, ...).

    Returns:
        The wrapped model, in eval mode as transformers returns it; call ``model.train()``.

    Raises:
        RuntimeError: :func:`bmtwrap.init_distributed` was not called first.
        FileNotFoundError, ValueError: as :func:`load_pretrained`.

    Example::

        bmtwrap.init_distributed()
        model = bmtwrap.checkpoint.hf.from_pretrained("Llama-3.2-1B", torch_dtype=torch.bfloat16)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    """
    if not _dist.is_initialized():
        raise RuntimeError("from_pretrained shards the model over all ranks: call bmtwrap.init_distributed() first")
    import transformers

    folder = Path(path)
    checkpoint = _read_checkpoint(folder)
    if config is None:
        config = transformers.AutoConfig.from_pretrained(folder)
    model_class = model_class or transformers.AutoModelForCausalLM
    build = getattr(model_class, "from_config", None) or model_class._from_config
    with torch.device("meta"):
        model = build(config, dtype=_resolve_dtype(torch_dtype, config, checkpoint))
    wrap(model, **wrap_options)
    _load(model, checkpoint, strict=strict)
    if (folder / "generation_config.json").is_file() and model.can_generate():
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    return model.eval()


# --- saving ------------------------------------------------------------------------------------


class _Step(NamedTuple):
    """One collection step of a save: a flat buffer gathered (or a full tensor taken) and the groups it completes."""

    buffer: Optional[FlatBuffer]
    keys: List[str]
    groups: List[_Group]


def _saved_keys(hf: nn.Module, entries: Dict[str, _Entry]) -> List[str]:
    """One key per tensor: of tied names, the one transformers keeps (not a tie target)."""
    tie_targets = set(getattr(hf, "all_tied_weights_keys", None) or {})
    ignored = set(getattr(hf, "_keys_to_ignore_on_save", None) or ())
    names: Dict[int, List[str]] = {}
    for key, entry in entries.items():
        if key not in ignored:
            names.setdefault(id(entry.value), []).append(key)
    keep = {([k for k in keys if k not in tie_targets] or keys)[0] for keys in names.values()}
    return [k for k in entries if k in keep]


class _SavePlan(NamedTuple):
    steps: List[_Step]
    outputs: Dict[str, torch.Tensor]  # every tensor to write (meta, full shape), in the order produced
    rename: Callable[[str], str]  # applied to a converter's outputs


def _plan_save(hf: nn.Module, entries: Dict[str, _Entry], keys: List[str]) -> _SavePlan:
    """Group the model keys by reverse conversion, order them by gather, and dry-run them on meta."""
    from transformers.core_model_loading import apply_converters, apply_renamings, dot_natural_key

    reverse = [t.reverse_transform() for t in _conversions(hf, for_save=True)[::-1]]
    renamings, converters, by_pattern = _split(reverse)
    groups: Dict[str, _Group] = {}
    for key in sorted(keys, key=dot_natural_key):
        renamed, pattern = apply_converters(key, converters)
        if pattern is None:  # a converter's outputs are renamed after it runs (see _Group.run)
            renamed = apply_renamings(key, renamings)
        group = groups.setdefault(renamed, _Group(renamed, by_pattern[pattern] if pattern else None))
        if pattern is None and group.sources:
            raise ValueError(f"'{group.sources[0][1]}' and '{key}' would both be saved as '{renamed}'")
        group.sources.append((renamed, key, pattern or key))

    of_key = {src: group for group in groups.values() for _, src, _ in group.sources}
    rename = functools.partial(apply_renamings, weight_renamings=renamings)
    view = _FullShapes(hf, entries)
    meta = lambda k: torch.empty(entries[k].shape, dtype=entries[k].value.dtype, device="meta")
    steps: List[_Step] = []
    available: Set[str] = set()
    done: Set[int] = set()
    outputs: Dict[str, torch.Tensor] = {}
    for key in keys:
        if key in available:
            continue
        buffer = entries[key].buffer
        new = [k for k in keys if entries[k].buffer is buffer] if buffer is not None else [key]
        available.update(new)
        ready = []
        for k in new:
            group = of_key[k]
            if id(group) not in done and all(src in available for _, src, _ in group.sources):
                done.add(id(group))
                ready.append(group)
                for name, value in group.run(meta, view, hf.config, rename).items():
                    outputs[name] = torch.empty(value.shape, dtype=value.dtype, device="meta")
        steps.append(_Step(buffer, new, ready))
    return _SavePlan(steps, outputs, rename)


def _collect(step: _Step, entries: Dict[str, _Entry], keep: bool) -> Dict[str, torch.Tensor]:
    """Full CPU copies of a step's tensors (on the writing rank); a collective for a sharded buffer."""
    buffer = step.buffer
    if buffer is None:
        return {k: entries[k].value.detach().to("cpu", copy=True) for k in step.keys} if keep else {}
    was = buffer.state
    buffer.ensure_gathered()
    try:
        out = {}
        if keep:
            for k in step.keys:
                slot = entries[k].slot
                out[k] = buffer.full[slot.offset : slot.offset + slot.numel].view(slot.shape).to("cpu", copy=True)
        return out
    finally:
        if was is ShardState.SHARDED:
            buffer.release()


class _ShardWriter:
    """Writes each shard file into ``folder`` as soon as all its tensors have been produced."""

    def __init__(self, folder: Path, split: Any) -> None:
        self.folder = folder
        self.split = split
        self._pending: Dict[str, Dict[str, torch.Tensor]] = {f: {} for f in split.filename_to_tensors}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        filename = self.split.tensor_to_filename[name]
        pending = self._pending[filename]
        pending[name] = tensor.contiguous()
        if len(pending) == len(self.split.filename_to_tensors[filename]):
            _write_shard(self.folder / filename, self._pending.pop(filename))


def _write_shard(path: Path, tensors: Dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _write_configs(hf: nn.Module, folder: Path) -> None:
    # As transformers' save_pretrained: record the dtype and the class, and let the config
    # objects write (and validate) themselves; the folder swap makes them atomic.
    hf.config.dtype = str(hf.dtype).split(".")[1]
    hf.config.architectures = [type(hf).__name__]
    hf.config.save_pretrained(folder)
    if hf.can_generate() and getattr(hf, "generation_config", None) is not None:
        hf.generation_config.save_pretrained(folder)
    for name in ("config.json", "generation_config.json"):
        if (folder / name).exists():
            _fsync(folder / name)


def _carry_over(old: Path, new: Path) -> None:
    """Files of an existing folder that this save does not replace (tokenizer, README, ...)."""
    if not old.is_dir():
        return
    for item in old.iterdir():
        leftover = item.name.startswith(".") and ".tmp-" in item.name  # a killed writer's temporary file
        if item.name in _OURS or _SHARD_FILE.fullmatch(item.name) or leftover or (new / item.name).exists():
            continue
        if item.is_dir():
            shutil.copytree(item, new / item.name)
        else:
            shutil.copy2(item, new / item.name)
            _fsync(new / item.name)


def _swap_in(tmp: Path, final: Path) -> None:
    """Replace ``final`` with the finished folder ``tmp`` (see [Note: atomic folder])."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
        try:
            os.replace(tmp, final)
        except BaseException:
            os.replace(old, final)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


def save_pretrained(model: nn.Module, folder: PathLike, *, max_shard_size: Union[int, str] = "5GB") -> None:
    """Write a Hugging Face folder that plain ``transformers`` loads, from a (wrapped) model.

    A collective: every rank calls it; rank 0 writes. Flat buffers are gathered one at a time
    (about one block), converted back to the checkpoint layout transformers expects in files
    (per-expert MoE tensors, legacy names the model was loaded from), and each shard file is
    written as soon as its tensors are complete, so rank 0 holds at most one shard file and one
    buffer. Tied weights are written once, under the name transformers keeps. The folder is
    written beside ``folder`` and swapped in (see [Note: atomic folder]): an existing folder is
    never left half-written, and its other files (tokenizer, README) are kept.

    Args:
        model: a transformers ``PreTrainedModel``, wrapped by :func:`bmtwrap.wrap` or not.
        folder: the output folder, on rank 0's file system.
        max_shard_size: largest shard file, in bytes or as ``"5GB"``/``"500MB"``; a larger model
            is split into ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``.

    Raises:
        TypeError: ``model`` is not a transformers model.
        OSError and others: writing failed on rank 0 (re-raised there; the other ranks raise
            ``RuntimeError``); ``folder`` keeps its previous content.

    Example::

        bmtwrap.checkpoint.hf.save_pretrained(model, "out/step-1000")
        # later, anywhere, without bmtwrap:
        model = AutoModelForCausalLM.from_pretrained("out/step-1000")
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    hf = _hf_model(model, "save_pretrained")
    final = Path(folder)
    if final.exists() and not final.is_dir():
        raise ValueError(f"save_pretrained writes a folder, but {final} is a file")
    ctx = _dist.current() if _dist.is_initialized() else None
    entries = _entries(model)
    keys = _saved_keys(hf, entries)
    plan = _plan_save(hf, entries, keys)
    split = split_torch_state_dict_into_shards(plan.outputs, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    total_parameters = sum(entries[k].shape.numel() for k in keys if isinstance(entries[k].value, nn.Parameter))
    tmp = temporary_name(final)
    # Rank 0 keeps joining the gathers after a failed write (the other ranks cannot know), and
    # every rank learns of the failure at the end.
    error = _export(hf, entries, plan, _ShardWriter(tmp, split) if ctx is None or ctx.rank == 0 else None)
    if (ctx is None or ctx.rank == 0) and error is None:
        try:
            _finish_folder(hf, tmp, final, split, total_parameters)
        except Exception as exc:
            error = exc
    if error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    if ctx is not None and ctx.world_size > 1:
        failed = torch.tensor([int(error is not None)], device=ctx.device)
        dist.broadcast(failed, src=0, group=ctx.group)
        if failed.item() and error is None:
            raise RuntimeError(f"rank 0 failed to write {final}; its error says why. The folder was left as it was")
    if error is not None:
        raise error


def _export(hf: nn.Module, entries: Dict[str, _Entry], plan: _SavePlan,
            writer: Optional["_ShardWriter"]) -> Optional[Exception]:
    """Gather buffer by buffer (every rank), convert and write (the rank with a ``writer``).

    Returns the writer's first error instead of raising it, after joining every gather.
    """
    error: Optional[Exception] = None
    if writer is not None:
        try:
            writer.folder.mkdir(parents=True)
        except Exception as exc:
            error = exc
    held: Dict[str, torch.Tensor] = {}  # gathered inputs of groups not yet complete
    view = _FullShapes(hf, entries)
    for step in plan.steps:
        keep = writer is not None and error is None
        held.update(_collect(step, entries, keep=keep))
        if not keep:
            continue
        try:
            for group in step.groups:
                out = group.run(held.__getitem__, view, hf.config, plan.rename)
                for _, source, _ in group.sources:
                    held.pop(source, None)
                for name, value in out.items():
                    writer.add(name, value)
        except Exception as exc:
            error = exc
    return error


def _finish_folder(hf: nn.Module, tmp: Path, final: Path, split: Any, total_parameters: int) -> None:
    """Index, configs and carried-over files into ``tmp``; then swap it in for ``final``."""
    if split.is_sharded:
        index = {"metadata": {"total_parameters": total_parameters, **split.metadata},
                 "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        with atomic_file(tmp / INDEX_NAME) as path:
            path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    _write_configs(hf, tmp)
    _carry_over(final, tmp)
    fsync_dir(tmp)
    _swap_in(tmp, final)
