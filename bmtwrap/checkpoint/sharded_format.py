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

- ``format``, ``version``: ``"bmtwrap.sharded"``, 2.
- ``tag``, ``world_size``, ``shard_size``: of the save (``shard_size``: the ranks each parameter was
  sharded over, hybrid sharding; absent from older saves, which sharded over the world). Pieces
  are coordinates in the full tensors, so a save loads at any world and shard size.
- ``checksums``: ``{"algorithm": "crc32", "chunk_bytes": 262144}`` (see [Note: chunked checksums]
  in ``checksum``).
- ``files``: {file name: {"rank", "bytes", "header_crc32"}}; the size detects a truncated file
  before it is read, the CRC-32 of the file's first bytes (length and header: names, dtypes,
  shapes, offsets) a damaged or replaced header.
- ``tensors``: {tensor name: {"dtype", "shape" (the full shape), "pieces": [[file, start, end, crcs],
  ...]}}, where ``crcs`` is the CRC-32 of each ``chunk_bytes`` chunk of the piece's stored bytes, as
  8 hex digits each, one string.
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

Version 1 (bmtwrap before checksums) is version 2 without ``checksums``, ``header_crc32`` and the
pieces' ``crcs``: it still loads, with the file sizes and headers checked but not the bytes.

Checking: a loading rank checks, before anything changes, every file header it opens and every
chunk that its reads touch (reading up to chunk boundaries), and a file the index names that it
reads nothing from is not read at all. The index itself carries no checksum: damage to it mostly
fails to parse or to match the files; a changed number in it (a learning rate) would go unseen.

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
from typing import Any, Dict, List, NamedTuple, Optional, Set, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .checksum import (
    CHUNK_BYTES,
    ChunkVerifier,
    SafetensorsLayout,
    chunk_count,
    chunk_crcs,
    is_crc_text,
    read_safetensors_layout,
    tensor_bytes,
)
from .io import atomic_file

FORMAT = "bmtwrap.sharded"
VERSION = 2
_READABLE = (1, 2)  # version 1: no checksums (see [Note: sharded checkpoint format])
_FIX = "restore the file from an intact copy, or load an earlier checkpoint"
_MISMATCH_FIX = ("the file was damaged (on disk or in a copy) or is not the one this index was written with: "
                 "restore it from an intact copy of the checkpoint, or load an earlier checkpoint")
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
            self.describe(name, value, shape)
        if value.numel():
            self.entries.append((name, value.detach().reshape(-1), start))

    def describe(self, name: str, value: torch.Tensor, shape: Tuple[int, ...]) -> None:
        """Name ``name``'s dtype (``value``'s) and full ``shape`` in the index."""
        self.tensors[name] = {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(shape)}

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
        tensors = {name: value.to("cpu").contiguous() for name, value, _ in chunk}
        crcs = chunk_crcs([tensor_bytes(value) for value in tensors.values()], CHUNK_BYTES)
        with atomic_file(path) as tmp:
            save_file(tensors, str(tmp), metadata={"format": FORMAT, "tag": tag, "rank": str(rank)})
            header_crc = read_safetensors_layout(tmp).header_crc
        written.append(path)
        part.files[path.name] = {"rank": rank, "bytes": path.stat().st_size, "header_crc32": header_crc}
        for (name, value, start), sums in zip(chunk, crcs):
            part.pieces[name] = [path.name, start, start + value.numel(), sums]
    return written


def _build_index(tag: str, world_size: int, parts: List[Dict[str, Any]], head: Dict[str, Any],
                 shard_size: int) -> Dict[str, Any]:
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
    return {"format": FORMAT, "version": VERSION, "tag": tag, "world_size": world_size, "shard_size": shard_size,
            "checksums": {"algorithm": "crc32", "chunk_bytes": CHUNK_BYTES}, "files": files, "tensors": tensors,
            **head, "rng": [part["rng"] for part in parts]}


# --- reading --------------------------------------------------------------------------------------


