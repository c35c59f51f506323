"""The on-disk format of a sharded checkpoint: file names, the index, and writing and reading shard files.

Private to ``sharded``, which orchestrates saving and loading across ranks (see
[Note: commit protocol] there); nothing here communicates. A rank queues its pieces in a
``_RankPart`` and writes them with ``_write_files``; rank 0 merges every rank's report with
``_build_index``; a loading rank checks the index with ``_read_index`` and reads slices through
a ``_ShardReader``.

[Note: sharded checkpoint format]
A checkpoint is a folder::

    folder/
      index.json                                  the commit point, written last, by rank 0
      shard-<tag>-r00000-000.safetensors          rank 0's pieces, its RNG state, every replicated tensor
      shard-<tag>-r00001-000.safetensors          rank 1's pieces and RNG state
      ...                                         (a rank's pieces may span several numbered files)

``<tag>`` is 16 hex digits drawn afresh by every save, so a save never writes a file that an
existing index refers to. Every tensor is stored flattened to 1-D under its name:
``model/<state dict key>``, ``optim/<i>/<parameter name>/<state key>``, ``rng/<rank>/torch_cpu``
and ``rng/<rank>/torch_cuda``. A sharded tensor (a sharded parameter, or optimizer state shaped like
its local shard) is spread over the files of the ranks that owned a piece of it, each file
holding the slice [start, end) of the flattened full tensor; a replicated tensor (buffers,
parameters that are not sharded, their optimizer state) is stored whole, once, by rank 0.

``index.json`` holds:

- ``format``, ``version``: ``"bmtwrap.sharded"``, 1.
- ``tag``, ``world_size``: of the save.
- ``files``: {file name: {"rank", "bytes"}}; the size detects a truncated file before it is read.
- ``tensors``: {tensor name: {"dtype", "shape" (the full shape), "pieces": [[file, start, end], ...]}}.
- ``model``: {state dict key: tensor name}; tied parameters are several keys naming one tensor.
- ``optimizers``: one entry per optimizer: {"type", "param_groups": [hyper-parameters with
  "params" as parameter names], "state": {parameter name: {state key: {"tensor": name} or
  {"value": scalar}}}}. Parameter names are the model's state dict keys, so the state follows the
  parameter to whatever piece of it a rank owns at load time.
- ``lr_schedulers``: each scheduler's ``state_dict()``; ``optim_manager``: an OptimManager's
  state without its optimizers (loss scale ...), or null.
- ``rng``: per saving rank: Python ``random`` and NumPy states, and the names of its torch states.
- ``step``, ``extra``: the caller's.

Values that JSON cannot hold as they are (tuples, 0-dim tensors such as torch Adam's ``step``,
dtypes, dicts with non-string keys) are written as tagged objects and come back with their type.

Invariants: the pieces of one tensor are disjoint; every file a piece names is listed in
``files``; no file is modified once an index names it.

Resharding follows from the coordinates: a piece's [start, end) indexes the flattened full
tensor, not a flat buffer, so padding, alignment and the saving world size do not matter. A
loading rank takes the range its ``LocalPiece`` gives it now and reads, from each saved piece
overlapping it, just the overlap (``safe_open(...).get_slice(name)[a:b]`` reads only those bytes).
"""

from __future__ import annotations

import json
import math
import re
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .io import atomic_file

FORMAT = "bmtwrap.sharded"
VERSION = 1
INDEX = "index.json"
_SHARD_FILE = re.compile(r"^shard-[0-9a-f]{16}-r\d{5,}-\d{3,}\.safetensors$")
_TEMPORARY = re.compile(r"^\.(shard-.*\.safetensors|index\.json)\.tmp-")
_INDEX_FIELDS = ("tag", "world_size", "files", "tensors", "model", "optimizers", "lr_schedulers", "optim_manager",
                 "rng", "step", "extra")
_TAG = "__bmtwrap__"  # marks a tagged JSON value (see [Note: sharded checkpoint format])


# --- JSON with types ---------------------------------------------------------------------------


