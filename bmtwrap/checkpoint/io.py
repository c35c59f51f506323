"""Files that appear whole or not at all.

[Note: atomic writes]
Every checkpoint file is written under a hidden temporary name in the same directory, flushed to
disk, and then renamed over its final name (``os.replace`` is atomic within one file system).
A crash, a kill or a full disk at any point leaves either the previous file or the new one, never
a torn mix; the temporary file of a failed write is removed when the failure is seen, and one
left by a killed process is ignored by loaders (hidden name, never referenced by an index).

[Note: file modes]
Some writers create their file readable by its owner alone (safetensors opens with mode 0600), so
a checkpoint would be unreadable by another user or an inference service while ``config.json``
beside it is not. Before the rename, the file gets the mode any file the user creates gets:
``0666`` less the process's umask, as ``open()`` would give.
"""

from __future__ import annotations

import math
import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Union

import torch

__all__ = ["atomic_file", "default_file_mode", "fsync_dir", "read_flat_range", "temporary_name", "unwritable"]

PathLike = Union[str, "os.PathLike[str]"]


def unwritable(what: str, err: BaseException, advice: str) -> RuntimeError:
    """The error of a save that could not write ``what``: the system's reason, then ``advice`` (the
    fix, and what is left as it was)."""
    error = RuntimeError(f"cannot write {what} ({type(err).__name__}: {err}); {advice}")
    error.__cause__ = err
    return error


def temporary_name(path: Path) -> Path:
    """A hidden sibling of ``path`` that no other writer picks."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _umask() -> int:
    # Linux reports the umask without changing it; elsewhere it can only be read by setting it.
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: ``0o666`` less the umask (see [Note: file modes])."""
    return 0o666 & ~_umask()


def fsync_dir(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path`` atomically.

    If the body raises (including ``KeyboardInterrupt`` and ``OSError`` for a full disk), the
    temporary file is removed and ``path`` keeps its previous content.

    Example::

        with atomic_file("model.pt") as tmp:
            torch.save(state, tmp)
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(final)
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)


def read_flat_range(sliced: Any, start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of a safetensors tensor, flattened, reading only the rows that cover them.

    ``sliced`` is what ``safe_open(...).get_slice(name)`` returns; the result may be a view of the
    file's memory map.
    """
    shape = sliced.get_shape()
    row = math.prod(shape[1:]) if shape else 0
    if row == 0:  # a scalar or an empty tensor: nothing to save by slicing
        return sliced[...].reshape(-1)[start:end]
    first, last = start // row, -(-end // row)  # rows [first, last) cover [start, end)
    return sliced[first:last].reshape(-1)[start - first * row : end - first * row]
