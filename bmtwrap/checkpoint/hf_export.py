"""Hugging Face checkpoint folders: write one out of a sharded model.

[Note: atomic folder]
``save_pretrained`` writes the whole folder under a hidden sibling (``.name.tmp-*``) and then
swaps it in: the old folder is renamed to ``.name.old-*``, the new one renamed to ``name``, and
the old one deleted. A reader therefore sees the complete old folder, the complete new one, or
(in the instant between the two renames) no folder at all, never a half-written one. A crash in
that instant leaves both complete folders under their hidden names, to be renamed back by hand.
Other files of an existing folder (tokenizer, README, training checkpoints) are carried over, as
transformers' own ``save_pretrained`` leaves them in place, by hard links where the file system
allows (no bytes are copied); stale weight shards are not.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Set, Union

import torch
import torch.distributed as dist
from torch import nn

from ..engine import dist as _dist
from ..engine.full_state import tp_join
from ..engine.group import FlatBuffer
from .hf_keys import (
    INDEX_NAME,
    WEIGHTS_NAME,
    _apply_converters,
    _apply_renamings,
    _conversions,
    _entries,
    _Entry,
    _FullShapes,
    _Group,
    _hf_model,
    _split,
)
from .io import PathLike, atomic_file, fsync_dir, temporary_name

__all__ = ["save_pretrained"]

_SHARD_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
_OURS = frozenset({WEIGHTS_NAME, INDEX_NAME, "config.json", "generation_config.json"})


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
    from transformers.core_model_loading import dot_natural_key

    reverse = [t.reverse_transform() for t in _conversions(hf, for_save=True)[::-1]]
    renamings, converters, by_pattern = _split(reverse)
    groups: Dict[str, _Group] = {}
    for key in sorted(keys, key=dot_natural_key):
        renamed, pattern = _apply_converters(key, converters)
        if pattern is None:  # a converter's outputs are renamed after it runs (see _Group.run)
            renamed = _apply_renamings(key, renamings)
        group = groups.setdefault(renamed, _Group(renamed, by_pattern[pattern] if pattern else None))
        if pattern is None and group.sources:
            raise ValueError(f"'{group.sources[0][1]}' and '{key}' would both be saved as '{renamed}'")
        group.sources.append((renamed, key, pattern or key))

    of_key = {src: group for group in groups.values() for _, src, _ in group.sources}
    rename = functools.partial(_apply_renamings, renamings=renamings)
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
    with buffer.gathered() as flat:
        # Every rank joins the slices of a parameter split by tensor parallelism (a collective of its group).
        whole = {k: tp_join(entries[k].slot, entries[k].slot.view_in(flat)) for k in step.keys}
        return {k: value.to("cpu", copy=True) for k, value in whole.items()} if keep else {}


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


def _link_or_copy(source: str, target: str) -> None:
    """A hard link where the file system allows it (no bytes copied: a carried-over folder may hold
    training checkpoints of many GB), else a copy made durable."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
        _fsync(Path(target))


def _carry_over(old: Path, new: Path) -> None:
    """Files of an existing folder that this save does not replace (tokenizer, README, ...)."""
    if not old.is_dir():
        return
    for item in old.iterdir():
        leftover = item.name.startswith(".") and ".tmp-" in item.name  # a killed writer's temporary file
        if item.name in _OURS or _SHARD_FILE.fullmatch(item.name) or leftover or (new / item.name).exists():
            continue
        if item.is_dir():
            shutil.copytree(item, new / item.name, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(item), str(new / item.name))


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