def _encode(value: Any, where: str) -> Any:
    """``value`` as JSON, tagging what JSON would lose (see [Note: sharded checkpoint format])."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_encode(v, where) for v in value]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [_encode(v, where) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: _encode(v, f"{where}.{k}") for k, v in value.items()}
        return {_TAG: "dict", "items": [[_encode(k, where), _encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return {_TAG: "tensor", "value": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, torch.dtype):
        return {_TAG: "dtype", "name": str(value).removeprefix("torch.")}
    raise TypeError(f"{where} is a {type(value).__name__}, which a sharded checkpoint cannot store: it holds "
                    "tensors, numbers, strings, booleans, None, dtypes and lists/tuples/dicts of them")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(_TAG)
    if kind is None:
        return {k: _decode(v) for k, v in value.items()}
    if kind == "tuple":
        return tuple(_decode(v) for v in value["items"])
    if kind == "dict":
        return {_decode(k): _decode(v) for k, v in value["items"]}
    if kind == "tensor":
        return torch.tensor(value["value"], dtype=getattr(torch, value["dtype"]))
    if kind == "dtype":
        return getattr(torch, value["name"])
    raise ValueError(f"the checkpoint index holds a value tagged {kind!r}, which this bmtwrap does not know "
                     "(written by a newer version?)")


# --- writing --------------------------------------------------------------------------------------


@dataclass
class _RankPart:
    """What one rank saves: its tensors, and what it tells rank 0 for the index."""

    entries: List[Tuple[str, torch.Tensor, int]] = field(default_factory=list)  # (name, 1-D value, start)
    tensors: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # name → dtype and full shape
    optim_state: List[Dict[str, Dict[str, Any]]] = field(default_factory=list)  # per optimizer: name → state
    rng: Dict[str, Any] = field(default_factory=dict)
    pieces: Dict[str, List[Any]] = field(default_factory=dict)  # name → [file, start, end], after writing
    files: Dict[str, Dict[str, int]] = field(default_factory=dict)

    def add(self, name: str, value: torch.Tensor, start: int, shape: Tuple[int, ...], describe: bool = True) -> None:
        """Queue the slice of ``name`` starting at ``start`` (``value``, any shape) for writing."""
        if describe:
            self.tensors[name] = {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(shape)}
        if value.numel():
            self.entries.append((name, value.detach().reshape(-1), start))

    def for_index(self) -> Dict[str, Any]:
        return {"tensors": self.tensors, "optim_state": self.optim_state, "rng": self.rng, "pieces": self.pieces,
                "files": self.files}


def _write_files(folder: Path, tag: str, rank: int, part: _RankPart, max_file_bytes: int) -> List[Path]:
    """Write this rank's entries into as few files of at most ``max_file_bytes`` as possible."""
    chunks: List[List[Tuple[str, torch.Tensor, int]]] = [[]]
    size = 0
    for entry in part.entries:
        nbytes = entry[1].numel() * entry[1].element_size()
        if chunks[-1] and size + nbytes > max_file_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(entry)
        size += nbytes
    written: List[Path] = []
    for k, chunk in enumerate(chunks):
        path = folder / f"shard-{tag}-r{rank:05d}-{k:03d}.safetensors"
        # On a GPU only this chunk is copied to the host at a time; CPU tensors are written in place.
        tensors = {name: value.to("cpu") for name, value, _ in chunk}
        with atomic_file(path) as tmp:
            save_file(tensors, str(tmp), metadata={"format": FORMAT, "tag": tag, "rank": str(rank)})
        written.append(path)
        part.files[path.name] = {"rank": rank, "bytes": path.stat().st_size}
        for name, value, start in chunk:
            part.pieces[name] = [path.name, start, start + value.numel()]
    return written


def _build_index(tag: str, world_size: int, parts: List[Dict[str, Any]], head: Dict[str, Any]) -> Dict[str, Any]:
    """Merge every rank's report into the index (rank 0)."""
    tensors: Dict[str, Dict[str, Any]] = {}
    files: Dict[str, Dict[str, int]] = {}
    for part in parts:
        for name, meta in part["tensors"].items():
            tensors.setdefault(name, {**meta, "pieces": []})
        files.update(part["files"])
    for part in parts:
        for name, piece in part["pieces"].items():
            tensors[name]["pieces"].append(piece)
    for i, optimizer in enumerate(head["optimizers"]):
        for part in parts:  # the first rank that reported a parameter's state gives its scalars
            for name, entry in part["optim_state"][i].items():
                optimizer["state"].setdefault(name, entry)
    return {"format": FORMAT, "version": VERSION, "tag": tag, "world_size": world_size, "files": files,
            "tensors": tensors, **head, "rng": [part["rng"] for part in parts]}


# --- reading --------------------------------------------------------------------------------------


