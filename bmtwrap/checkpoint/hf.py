"""Hugging Face checkpoint folders: stream one into a sharded model.

Writing one out of a model is :func:`save_pretrained`, in ``hf_export`` and re-exported here; the
key conversions both directions share are in ``hf_keys``.

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
"""

from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any, Dict, List, Optional, Set, Tuple, Type

import torch
from torch import nn

from ..engine import dist as _dist
from ..engine.full_state import tp_cut
from ..wrap import materialize, wrap
from ..wrap.materialize import restore_buffers
from .hf_export import save_pretrained
from .hf_keys import INDEX_NAME, WEIGHTS_NAME, _conversions, _entries, _Entry, _FullShapes, _Group, _hf_model, _split
from .io import PathLike, read_flat_range

__all__ = ["from_pretrained", "load_pretrained", "save_pretrained"]

_REFETCH = "download or copy the checkpoint folder again"
_DTYPES = MappingProxyType({
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2})


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

        try:
            if spec.path not in self._handles:
                self._handles[spec.path] = safe_open(str(spec.path), framework="pt", device="cpu")
            sliced = self._handles[spec.path].get_slice(key)
            if span is None or len(spec.shape) == 0:
                whole = sliced[...]
                return whole if span is None else whole.reshape(-1)[span[0] : span[1]]
            start, end = span
            if start >= end:
                return torch.empty(0, dtype=spec.dtype)
            return read_flat_range(sliced, start, end)
        except Exception as caught:  # the file changed since its header was read: the model may be partly loaded
            raise ValueError(f"cannot read '{key}' from {spec.path} ({type(caught).__name__}: {caught}), whose header "
                             f"was readable when the load began; the model may be partly loaded: {_REFETCH} and "
                             "load again") from caught

    def close(self) -> None:
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.__exit__(None, None, None)


def _read_checkpoint(folder: Path) -> _Checkpoint:
    """Headers of every tensor of an HF folder (single file or index + shards).

    Raises:
        FileNotFoundError: no folder, no safetensors weights in it, or a shard file the index
            names is missing.
        ValueError: a weight file, the index or config.json is truncated or corrupt (named); the
            index lists a tensor its shard file does not hold.
    """
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder} is not a folder; pass a local Hugging Face checkpoint folder (download one from the Hub "
            "with huggingface_hub.snapshot_download)")
    index_path = folder / INDEX_NAME
    if index_path.exists():
        weight_map: Dict[str, str] = _read_json(index_path, "weight_map")
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
    tensors: Dict[str, _FileTensor] = {}
    for name in files:
        for key, (dtype_name, shape) in _read_header(folder / name).items():
            dtype = _DTYPES.get(dtype_name)
            if dtype is None:
                raise NotImplementedError(f"tensor '{key}' in {name} has dtype {dtype_name}, which bmtwrap cannot load")
            tensors[key] = _FileTensor(folder / name, shape, dtype)
    stray = [k for k, f in weight_map.items() if k not in tensors or tensors[k].path.name != f]
    if stray:
        raise ValueError(f"{index_path} lists tensors its shard files do not hold: {', '.join(sorted(stray)[:10])}")
    config_path = folder / "config.json"
    config = _read_json(config_path, None) if config_path.is_file() else {}
    return _Checkpoint(folder, tensors, config)


def _read_header(path: Path) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """Each tensor's dtype name and shape, from a safetensors file's header (which safetensors checks whole).

    Raises:
        ValueError: the file is truncated or corrupt (never safetensors' own error, which names no file).
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            slices = {key: handle.get_slice(key) for key in handle.keys()}
            return {key: (sliced.get_dtype(), tuple(sliced.get_shape())) for key, sliced in slices.items()}
    except Exception as caught:  # SafetensorError, OSError, ...
        raise ValueError(f"{path} is not a readable safetensors file ({type(caught).__name__}: {caught}): it is "
                         f"truncated or corrupt (an interrupted download or copy?); {_REFETCH}") from caught


def _read_json(path: Path, field: Optional[str]) -> Any:
    """The JSON object in ``path`` (its ``field``, if given); an error naming the file if it cannot be read."""
    try:
        value = json.loads(path.read_text())
        return value if field is None else value[field]
    except (OSError, ValueError, KeyError, TypeError) as caught:
        what = f"a JSON object with '{field}'" if field else "JSON"
        raise ValueError(f"{path} cannot be read as {what} ({type(caught).__name__}: {caught}): it is truncated "
                         f"or corrupt; {_REFETCH}") from caught


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
        value = tp_cut(entry.slot, value).reshape(-1)[piece.param_start : piece.param_end]
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
                # A parameter split by tensor parallelism is read whole and cut to this rank's slice in _write.
                whole = entry.slot is None or entry.slot.tp_split_dim is not None
                span = None if whole else (entry.slot.piece.param_start, entry.slot.piece.param_end)
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
    prefix present or absent), and tied weights absent from the file are filled through their tie.
    On a model built on the meta device, the buffers no checkpoint holds (rotary ``inv_freq``,
    Gemma's ``embed_scale``) are computed by the model's own ``_init_weights``, as transformers'
    ``from_pretrained`` computes them: every parameter and buffer ends up equal to what
    transformers loads from the same folder. Every name and shape is checked before anything is
    written. No collective runs
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
            a checkpoint of another architecture; a truncated or corrupt weight file, index or
            config.json (its path given). Nothing is written then. (Hugging Face files carry no
            checksums: damage inside a tensor's bytes cannot be seen.)

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


def _saved_class(config: Any) -> str:
    return (getattr(config, "architectures", None) or [type(config).__name__.removesuffix("Config") + " model"])[0]


def _class_for(config: Any) -> str:
    """The class the folder was saved from where transformers has it, else the Auto class for its kind."""
    import transformers

    saved = (getattr(config, "architectures", None) or [""])[0]
    if saved and isinstance(getattr(transformers, saved, None), type):
        return saved
    return "AutoModelForSeq2SeqLM" if getattr(config, "is_encoder_decoder", False) else "AutoModel"


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
        FileNotFoundError, ValueError: as :func:`load_pretrained`; ValueError also when the Auto
            class cannot build the folder's model (a T5 without ``model_class``), naming the class to pass.

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
    dtype = _resolve_dtype(torch_dtype, config, checkpoint)
    mapping = getattr(model_class, "_model_mapping", None)  # an Auto class's: the config classes it builds
    if mapping is not None and type(config) not in mapping:
        # transformers' own message lists every config class the Auto class takes, not model_class=.
        raise ValueError(f"{folder} holds a {_saved_class(config)} ({type(config).__name__}), which "
                         f"{model_class.__name__} cannot build; pass the class to build as model_class=, e.g. "
                         f"from_pretrained({str(folder)!r}, model_class=transformers.{_class_for(config)})")
    with torch.device("meta"):
        model = build(config, dtype=dtype)
    wrap(model, **wrap_options)
    _load(model, checkpoint, strict=strict)
    if (folder / "generation_config.json").is_file() and model.can_generate():
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    return model.eval()
