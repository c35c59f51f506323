"""The two file formats of :func:`bmtwrap.save`, written as a stream (see [Note: streaming both formats]
in ``full``): safetensors (header first, then each tensor's bytes) and torch.save's zip archive (its
layout taken from torch.save itself, then each storage's bytes put in place).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import struct
import zipfile
import zlib
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any, Dict, Iterator, Mapping, NamedTuple, Optional, Protocol, Sequence, Tuple

import torch

from ..group import ParamSlot

__all__ = ["SAFETENSORS_SUFFIX"]  # the rest is private to the checkpoint package: full.py is the public side

SAFETENSORS_SUFFIX = ".safetensors"

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


def _write_raw(handle: IO[bytes], value: torch.Tensor, *, crc: bool = False) -> int:
    """Write the bytes of a CPU tensor (no copy when it is contiguous); return their CRC-32 if ``crc``, else 0.

    Not through ``Tensor.numpy()``: that marks the storage as not resizable for good, and the
    engine frees gathered buffers by resizing their storage to zero.
    """
    flat = value.reshape(-1)  # holds the bytes alive while ``data`` points at them
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return 0
    data = memoryview((ctypes.c_char * nbytes).from_address(flat.data_ptr())).cast("B")
    handle.write(data)
    return zlib.crc32(data) if crc else 0


# --- saving: the two formats --------------------------------------------------------------------


class _Writer(Protocol):
    def write(self, entry: _Entry, value: torch.Tensor) -> None: ...

    def finish(self) -> None: ...


class _SafetensorsWriter:
    """Header first, then each tensor's bytes in the order they arrive (see [Note: streaming both formats])."""

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
        header: Dict[str, Any] = {"__metadata__": {"format": "pt"}}
        for entry in entries:
            header[entry.key] = {"dtype": _safetensors_dtype(entry), "shape": list(entry.shape),
                                 "data_offsets": list(offsets[entry.key])}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data start 8-byte aligned, as safetensors writes them
        handle.write(struct.pack("<Q", len(text)))
        handle.write(text)

    def write(self, entry: _Entry, value: torch.Tensor) -> None:
        assert entry is self._order[self._next], f"{entry.key} arrived out of order"
        _write_raw(self._handle, value)
        self._next += 1

    def finish(self) -> None:
        assert self._next == len(self._order), f"{len(self._order) - self._next} tensors were not written"


def _safetensors_dtype(entry: _Entry) -> str:
    name = _SAFETENSORS_DTYPES.get(entry.dtype)
    if name is None:
        raise NotImplementedError(f"'{entry.key}' has dtype {entry.dtype}, which bmtwrap does not write to "
                                  "safetensors; save to a .pt file instead")
    return name


class _ZipRecord(NamedTuple):
    data_offset: int  # where the record's bytes start in the file
    size: int
    crc_offsets: Tuple[int, ...]  # where its CRC-32 is stored (data descriptor or local header; central directory)


def _zip_records(path: Path) -> Dict[str, _ZipRecord]:
    """Every record of a zip archive (stored, uncompressed), keyed by name."""
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
            assert info.compress_type == zipfile.ZIP_STORED, f"record {info.filename} is compressed"
            raw.seek(info.header_offset)
            local = raw.read(30)
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            data = info.header_offset + 30 + name_len + extra_len
            if info.flag_bits & 0x08:  # sizes and CRC follow the data, after an optional signature
                raw.seek(data + info.file_size)
                descriptor = data + info.file_size + (4 if raw.read(4) == b"PK\x07\x08" else 0)
            else:
                descriptor = info.header_offset + 14
            records[info.filename] = _ZipRecord(data, info.file_size, (descriptor, central[info.filename]))
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
        records = {name.split("/")[-1]: rec for name, rec in _zip_records(path).items()
                   if name.split("/")[-2:-1] == ["data"]}
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
        self._crcs[entry.ident] = _write_raw(self._handle, value, crc=True)

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