def _read_index(folder: Path) -> Dict[str, Any]:
    path = folder / INDEX
    if not path.is_file():
        raise FileNotFoundError(f"no sharded checkpoint in {folder}: {path} does not exist (a save that did not "
                                "finish writes none); pass the folder given to save_checkpoint")
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as caught:
        raise ValueError(f"{path} cannot be read as JSON ({caught}): the index is damaged; {_FIX}") from caught
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{path} is not the index of a bmtwrap sharded checkpoint (format "
                         f"{index.get('format') if isinstance(index, dict) else None!r}, expected {FORMAT!r})")
    if index.get("version") not in _READABLE:
        raise ValueError(f"{path} has format version {index.get('version')!r}; this bmtwrap reads versions "
                         f"{', '.join(map(str, _READABLE))}: load it with the bmtwrap version that wrote it")
    absent = [key for key in _INDEX_FIELDS + (("checksums",) if index["version"] >= 2 else ()) if key not in index]
    if absent:
        raise ValueError(f"{path} lacks the fields {absent}: the index is damaged; {_FIX}")
    try:
        _check_layout(index)
        return _decode(index)  # every tagged value at once: a bad one is found before anything changes
    except (KeyError, IndexError, TypeError, AttributeError) as caught:
        raise ValueError(f"{path} is damaged: a field has the wrong form ({type(caught).__name__}: {caught}); "
                         f"{_FIX}") from caught


def _check_layout(index: Dict[str, Any]) -> None:
    """The form of the fields that say where the bytes are, so a damaged index fails here, not half-way.

    Raises TypeError, KeyError or ValueError (``_read_index`` names the file).
    """
    chunk = index["checksums"]["chunk_bytes"] if index["version"] >= 2 else None
    if chunk is not None and (index["checksums"]["algorithm"] != "crc32" or not _is_int(chunk) or chunk <= 0):
        raise TypeError(f"checksums {index['checksums']!r} are not a CRC-32 over chunks of a positive size")
    for file, record in index["files"].items():
        sums = chunk is None or _is_int(record["header_crc32"])
        if not (_is_int(record["rank"]) and _is_int(record["bytes"]) and sums):
            raise TypeError(f"files[{file!r}] is {record!r}")
    for name, meta in index["tensors"].items():
        dtype = getattr(torch, meta["dtype"], None)
        if not isinstance(dtype, torch.dtype) or not all(_is_int(n) and n >= 0 for n in meta["shape"]):
            raise TypeError(f"tensors[{name!r}] has dtype {meta['dtype']!r} and shape {meta['shape']!r}")
        for piece in meta["pieces"]:
            file, start, end = piece[:3]
            shaped = len(piece) == (3 if chunk is None else 4) and isinstance(file, str)
            if not (shaped and _is_int(start) and _is_int(end) and 0 <= start < end):
                raise TypeError(f"tensors[{name!r}] has a piece {piece!r}")
            if chunk is not None and not is_crc_text(piece[3], chunk_count((end - start) * dtype.itemsize, chunk)):
                raise TypeError(f"tensors[{name!r}] has checksums {piece[3]!r:.40} that do not fit its piece "
                                f"[{start}, {end})")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in index["model"].items()):
        raise TypeError("model maps a key to something other than a tensor name")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _OpenFile(NamedTuple):
    handle: Any  # safetensors' safe_open
    layout: SafetensorsLayout


