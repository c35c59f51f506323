"""The two file formats of :func:`bmtwrap.save`, written as a stream (see [Note: streaming both formats]
in ``full``): safetensors (header first, then each tensor's bytes) and torch.save's zip archive (its
layout taken from torch.save itself, then each storage's bytes put in place); and, for loading,
checking the bytes of either against the checksums the file carries (see [Note: checksums in full
files] in ``full``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import zipfile
import zlib
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Protocol, Sequence, Tuple
from typing import TypeVar

import torch

from ..engine.group import ParamSlot
from .checksum import (
    CHUNK_BYTES,
    ChunkVerifier,
    chunk_count,
    chunk_crcs,
    is_crc_text,
    read_safetensors_layout,
    tensor_bytes,
)

__all__ = ["SAFETENSORS_SUFFIX"]  # the rest is private to the checkpoint package: full.py is the public side

SAFETENSORS_SUFFIX = ".safetensors"
# The safetensors header's metadata (str → str) where bmtwrap.save keeps its checksums: the chunk
# size, and per tensor the CRC-32 of each chunk of its bytes (see [Note: chunked checksums]).
CHUNK_KEY = "bmtwrap.crc32_chunk_bytes"
CRC_PREFIX = "bmtwrap.crc32."
_Digest = TypeVar("_Digest")

# torch dtype ↔ the safetensors header's name for it.
_SAFETENSORS_DTYPES: Mapping[torch.dtype, str] = MappingProxyType({
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
})


class _Entry(NamedTuple):
    """One state-dict key as it will be written."""

    key: str
    shape: torch.Size  # full shape
    dtype: torch.dtype
    ident: int  # id() of the tensor object: tied keys share it
    slot: Optional[ParamSlot]  # where a sharded parameter lives in its buffer
    value: Optional[torch.Tensor]  # the full tensor, when it is not sharded


def _write_raw(handle: IO[bytes], value: torch.Tensor, digest: Callable[[memoryview], _Digest]) -> _Digest:
    """Write the bytes of a CPU tensor (no copy when it is contiguous); return ``digest`` of them."""
    flat = value.reshape(-1).contiguous()  # holds the bytes alive while ``data`` points at them
    data = tensor_bytes(flat)
    handle.write(data)
    return digest(data)


def _chunk_crcs(data: memoryview) -> str:
    return chunk_crcs([data], CHUNK_BYTES)[0]


# --- saving: the two formats --------------------------------------------------------------------


class _Writer(Protocol):
    def write(self, entry: _Entry, value: torch.Tensor) -> None: ...

    def finish(self) -> None: ...


class _SafetensorsWriter:
    """Header first, then each tensor's bytes in the order they arrive (see [Note: streaming both formats]).

    The header reserves each tensor's checksums (fixed-width hex digits, zeros); :meth:`finish`
    writes them in place, so the header keeps its length.
    """

    def __init__(self, handle: IO[bytes], entries: Sequence[_Entry], order: Sequence[_Entry]) -> None:
        self._handle = handle
        self._order = list(order)
        self._next = 0
        offsets: Dict[str, Tuple[int, int]] = {}
        cursor = 0
        for entry in order:
            nbytes = entry.shape.numel() * entry.dtype.itemsize
            offsets[entry.key] = (cursor, cursor + nbytes)
            cursor += nbytes
        metadata = {"format": "pt", CHUNK_KEY: str(CHUNK_BYTES)}
        for entry in entries:
            chunks = chunk_count(offsets[entry.key][1] - offsets[entry.key][0], CHUNK_BYTES)
            metadata[CRC_PREFIX + entry.key] = "0" * 8 * chunks
        self._header: Dict[str, Any] = {"__metadata__": metadata}
        for entry in entries:
            self._header[entry.key] = {"dtype": _safetensors_dtype(entry), "shape": list(entry.shape),
                                       "data_offsets": list(offsets[entry.key])}
        self._length = self._write_header()

    def _write_header(self) -> int:
        text = json.dumps(self._header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data start 8-byte aligned, as safetensors writes them
        self._handle.write(struct.pack("<Q", len(text)))
        self._handle.write(text)
        return len(text)

    def write(self, entry: _Entry, value: torch.Tensor) -> None:
        assert entry is self._order[self._next], f"{entry.key} arrived out of order"
        self._header["__metadata__"][CRC_PREFIX + entry.key] = _write_raw(self._handle, value, _chunk_crcs)
        self._next += 1

    def finish(self) -> None:
        assert self._next == len(self._order), f"{len(self._order) - self._next} tensors were not written"
        self._handle.seek(0)
        assert self._write_header() == self._length, "the header changed length when its checksums were filled in"


def _safetensors_dtype(entry: _Entry) -> str:
    name = _SAFETENSORS_DTYPES.get(entry.dtype)
    if name is None:
        raise NotImplementedError(f"'{entry.key}' has dtype {entry.dtype}, which bmtwrap does not write to "
                                  "safetensors; save to a .pt file instead")
    return name


class _ZipRecord(NamedTuple):
    data_offset: int  # where the record's bytes start in the file
    size: int
    crc: int  # the CRC-32 of its bytes, as the central directory records it
    crc_offsets: Tuple[int, ...]  # where its CRC-32 is stored (data descriptor or local header; central directory)


def _zip_records(path: Path) -> Dict[str, _ZipRecord]:
    """Every stored (uncompressed) record of a zip archive, keyed by name; compressed ones are left out."""
    records: Dict[str, _ZipRecord] = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
        central: Dict[str, int] = {}
        raw.seek(archive.start_dir)
        for _ in archive.infolist():
            fixed = raw.read(46)
            assert fixed[:4] == b"PK\x01\x02", "unexpected zip central directory"
            name_len, extra_len, comment_len = struct.unpack("<HHH", fixed[28:34])
            name = raw.read(name_len).decode()
            central[name] = raw.tell() - name_len - 46 + 16
            raw.seek(extra_len + comment_len, os.SEEK_CUR)
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED:  # torch.save stores every record
                continue
            raw.seek(info.header_offset)
            local = raw.read(30)
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            data = info.header_offset + 30 + name_len + extra_len
            if info.flag_bits & 0x08:  # sizes and CRC follow the data, after an optional signature
                raw.seek(data + info.file_size)
                descriptor = data + info.file_size + (4 if raw.read(4) == b"PK\x07\x08" else 0)
            else:
                descriptor = info.header_offset + 14
            records[info.filename] = _ZipRecord(data, info.file_size, info.CRC, (descriptor, central[info.filename]))
    return records


class _TorchWriter:
    """torch.save's archive for fake tensors, then each storage's bytes put in place.

    See [Note: streaming both formats].
    """

    def __init__(self, path: Path, entries: Sequence[_Entry]) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        skeleton: Dict[str, torch.Tensor] = {}
        fakes: Dict[int, torch.Tensor] = {}
        with FakeTensorMode():
            for entry in entries:
                if entry.ident not in fakes:
                    fakes[entry.ident] = torch.empty(entry.shape, dtype=entry.dtype)
                skeleton[entry.key] = fakes[entry.ident]
        with open(path, "wb") as handle, torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(skeleton, handle)
        # torch.save names storages data/0, data/1, ... in the order it first meets them while
        # pickling the dict, i.e. in the order of ``fakes``; the sizes confirm it.
        records = {name.split("/")[-1]: rec for name, rec in _storage_records(path).items()}
        self._records: Dict[int, _ZipRecord] = {}
        for index, (ident, fake) in enumerate(fakes.items()):
            record = records.get(str(index))
            nbytes = fake.numel() * fake.element_size()
            assert record is not None and record.size == nbytes, f"torch.save laid out storage {index} unexpectedly"
            self._records[ident] = record
        assert len(records) == len(fakes), "torch.save wrote more storages than the state dict has"
        self._crcs: Dict[int, int] = {}
        self._handle = open(path, "r+b")

    def write(self, entry: _Entry, value: torch.Tensor) -> None:
        if entry.ident in self._crcs:
            return  # a tied key: its storage is written already
        self._handle.seek(self._records[entry.ident].data_offset)
        self._crcs[entry.ident] = _write_raw(self._handle, value, zlib.crc32)

    def finish(self) -> None:
        missing = set(self._records) - set(self._crcs)
        assert not missing, f"{len(missing)} storages were not written"
        for ident, record in self._records.items():
            crc = struct.pack("<I", self._crcs[ident])
            for offset in record.crc_offsets:
                self._handle.seek(offset)
                self._handle.write(crc)
        self._handle.close()

    def close(self) -> None:
        self._handle.close()


@contextlib.contextmanager
def _open_writer(path: Path, tmp: Path, entries: Sequence[_Entry], order: Sequence[_Entry]) -> Iterator[_Writer]:
    if path.suffix == SAFETENSORS_SUFFIX:
        with open(tmp, "wb") as handle:
            yield _SafetensorsWriter(handle, entries, order)
    else:
        writer = _TorchWriter(tmp, entries)
        try:
            yield writer
        finally:
            writer.close()


def _storage_records(path: Path) -> Dict[str, _ZipRecord]:
    """The records of a ``torch.save`` archive that hold storages (``<archive>/data/<n>``), by full name."""
    return {name: rec for name, rec in _zip_records(path).items() if name.split("/")[-2:-1] == ["data"]}


# --- loading: checking the bytes read against the file's checksums ---------------------------------

_LOAD_FIX = "restore the file from an intact copy, or save it again"
_MISMATCH_FIX = f"the file was damaged on disk or in a copy: {_LOAD_FIX}"


def _check_safetensors(path: Path, reads: Mapping[str, Tuple[int, int]]) -> None:
    """Check the chunks holding each element range ``reads`` names against the CRC-32s ``bmtwrap.save`` wrote.

    A file without them (plain safetensors, transformers) is not checked.

    Raises:
        ValueError: bytes that do not match (naming the file and the tensor), or damaged checksums.
        OSError: the file cannot be read.
    """
    layout = read_safetensors_layout(path)
    chunk = layout.metadata.get(CHUNK_KEY)
    if chunk is None:
        return
    verifier = ChunkVerifier(fix=_MISMATCH_FIX, recorded="its header")
    for key, (start, end) in reads.items():
        _, shape, begin, stop = layout.tensors[key]
        crcs = layout.metadata.get(CRC_PREFIX + key)
        numel = math.prod(shape)
        chunks = chunk_count(stop - begin, int(chunk)) if chunk.isdigit() and int(chunk) > 0 else -1
        if not (numel and chunks >= 0 and is_crc_text(crcs, chunks)):
            raise ValueError(f"{path}: the checksums of '{key}' in its header ({CHUNK_KEY}, {CRC_PREFIX}{key}) are "
                             f"damaged; {_LOAD_FIX}")
        itemsize = (stop - begin) // numel
        verifier.add_chunks(path, key, layout.data_start + begin, stop - begin, crcs, int(chunk), start * itemsize,
                            end * itemsize)
    verifier.run()


def _check_zip(path: Path, state: Mapping[str, torch.Tensor], keys: Sequence[str], rank: int, world: int) -> None:
    """Check this rank's share of the zip records holding ``keys`` against the CRC-32s the archive records.

    [Note: checking a .pt file]
    A ``torch.save`` archive keeps each storage whole in one zip record with one CRC-32, so a
    record can only be checked by reading all of it, while a rank reads only its pieces. The
    records are therefore shared out among the ranks (largest first, each to the rank with the
    fewest bytes so far): each rank reads about 1/W of the file, as loading itself does, and a
    mismatch found by any rank makes every rank raise before any writes (``agree._agree_quoting``). This
    assumes every rank reads the same file (a shared file system), as loading a full file does.
    ``state``, from ``torch.load(mmap=True)``, gives each record's keys for the error: a storage
    lies at the map's base plus its record's offset.

    Raises:
        ValueError: a record's bytes do not match its CRC-32 (naming the file, the record and its keys).
        OSError: the file cannot be read.
    """
    records = _storage_records(path)
    holders = _record_keys(records, state)
    wanted = set(keys)
    chosen = sorted((name for name, held in holders.items() if not wanted.isdisjoint(held) or not held),
                    key=lambda name: (-records[name].size, name))
    loads = [0] * world
    verifier = ChunkVerifier(fix=_MISMATCH_FIX, recorded="the zip archive")
    for name in chosen:
        owner = loads.index(min(loads))
        loads[owner] += records[name].size
        if owner == rank and records[name].size:
            held = f" (tensor {', '.join(holders[name])})" if holders[name] else ""
            record = records[name]
            verifier.add(path, f"record '{name}'{held}", record.data_offset, record.size, record.crc, (0, record.size))
    verifier.run()


def _record_keys(records: Mapping[str, _ZipRecord], state: Mapping[str, torch.Tensor]) -> Dict[str, List[str]]:
    """The state dict keys each storage record holds; every record with none when they cannot be matched."""
    by_offset = {record.data_offset: name for name, record in records.items() if record.size}
    storages: Dict[int, List[str]] = {}
    for key, value in state.items():
        if value.untyped_storage().nbytes():
            storages.setdefault(value.untyped_storage().data_ptr(), []).append(key)
    out: Dict[str, List[str]] = {name: [] for name in records}
    if not storages or not by_offset:
        return out
    base = min(storages) - min(by_offset)
    if any(ptr - base not in by_offset for ptr in storages):
        return out  # not a memory-mapped load: every record is checked, named without its keys
    for ptr, held in storages.items():
        out[by_offset[ptr - base]].extend(held)
    return out