def _read_index(folder: Path) -> Dict[str, Any]:
    path = folder / INDEX
    if not path.is_file():
        raise FileNotFoundError(f"no sharded checkpoint in {folder}: {path} does not exist (a save that did not "
                                "finish writes none); pass the folder given to save_checkpoint")
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as caught:
        raise ValueError(f"{path} cannot be read as JSON ({caught}): the index is damaged") from caught
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{path} is not the index of a bmtwrap sharded checkpoint (format "
                         f"{index.get('format') if isinstance(index, dict) else None!r}, expected {FORMAT!r})")
    if index.get("version") != VERSION:
        raise ValueError(f"{path} has format version {index.get('version')!r}; this bmtwrap reads version "
                         f"{VERSION}: load it with the bmtwrap version that wrote it")
    absent = [key for key in _INDEX_FIELDS if key not in index]
    if absent:
        raise ValueError(f"{path} lacks the fields {absent}: the index is damaged")
    return _decode(index)  # every tagged value at once: a bad one is found before anything changes


class _ShardReader:
    """Reads flat slices of a checkpoint's tensors; :meth:`require` checks them before anything changes."""

    def __init__(self, folder: Path, index: Dict[str, Any], stack: ExitStack) -> None:
        self._folder = folder
        self._index = index
        self._stack = stack
        self._open: Dict[str, Any] = {}

    def shape(self, name: str) -> Tuple[int, ...]:
        if name not in self._index["tensors"]:
            raise ValueError(f"the checkpoint index names tensor '{name}' but does not describe it: the index "
                             "is damaged")
        return tuple(self._index["tensors"][name]["shape"])

    def _overlaps(self, name: str, start: int, end: int) -> List[Tuple[str, int, int, int, int]]:
        """(file, piece start, piece end, from, to) of every saved piece overlapping [start, end)."""
        found = []
        for file, lo, hi in self._index["tensors"][name]["pieces"]:
            if lo < end and start < hi:
                found.append((file, lo, hi, max(lo, start), min(hi, end)))
        return sorted(found, key=lambda piece: piece[3])

    def require(self, name: str, start: int, end: int) -> None:
        """Check that the checkpoint covers [start, end) of ``name`` with whole files; open them."""
        self.shape(name)  # described at all
        cursor = start
        for file, lo, hi, a, b in self._overlaps(name, start, end):
            if a > cursor:
                break
            cursor = max(cursor, b)
            _, stored = self._file(file)
            if stored.get(name) != hi - lo:
                raise ValueError(f"{self._folder / file} does not hold the {hi - lo} elements of '{name}' that the "
                                 "index records: the file is corrupt or from another save; load an earlier checkpoint")
        if cursor < end:
            raise ValueError(f"the checkpoint holds no values for elements [{cursor}, {end}) of '{name}' (the saved "
                             "pieces do not cover them): it is incomplete")

    def _file(self, file: str) -> Tuple[Any, Dict[str, int]]:
        """The open file and the length of each tensor in it, after checking it is whole."""
        if file in self._open:
            return self._open[file]
        path = self._folder / file
        record = self._index["files"].get(file)
        if record is None:
            raise ValueError(f"the checkpoint index names {file} for a piece but does not list it: the index is "
                             "damaged")
        if not path.is_file():
            raise FileNotFoundError(f"the checkpoint in {self._folder} is incomplete: {path} (rank {record['rank']}'s "
                                    "shard file, named by its index) is missing; copy the whole folder, or load "
                                    "an earlier checkpoint")
        size = path.stat().st_size
        if size != record["bytes"]:
            raise ValueError(f"{path} is {size} bytes but the index records {record['bytes']}: the file is truncated "
                             "or was replaced (an interrupted copy?); copy it again, or load an earlier checkpoint")
        try:
            handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            tag = (handle.metadata() or {}).get("tag")
            stored = {key: math.prod(handle.get_slice(key).get_shape()) for key in handle.keys()}
        except Exception as caught:
            raise ValueError(f"{path} is corrupt: it is not a readable safetensors file ({caught}); copy it again, "
                             "or load an earlier checkpoint") from caught
        if tag != self._index["tag"]:
            raise ValueError(f"{path} belongs to another save (tag {tag!r}, the index's is {self._index['tag']!r}); "
                             "the folder mixes checkpoints: copy the whole folder again")
        self._open[file] = (handle, stored)
        return self._open[file]

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened ``name``, reading only those bytes of each file."""
        dtype = getattr(torch, self._index["tensors"][name]["dtype"])
        out = torch.empty(end - start, dtype=dtype)
        for file, lo, _, a, b in self._overlaps(name, start, end):
            out[a - start : b - start] = self._open[file][0].get_slice(name)[a - lo : b - lo]
        return out