class _ShardReader:
    """Reads flat slices of a checkpoint's tensors.

    :meth:`require` checks that the files hold what a read will take and queues the checksums of
    the chunks it touches; :meth:`verify` checks those. Both run before anything changes.
    """

    def __init__(self, folder: Path, index: Dict[str, Any], stack: ExitStack) -> None:
        self._folder = folder
        self._index = index
        self._stack = stack
        self._open: Dict[str, _OpenFile] = {}
        checked = "checksums" in index  # version 1 has none
        self._chunk_bytes: Optional[int] = index["checksums"]["chunk_bytes"] if checked else None
        self._verifier = ChunkVerifier(fix=_MISMATCH_FIX, recorded=f"{folder / INDEX}") if checked else None
        self._required: Set[Tuple[str, int, int]] = set()

    def shape(self, name: str) -> Tuple[int, ...]:
        if name not in self._index["tensors"]:
            raise ValueError(f"the checkpoint index names tensor '{name}' but does not describe it: the index "
                             "is damaged")
        return tuple(self._index["tensors"][name]["shape"])

    def _overlaps(self, name: str, start: int, end: int) -> List[Tuple[Any, ...]]:
        """(file, piece start, piece end, from, to, its chunks' CRCs or None) of each piece overlapping [start, end)."""
        found = []
        for file, lo, hi, *crcs in self._index["tensors"][name]["pieces"]:
            if lo < end and start < hi:
                found.append((file, lo, hi, max(lo, start), min(hi, end), crcs[0] if crcs else None))
        return sorted(found, key=lambda piece: piece[3])

    def require(self, name: str, start: int, end: int) -> None:
        """Check that the checkpoint covers [start, end) of ``name`` with whole files; open them; queue checksums."""
        self.shape(name)  # described at all
        itemsize = getattr(torch, self._index["tensors"][name]["dtype"]).itemsize
        cursor = start
        for file, lo, hi, a, b, crcs in self._overlaps(name, start, end):
            if a > cursor:
                break
            cursor = max(cursor, b)
            opened = self._file(file)
            spec = opened.layout.tensors.get(name)
            if spec is None or math.prod(spec[1]) != hi - lo or spec[3] - spec[2] != (hi - lo) * itemsize:
                raise ValueError(f"{self._folder / file} does not hold the {hi - lo} elements of '{name}' that the "
                                 "index records: the file is corrupt or from another save; load an earlier checkpoint")
            if self._verifier is not None:
                self._verifier.add_chunks(self._folder / file, name, opened.layout.data_start + spec[2],
                                          spec[3] - spec[2], crcs, self._chunk_bytes, (a - lo) * itemsize,
                                          (b - lo) * itemsize)
        if cursor < end:
            raise ValueError(f"the checkpoint holds no values for elements [{cursor}, {end}) of '{name}' (the saved "
                             "pieces do not cover them): it is incomplete")
        self._required.add((name, start, end))

    def verify(self) -> None:
        """Check the checksums of every chunk the required reads touch (see [Note: chunked checksums]).

        Raises:
            ValueError: a chunk's bytes differ from what was saved, naming the file and the tensor.
            OSError: a file cannot be read.
        """
        if self._verifier is not None:
            self._verifier.run()

    def _file(self, file: str) -> _OpenFile:
        """The open file and its layout, after checking it is whole and belongs to this save."""
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
            layout = read_safetensors_layout(path)
        except Exception as caught:
            raise ValueError(f"{path} is corrupt: it is not a readable safetensors file ({caught}); copy it again, "
                             "or load an earlier checkpoint") from caught
        if tag != self._index["tag"]:
            raise ValueError(f"{path} belongs to another save (tag {tag!r}, the index's is {self._index['tag']!r}); "
                             "the folder mixes checkpoints: copy the whole folder again")
        if "header_crc32" in record and layout.header_crc != record["header_crc32"]:
            raise ValueError(f"{path} is corrupt: its header (tensor names, dtypes, shapes, offsets) has CRC-32 "
                             f"{layout.header_crc:08x}, but {self._folder / INDEX} records "
                             f"{record['header_crc32']:08x}; {_MISMATCH_FIX}")
        self._open[file] = _OpenFile(handle, layout)
        return self._open[file]

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened ``name``, reading only those bytes of each file.

        Only after :meth:`require` (and :meth:`verify`) of the same range.
        """
        assert (name, start, end) in self._required, f"'{name}' [{start}, {end}) is read without being checked"
        dtype = getattr(torch, self._index["tensors"][name]["dtype"])
        out = torch.empty(end - start, dtype=dtype)
        for file, lo, _, a, b, _ in self._overlaps(name, start, end):
            try:
                out[a - start : b - start] = self._open[file].handle.get_slice(name)[a - lo : b - lo]
            except Exception as caught:  # the file changed since it was checked: this rank may be partly loaded
                raise ValueError(f"cannot read '{name}' from {self._folder / file} ({caught}), which was readable "
                                 f"when the load began; the model may be partly loaded: {_FIX}, and load "
                                 "again") from caught
        return out
