"""Checksums of checkpoint bytes: a CRC-32 per fixed-size chunk, computed while saving, checked before loading.

[Note: chunked checksums]
A checkpoint's reader takes slices: a loading rank reads only the rows covering its own range of
each tensor (resharding), so one checksum over a whole tensor could only be checked by reading
all of it on every rank. Instead the bytes of each stored tensor (each piece of a sharded
checkpoint, each tensor of a full ``.safetensors`` file) are cut into chunks of ``chunk_bytes``
from the tensor's first byte, the last one shorter, and each chunk has its CRC-32. A read of bytes
[a, b) of a tensor checks the chunks holding them, reading up to their boundaries: at most one
chunk too many at each end of each range read.

CRC-32 (``zlib.crc32``): in the standard library, detects every burst error of up to 32 bits
(a flipped bit, a torn sector's first bytes) and random damage with probability 1 - 2^-32 per
chunk, runs at about 4 GB/s per core here, and releases the GIL, so chunks are checked on a few
threads. It guards against damage, not against tampering: anyone can recompute it.

Checks run before anything is written into the model (a loader collects them while it plans its
reads, runs them, and agrees across ranks), and they read the file with ``pread``: an I/O error
becomes an ``OSError`` naming the file, where a memory map would kill the process with SIGBUS.
The bytes then read again by safetensors come from the page cache.

Cost and chunk size, measured on the 2-core dev machine (a 504 MB sharded checkpoint: 42M fp32
parameters with their AdamW moments; world size 1 unless said; process CPU time, as other jobs
shared the cores): saving computes the CRCs at about 4 GB/s (+0.13 s of CPU on 0.15 s); checking
before a load costs +0.17 s of CPU per 504 MB (pread and CRC, about 3 GB/s; on top of 0.08 s for
a warm-cache load, which only copies pages). That cost was the same for 64 KiB, 256 KiB, 1 MiB and
4 MiB chunks once adjacent chunks are read and checked as one 16 MiB task (``_TASK_BYTES``); with
a thread task per chunk, 64 KiB chunks were 2-3x slower. Loading at world size 2 what world size 1
saved (each rank's ranges start and end inside chunks), rank 0's check cost 0.08-0.09 s of CPU
with 64 KiB to 1 MiB chunks and 0.11 s with 4 MiB: the over-read. So the size is set by what it
costs elsewhere: each range a rank reads may over-read up to one chunk at each end (at 256 KiB,
about 0.3 GB per rank when resharding a 7B model's 1,200 tensors with Adam state, some 2.5% of its
share), and the index grows by 8 bytes per chunk (3.2 MB of index.json per 100 GB; 13 MB at
64 KiB). Hence 256 KiB.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Sequence, Set, Tuple

import torch

__all__: List[str] = []  # private to the checkpoint package

CHUNK_BYTES = 256 << 10  # see [Note: chunked checksums] for the measurement behind it
_THREADS_FROM = 16 << 20  # less than this is checksummed on the calling thread: a pool would cost more
_IO_FIX = "check the disk or file system it is on, or restore the file from an intact copy"
_TASK_BYTES = 16 << 20  # one thread's task: this much of adjacent chunks, read and checked at once


def _threads() -> int:
    """Worker threads for checksums: the cores this process may run on, at most 4."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores))


def tensor_bytes(value: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy; valid while ``value`` lives.

    Not through ``Tensor.numpy()``: that marks the storage as not resizable for good, and the
    engine frees gathered buffers by resizing their storage to zero.
    """
    assert value.device.type == "cpu" and value.is_contiguous(), "tensor_bytes needs a contiguous CPU tensor"
    nbytes = value.numel() * value.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(value.data_ptr())).cast("B")


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    """How many chunks ``nbytes`` bytes make (none for none)."""
    return -(-nbytes // chunk_bytes)


def chunk_crcs(datas: Sequence[memoryview], chunk_bytes: int) -> List[str]:
    """The CRC-32s of every ``chunk_bytes`` chunk of each buffer, as text (on a few threads when there is much).

    The text of a buffer is 8 hex digits per chunk, in order (``_crc_text``): compact in JSON,
    where a list of numbers would take a line each in an indented index. A thread's task is a
    run of up to ``_TASK_BYTES`` of chunks: a task per chunk would cost more in hand-offs than
    the checksum itself at small chunk sizes.
    """
    per_task = max(1, _TASK_BYTES // chunk_bytes) * chunk_bytes
    tasks = [(i, start) for i, data in enumerate(datas) for start in range(0, len(data), per_task)]

    def one(task: Tuple[int, int]) -> List[int]:
        data = datas[task[0]][task[1] : task[1] + per_task]
        return [zlib.crc32(data[k : k + chunk_bytes]) for k in range(0, len(data), chunk_bytes)]

    out: List[List[int]] = [[] for _ in datas]
    for (i, _), sums in zip(tasks, _map(one, tasks, sum(len(data) for data in datas))):
        out[i].extend(sums)
    return [_crc_text(sums) for sums in out]


def _crc_text(crcs: Sequence[int]) -> str:
    """CRC-32s as text: 8 hex digits each."""
    return "".join(f"{crc:08x}" for crc in crcs)


def is_crc_text(text: Any, chunks: int) -> bool:
    """Whether ``text`` is the text of ``chunks`` CRC-32s."""
    if not isinstance(text, str) or len(text) != 8 * chunks:
        return False
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


def _map(function: Callable[[Any], Any], items: Sequence[Any], nbytes: int) -> List[Any]:
    """``function`` over ``items`` (``nbytes`` to checksum in all): on the calling thread when that is little."""
    if nbytes < _THREADS_FROM or len(items) < 2:
        return [function(item) for item in items]
    with ThreadPoolExecutor(_threads()) as pool:
        return list(pool.map(function, items))


# --- the layout of a safetensors file ------------------------------------------------------------


class SafetensorsLayout(NamedTuple):
    """Where a safetensors file keeps each tensor's bytes."""

    data_start: int  # the file offset of the data section (after the 8-byte length and the header)
    header_crc: int  # CRC-32 of the length and the header, as stored
    tensors: Dict[str, Tuple[str, Tuple[int, ...], int, int]]  # name → (dtype, shape, begin, end) in the data
    metadata: Dict[str, str]


def read_safetensors_layout(path: Path) -> SafetensorsLayout:
    """Parse a safetensors file's header (the format: 8-byte little-endian length, then a JSON header).

    Raises:
        ValueError: the header cannot be parsed (the caller names the fix).
        OSError: the file cannot be read.
    """
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise ValueError("the file is shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > os.fstat(handle.fileno()).st_size - 8:
            raise ValueError(f"the header length {length} runs past the end of the file")
        text = handle.read(length)
    header: Dict[str, Any] = json.loads(text)
    metadata = header.pop("__metadata__", None) or {}
    tensors = {name: (spec["dtype"], tuple(spec["shape"]), *spec["data_offsets"]) for name, spec in header.items()}
    return SafetensorsLayout(8 + length, zlib.crc32(text, zlib.crc32(head)), tensors, metadata)


# --- checking ------------------------------------------------------------------------------------


class _Check(NamedTuple):
    path: Path
    offset: int  # in the file
    size: int
    expected: int
    what: str  # the tensor or record, as the error names it
    span: Tuple[int, int]  # the bytes of ``what`` checked, for the error


class ChunkVerifier:
    """Collects checks of file byte ranges against recorded CRC-32s; :meth:`run` reads and checks them all.

    ``fix`` ends the error for bytes that do not match (what the user should do); ``recorded``
    says where the checksums came from ("index.json", "its header"). A range added twice is
    checked once.
    """

    def __init__(self, *, fix: str, recorded: str) -> None:
        self._fix = fix
        self._recorded = recorded
        self._checks: List[_Check] = []
        self._seen: Set[Tuple[Path, int]] = set()

    def add(self, path: Path, what: str, offset: int, size: int, expected: int, span: Tuple[int, int]) -> None:
        """Check ``size`` bytes at file ``offset`` (``span``: which bytes of ``what`` they are)."""
        if (path, offset) not in self._seen:
            self._seen.add((path, offset))
            self._checks.append(_Check(path, offset, size, expected, what, span))

    def add_chunks(self, path: Path, name: str, data_offset: int, nbytes: int, crcs: str, chunk_bytes: int,
                   start: int, end: int) -> None:
        """Check the chunks of a tensor (``nbytes`` at file ``data_offset``) holding its bytes [start, end).

        ``crcs``: the tensor's chunks' CRC-32s as :func:`chunk_crcs` writes them.
        """
        assert len(crcs) == 8 * chunk_count(nbytes, chunk_bytes), f"{len(crcs) // 8} checksums for {nbytes} bytes"
        if start >= end:
            return
        for k in range(start // chunk_bytes, chunk_count(end, chunk_bytes)):
            lo, hi = k * chunk_bytes, min(nbytes, (k + 1) * chunk_bytes)
            self.add(path, f"'{name}'", data_offset + lo, hi - lo, int(crcs[8 * k : 8 * k + 8], 16), (lo, hi))

    def run(self) -> None:
        """Read and check every range added, on a few threads.

        Raises:
            ValueError: a range's bytes do not match (the first in file order is named, with how
                many more failed), or the file ends before it.
            OSError: a file cannot be read.
        """
        checks = sorted(self._checks, key=lambda c: (str(c.path), c.offset))
        self._checks, self._seen = [], set()
        fds: Dict[Path, int] = {}
        try:
            for check in checks:
                if check.path not in fds:
                    fds[check.path] = self._open(check.path)
            tasks = _tasks(checks)
            found = [crc for sums in _map(lambda task: self._crcs(fds[task[0].path], task), tasks,
                                          sum(c.size for c in checks)) for crc in sums]
        finally:
            for fd in fds.values():
                os.close(fd)
        bad = [(check, crc) for check, crc in zip(checks, found) if crc != check.expected]
        if bad:
            check, crc = bad[0]
            more = f"; {len(bad) - 1} more chunk(s) fail too" if len(bad) > 1 else ""
            raise ValueError(
                f"{check.path} is corrupt: bytes [{check.span[0]}, {check.span[1]}) of {check.what} have CRC-32 "
                f"{crc:08x}, but {self._recorded} records {check.expected:08x}{more}; {self._fix}")

    def _open(self, path: Path) -> int:
        try:
            return os.open(path, os.O_RDONLY)
        except OSError as caught:
            raise OSError(caught.errno, f"cannot open {path} to check its checksums ({caught.strerror}); "
                                        f"{_IO_FIX}") from caught

    def _crcs(self, fd: int, task: Sequence[_Check]) -> List[int]:
        """The CRC-32 of each check of a task: adjacent ranges read at once, or one large range in blocks."""
        first, last = task[0], task[-1]
        if len(task) == 1 and first.size > _TASK_BYTES:  # a whole zip record: not held in memory at once
            crc = 0
            for offset in range(0, first.size, _TASK_BYTES):
                crc = zlib.crc32(self._pread(fd, first, first.offset + offset,
                                             min(_TASK_BYTES, first.size - offset)), crc)
            return [crc]
        data = memoryview(self._pread(fd, first, first.offset, last.offset + last.size - first.offset))
        return [zlib.crc32(data[c.offset - first.offset : c.offset - first.offset + c.size]) for c in task]

    def _pread(self, fd: int, check: _Check, offset: int, size: int) -> bytes:
        try:
            data = os.pread(fd, size, offset)
        except OSError as caught:
            raise OSError(caught.errno, f"cannot read {check.path} ({caught.strerror}); {_IO_FIX}") from caught
        if len(data) < size:
            raise ValueError(f"{check.path} ends before bytes [{check.span[0]}, {check.span[1]}) of {check.what}: "
                             f"the file is truncated; {self._fix}")
        return data


def _tasks(checks: Sequence[_Check]) -> List[List[_Check]]:
    """Checks (sorted by file and offset) in tasks: runs of adjacent ranges of one file, up to ``_TASK_BYTES``."""
    tasks: List[List[_Check]] = []
    size = 0
    for check in checks:
        last = tasks[-1][-1] if tasks else None
        if (last is None or last.path != check.path or last.offset + last.size != check.offset
                or size + check.size > _TASK_BYTES):
            tasks.append([])
            size = 0
        tasks[-1].append(check)
        size += check.size
    return tasks
