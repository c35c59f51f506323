"""Full (consolidated) checkpoints: one file with the unwrapped model's keys, any world size.

[Note: saving one flat buffer at a time]
:func:`save` never builds the full state dict. The state dict's entries are grouped by the flat
buffer that holds them (a block's parameters, the root's, or a plain tensor on its own), in the
order the state dict first names each buffer. Every rank gathers one buffer, rank 0 copies it
to the host (one copy into a pinned staging buffer on a GPU) and writes the entries it holds,
and the buffer is released before the next one is gathered. So device memory grows by at most
one gathered buffer (one block, or the root with the embeddings), and rank 0's host memory by
one staging buffer: the file itself is written as the buffers arrive, never held whole.
A buffer that several keys name (tied weights: a root parameter listed at the top and the
bottom of the state dict) is gathered once, which is why the file's data follow buffer order
while its index follows state-dict order.

[Note: streaming both formats]
Both formats put an index before the data, and the index needs only shapes and dtypes, which
every rank knows without gathering anything:

- safetensors: 8-byte little-endian header length, a JSON header of ``{key: {dtype, shape,
  data_offsets}}``, then the raw bytes. The header is written first with offsets in the order
  the data will arrive; safetensors readers sort entries by offset, so the data need not follow
  the keys' order. Tied tensors are written once per key: safetensors refuses shared storage.
- torch.save: a zip archive whose ``data.pkl`` describes each tensor and whose ``data/<n>``
  records hold the storages. ``torch.serialization.skip_data`` writes that archive for fake
  tensors of the right shapes, reserving (not writing) each record's bytes; each buffer's
  values are then written into their records as they arrive, and each record's CRC-32 is
  patched in at the end so that the archive is a valid zip, not just one ``torch.load`` accepts.
  Tied tensors share one record, as in ``torch.save(model.state_dict())``. ``skip_data`` is
  marked a prototype in torch and fake tensors live in ``torch._subclasses``: if either changes,
  ``full_format._TorchWriter`` is the one place to adapt (it checks the archive's layout it relies on,
  and the tests read its files with plain ``torch.load`` and ``zipfile``).

The alternative, collecting the state on rank 0 and calling ``torch.save`` once (BMTrain's way),
needs the whole model in rank 0's host memory at once: 140 GB for a 70B model in bf16.

[Note: failing together]
``save`` and ``load`` are collectives, so a failure seen by one rank must not leave the others
waiting in a collective. Rank 0 alone opens and writes the file; its I/O errors are held until
a point where every rank agrees (an all-gather of each rank's error, if any) whether anyone
failed, and then every rank raises, the others quoting the failing rank's error. Errors of the
gathers themselves happen on every rank alike and propagate directly. ``load`` checks the file,
every key and shape, and the checksums of the bytes it will read on every rank, agrees, and
only then writes: on any error, no rank's model has changed.

[Note: checksums in full files]
``.safetensors``: ``save`` writes the CRC-32 of every chunk of each tensor's bytes into the
header's ``__metadata__`` (``bmtwrap.crc32_chunk_bytes``, and ``bmtwrap.crc32.<key>``: 8 hex
digits per chunk; see [Note: chunked checksums] in ``checksum``). The header is written before
the data, with zeros reserved for them, and rewritten in place once the data are written (hex
digits of fixed width: the header keeps its length). ``load`` checks the chunks holding the
range each rank reads; a file without them (plain safetensors, transformers) loads unchecked.
The header itself is not covered: safetensors checks that its offsets and shapes agree.
``.pt``: a zip archive already holds a CRC-32 per storage record, which ``torch.load`` does
not check; ``load`` checks them, each rank its share of the records (see [Note: checking a
.pt file] in ``full_format``). A file in torch's legacy (non-zip) format has no checksums.
"""

from __future__ import annotations

import contextlib
import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Protocol, Sequence, Tuple

import safetensors
import torch
from torch import nn

from ..engine.dist import DistContext
from ..engine.full_state import tp_cut, tp_full_shape, tp_join
from ..engine.group import FlatBuffer
from ..engine.schedule import engine
from ..wrap.materialize import restore_buffers
from .agree import _agree_quoting
from .full_format import (
    SAFETENSORS_SUFFIX,
    _check_safetensors,
    _check_zip,
    _Entry,
    _open_writer,
    _safetensors_dtype,
    _Writer,
)
from .io import PathLike, atomic_file, read_flat_range, unwritable
from .pieces import load_pieces
from .sharded import save_checkpoint

__all__ = ["load", "load_state_dict", "save"]

_LIST_AT_MOST = 20  # names listed per problem in an error message


# --- checking keys and shapes ---------------------------------------------------------------------


def _full_shape(value: torch.Tensor) -> torch.Size:
    eng = engine()
    if isinstance(value, nn.Parameter) and eng.registry.is_sharded(value):
        return tp_full_shape(eng.registry.slot_of(eng.ctx, value)[1])
    return value.shape


def _listed(names: Sequence[str]) -> str:
    more = f" … ({len(names) - _LIST_AT_MOST} more)" if len(names) > _LIST_AT_MOST else ""
    return ", ".join(names[:_LIST_AT_MOST]) + more


def _check_keys(expected: Mapping[str, torch.Tensor], given: Mapping[str, Sequence[int]], strict: bool,
                source: str = "this state dict") -> None:
    """Raise one ValueError listing every missing, unexpected and mis-shaped key (``given``: key → shape).

    A key whose tensor is tied to a key that is present is not missing: Hugging Face files leave
    out ``lm_head.weight`` of a model whose head shares the embedding.
    """
    present = {id(v) for k, v in expected.items() if k in given}
    missing = [k for k, v in expected.items() if k not in given and id(v) not in present]
    unexpected = [k for k in given if k not in expected]
    problems: List[str] = []
    if strict and missing:
        problems.append(f"missing keys ({len(missing)}): {_listed(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {_listed(unexpected)}")
    shapes = [f"{k}: checkpoint {tuple(given[k])}, model {tuple(_full_shape(v))}"
              for k, v in expected.items() if k in given and tuple(given[k]) != tuple(_full_shape(v))]
    if shapes:
        problems.append(f"shape mismatches ({len(shapes)}): {'; '.join(shapes[:_LIST_AT_MOST])}")
    if problems:
        fixes = []
        if strict and (missing or unexpected):
            fixes.append("pass strict=False to load only the keys both have")
        if shapes:
            fixes.append("a shape mismatch means the checkpoint comes from a model of another configuration")
        raise ValueError(f"cannot load {source} into the model, nothing was changed ({'; '.join(fixes)}):\n  "
                         + "\n  ".join(problems))


# --- reading: where the values come from ----------------------------------------------------------


class _Read(NamedTuple):
    """The part of one key that this rank reads: elements [start, end) of the flattened tensor."""

    key: str
    start: int
    end: int
    buffer: Optional[FlatBuffer]  # the flat buffer holding it, when the key is a sharded parameter


class _Source(Protocol):
    """A checkpoint's tensors, read piece by piece."""

    def shapes(self) -> Dict[str, Tuple[int, ...]]: ...

    def verify(self, reads: Sequence[_Read], rank: int, world: int) -> None:
        """Check the bytes ``reads`` will take against the file's checksums, before anything is written."""
        ...

    def read_range(self, key: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor ``key``, 1-D."""
        ...

    def read(self, key: str) -> torch.Tensor: ...


class _TensorSource:
    """A state dict in memory (or memory-mapped by ``torch.load(mmap=True)``): nothing to check."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._tensors = state_dict

    def shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self._tensors.items()}

    def verify(self, reads: Sequence[_Read], rank: int, world: int) -> None:
        pass

    def read_range(self, key: str, start: int, end: int) -> torch.Tensor:
        return self._tensors[key].detach().reshape(-1)[start:end]

    def read(self, key: str) -> torch.Tensor:
        return self._tensors[key].detach()


class _ZipSource(_TensorSource):
    """A memory-mapped ``torch.save`` archive: its records' CRC-32s are checked (see [Note: checking a .pt file])."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], path: Path) -> None:
        super().__init__(state_dict)
        self._path = path

    def verify(self, reads: Sequence[_Read], rank: int, world: int) -> None:
        with _named_errors(self._path):
            _check_zip(self._path, self._tensors, [read.key for read in reads], rank, world)


class _SafetensorsSource:
    """A safetensors file: reads only the rows that cover the requested elements."""

    def __init__(self, handle: Any, path: Path) -> None:
        self._handle = handle
        self._path = path

    def shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {k: tuple(self._handle.get_slice(k).get_shape()) for k in self._handle.keys()}

    def verify(self, reads: Sequence[_Read], rank: int, world: int) -> None:
        with _named_errors(self._path):
            _check_safetensors(self._path, {key: (start, end) for key, start, end, _ in reads if end > start})

    def read_range(self, key: str, start: int, end: int) -> torch.Tensor:
        with _named_errors(self._path, after_check=True):
            return read_flat_range(self._handle.get_slice(key), start, end)

    def read(self, key: str) -> torch.Tensor:
        with _named_errors(self._path, after_check=True):
            return self._handle.get_tensor(key)


def _corrupt(path: Path, err: BaseException) -> ValueError:
    error = ValueError(f"{path} is truncated or corrupt ({type(err).__name__}: {err}); "
                       "save it again, or load an intact copy")
    error.__cause__ = err
    return error


@contextlib.contextmanager
def _named_errors(path: Path, *, after_check: bool = False) -> Iterator[None]:
    """Errors of safetensors, torch and zipfile while reading ``path`` as errors naming it and the fix.

    Ours, which name the file already, pass through. ``after_check``: the file was checked before
    anything was written, so it changed since, and this rank may be partly loaded.
    """
    try:
        yield
    except Exception as err:  # safetensors' SafetensorError, zipfile's BadZipFile, struct.error, OSError ...
        if isinstance(err, (ValueError, OSError)) and str(path) in str(err):
            raise
        if not after_check:
            raise _corrupt(path, err) from err
        raise ValueError(f"cannot read {path} ({type(err).__name__}: {err}), which was readable when the load "
                         "began; the model may be partly loaded: restore the file and load again") from err


@contextlib.contextmanager
def _open_source(path: Path) -> Iterator[_Source]:
    """Open a checkpoint file for reading (its format chosen by its suffix).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is a folder, is truncated or corrupt, or holds something other than
            a state dict of tensors.
    """
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist; check the path (and that every rank can see it)")
    if path.is_dir():
        raise ValueError(f"{path} is a folder; bmtwrap.load reads one file written by bmtwrap.save, torch.save or "
                         "safetensors")
    if path.suffix == SAFETENSORS_SUFFIX:
        try:
            handle = safetensors.safe_open(str(path), framework="pt", device="cpu")
        except (safetensors.SafetensorError, ValueError, OSError) as err:
            raise _corrupt(path, err) from err
        with handle:
            yield _SafetensorsSource(handle, path)
        return
    try:
        # A file from torch.save(..., _use_new_zipfile_serialization=False) cannot be mapped; it
        # is read whole. A truncated zip also lands there and fails to load below.
        mapped = zipfile.is_zipfile(path)
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except pickle.UnpicklingError as err:
        if "weights only load failed" in str(err).lower():
            raise ValueError(f"{path} holds objects other than tensors (or its pickled index is damaged), and "
                             "bmtwrap.load reads weights only; if you trust the file, torch.load(path, "
                             "weights_only=False) it yourself and pass its state dict to bmtwrap.load_state_dict"
                             ) from err
        raise _corrupt(path, err) from err
    except (PermissionError, IsADirectoryError):
        raise
    except Exception as err:  # torch.load reports damage as RuntimeError, EOFError, KeyError, ...
        raise _corrupt(path, err) from err
    if not isinstance(state, Mapping):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict (a mapping of names to tensors)")
    wrong = [f"'{k}' ({type(v).__name__})" for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if wrong:
        raise ValueError(f"{path} is not a state dict of tensors: {_listed(wrong)}; if it is a training checkpoint, "
                         "load it with torch.load and pass its model state dict to bmtwrap.load_state_dict")
    yield _ZipSource(state, path) if mapped else _TensorSource(state)


def _plan_reads(model_state: Mapping[str, torch.Tensor], keys: Sequence[str]) -> List[_Read]:
    """What this rank reads of every key in ``keys``: its piece of a sharded parameter, anything else whole."""
    eng = engine()
    reads = []
    for key in keys:
        target = model_state[key]
        if isinstance(target, nn.Parameter) and eng.registry.is_sharded(target):
            buffer, slot = eng.registry.slot_of(eng.ctx, target)
            if tp_full_shape(slot) != slot.shape:  # split by tensor parallelism: read whole, cut in _copy_into
                reads.append(_Read(key, 0, tp_full_shape(slot).numel(), buffer))
            else:
                reads.append(_Read(key, slot.piece.param_start, slot.piece.param_end, buffer))
        else:
            reads.append(_Read(key, 0, target.numel(), None))
    return reads


@torch.no_grad()
def _copy_into(model_state: Mapping[str, torch.Tensor], source: _Source, reads: Sequence[_Read]) -> None:
    """Copy this rank's part of every key from ``source`` into the (sharded) model."""
    for key, start, end, buffer in reads:
        target = model_state[key]
        if buffer is not None:
            slot = buffer.slots[[id(s.param) for s in buffer.slots].index(id(target))]
            if tp_full_shape(slot) != slot.shape:
                piece = tp_cut(slot, source.read(key)).reshape(-1)[slot.piece.param_start : slot.piece.param_end]
                target.copy_(piece.to(device=target.device, dtype=target.dtype))
            elif end > start:
                target.copy_(source.read_range(key, start, end).to(device=target.device, dtype=target.dtype))
            buffer.initialized = True
        else:
            target.copy_(source.read(key).to(device=target.device, dtype=target.dtype))


# --- public: load -------------------------------------------------------------------------------


@torch.no_grad()
def load_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy a full state dict (the unwrapped model's keys and shapes) into a sharded model.

    Each rank copies only the pieces it owns; nothing is communicated. Every key is checked before
    anything is written, so a mismatch leaves the model unchanged. A model built on the meta
    device and wrapped is ready to run afterwards.

    Args:
        model: a model sharded by :func:`bmtwrap.wrap` or built from bmtwrap's blocks (a plain
            module works too).
        state_dict: full tensors under the unwrapped model's keys (``unwrapped.state_dict()``).
        strict: whether missing and unexpected keys are errors; shapes are always checked.

    Raises:
        ValueError: missing or unexpected keys (when ``strict``), or shape mismatches, each listed
            by name.

    Example::

        bmt.load_state_dict(model, AutoModelForCausalLM.from_pretrained(path).state_dict())
    """
    expected: Dict[str, torch.Tensor] = model.state_dict(keep_vars=True)
    _check_keys(expected, {k: tuple(v.shape) for k, v in state_dict.items()}, strict)
    _copy_into(expected, _TensorSource(state_dict), _plan_reads(expected, [k for k in expected if k in state_dict]))
    restore_buffers(model)


class IncompatibleKeys(NamedTuple):
    """What :func:`load` left out: keys of the model the file lacks, keys of the file the model lacks."""

    missing_keys: List[str]
    unexpected_keys: List[str]


@torch.no_grad()
def load(model: nn.Module, path: PathLike, *, strict: bool = True, load_gather: bool = True) -> IncompatibleKeys:
    """Load a full checkpoint file into a sharded model, at any world size (BMTrain's ``bmt.load``).

    Every rank reads only the part of each parameter it owns: ``.safetensors`` files through
    ``safetensors.safe_open`` (only the rows that cover this rank's range), any other suffix
    through ``torch.load(path, mmap=True, weights_only=True)``. The file may come from
    :func:`save` at any world size, from ``torch.save(unwrapped.state_dict())``, or from
    ``safetensors.torch.save_file``. Keys and shapes are checked on every rank before anything
    is written; on any error no rank's model has changed. Works on a model built on the meta
    device and then wrapped: the buffers the file does not hold (rotary ``inv_freq``, ...) are
    computed by the model's own initialiser, and one it cannot compute raises ``ValueError``.
    A collective: every rank calls it.

    Args:
        model: a model sharded by :func:`bmtwrap.wrap` or built from bmtwrap's blocks.
        path: the file.
        strict: whether missing and unexpected keys are errors; shapes are always checked.
        load_gather: accepted for BMTrain compatibility: what is at ``path`` decides. A file is read
            as above; a folder written by ``save(..., save_gather=False)`` is read with
            :func:`~bmtwrap.checkpoint.load_checkpoint` (model only; the RNGs are left alone),
            at any world size too.

    Returns:
        The missing and unexpected keys, as ``load_state_dict`` returns them (both empty when
        ``strict``).

    Before anything is written, each rank checks the bytes it will read against the checksums
    the file carries (see [Note: checksums in full files]): those :func:`save` writes into a
    ``.safetensors`` header, and the CRC-32 of each record of a ``.pt`` zip archive.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is truncated or corrupt (bytes that do not match their checksum name
            the tensor), is not a state dict of tensors, or does not fit the model (missing or
            unexpected keys when ``strict``, shape mismatches, each listed by name); ``path`` is a
            folder that ``save`` did not write.
        OSError: the file cannot be read.
        RuntimeError: another rank failed to read the file (its error is quoted).

    Example::

        bmt.load(model, "model.pt")
    """
    del load_gather  # see the docstring
    ctx = engine().ctx
    path = Path(path)
    if path.is_dir():
        return IncompatibleKeys(*load_pieces(model, path, strict=strict))
    expected: Dict[str, torch.Tensor] = model.state_dict(keep_vars=True)
    with contextlib.ExitStack() as stack:
        failure: Optional[BaseException] = None
        source: Optional[_Source] = None
        try:
            source = stack.enter_context(_open_source(path))
            shapes = source.shapes()
            _check_keys(expected, shapes, strict, source=str(path))
            reads = _plan_reads(expected, [k for k in expected if k in shapes])
            source.verify(reads, ctx.rank, ctx.world_size)
        except Exception as err:  # raised on every rank below, after the others know
            failure = err
        _agree_quoting(ctx, failure, f"loading {path}")
        assert source is not None
        _copy_into(expected, source, reads)
    restore_buffers(model)
    return IncompatibleKeys(sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected)))


# --- saving: what to write, in which order --------------------------------------------------------


@dataclass(eq=False)
class _Unit:
    """What one gather brings: a flat buffer's entries, or one unsharded tensor (``buffer`` None)."""

    buffer: Optional[FlatBuffer]
    entries: List[_Entry] = field(default_factory=list)


def _plan_save(model: nn.Module) -> Tuple[List[_Entry], List[_Unit]]:
    """The entries in state-dict order, and the units in the order they are gathered and written."""
    eng = engine()
    entries: List[_Entry] = []
    units: List[_Unit] = []
    by_buffer: Dict[int, _Unit] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            raise NotImplementedError(f"'{key}' holds a {type(value).__name__} (a module's extra state), and "
                                      "bmtwrap.save writes tensors only; save that state separately")
        if isinstance(value, nn.Parameter) and eng.registry.is_sharded(value):
            buffer, slot = eng.registry.slot_of(eng.ctx, value)
            entry = _Entry(key, tp_full_shape(slot), value.dtype, id(value), slot, None)
            unit = by_buffer.get(id(buffer))
            if unit is None:
                unit = by_buffer[id(buffer)] = _Unit(buffer)
                units.append(unit)
        else:
            entry = _Entry(key, value.shape, value.dtype, id(value), None, value.detach())
            unit = _Unit(None)
            units.append(unit)
        unit.entries.append(entry)
        entries.append(entry)
    return entries, units


def _host_values(units: Sequence[_Unit], ctx: DistContext,
                 on_host: bool) -> Iterator[Tuple[_Entry, Optional[torch.Tensor]]]:
    """Gather the units one at a time; yield each entry with its full value on the host (rank 0) or None.

    A collective: every rank iterates to the end. A buffer is released after its last entry was
    consumed, unless it was already gathered before (then it stays as it was).
    """
    staging: Optional[torch.Tensor] = None
    if on_host and ctx.device.type == "cuda":
        sizes = [u.buffer.gathered_nbytes for u in units if u.buffer is not None]
        staging = torch.empty(max(sizes, default=0), dtype=torch.uint8, pin_memory=True)
    for unit in units:
        buffer = unit.buffer
        if buffer is None:
            (entry,) = unit.entries
            yield entry, (entry.value.to("cpu") if on_host else None)
            continue
        with buffer.gathered() as gathered:
            flat = gathered
            if on_host and staging is not None:
                flat = staging[: flat.numel() * flat.element_size()].view(flat.dtype).copy_(flat)
            for entry in unit.entries:
                if tp_full_shape(entry.slot) != entry.slot.shape:  # every rank of the group joins the slices
                    value = tp_join(entry.slot, entry.slot.view_in(gathered))
                    yield entry, (value.to("cpu") if on_host else None)
                else:
                    yield entry, (entry.slot.view_in(flat) if on_host else None)


# --- public: save -------------------------------------------------------------------------------


@torch.no_grad()
def save(model: nn.Module, path: PathLike, *, non_blocking: bool = False, save_gather: bool = True) -> None:
    """Write the model's full state to one file, as the unwrapped model's ``state_dict()`` (BMTrain's ``bmt.save``).

    The file holds exactly the unwrapped model's keys: every parameter at its full shape and the
    persistent buffers. ``.safetensors`` files are written in the safetensors format (tied
    weights as separate tensors under each key); any other suffix in ``torch.save``'s format
    (tied weights sharing one storage), readable by plain ``torch.load``. Any world size loads
    it with :func:`load`, which checks the checksums both formats carry (``.safetensors``: the
    CRC-32s of each tensor's chunks in the header's metadata; see [Note: checksums in full files]).

    Memory: one flat buffer (about one block) is gathered at a time, written, and released
    before the next, so device memory grows by at most one block, and rank 0 streams the file
    without ever holding the whole state in host memory (see [Note: saving one flat buffer at a
    time]). Rank 0 writes the file under a temporary name and renames it when complete, so a
    crash mid-save leaves the previous file intact.

    A collective: every rank calls it; every rank raises if the save fails.

    Args:
        model: a model sharded by :func:`bmtwrap.wrap` or built from bmtwrap's blocks.
        path: the file to write; its folder is created if needed.
        non_blocking: accepted for BMTrain compatibility; the save is always synchronous.
            BMTrain's asynchronous save keeps a full host copy of the model on rank 0 for a
            writer thread, which is the memory this function avoids; here the file is complete
            and on disk when ``save`` returns.
        save_gather: ``True`` (BMTrain's default) writes the one file above. ``False`` gathers
            nothing: each rank writes its own pieces, and ``path`` becomes a folder holding a
            sharded checkpoint of the model alone (:func:`~bmtwrap.checkpoint.save_checkpoint`'s
            format; not with tensor or pipeline parallelism). :func:`load` reads either, at any
            world size, and :func:`~bmtwrap.checkpoint.clean` removes either.

    Raises:
        RuntimeError: the file cannot be written (its folder is not writable, the disk is full),
            on every rank; the previous file at ``path``, if any, is unchanged.
        NotImplementedError: a dtype safetensors cannot hold (use ``.pt``); a state dict entry that
            is not a tensor (a module's extra state).

    Example::

        bmt.save(model, "model.safetensors")   # or "model.pt"
    """
    del non_blocking  # see the docstring: always synchronous
    if not save_gather:
        save_checkpoint(path, model)
        return
    ctx = engine().ctx
    path = Path(path)
    entries, units = _plan_save(model)
    order = [entry for unit in units for entry in unit.entries]
    if path.suffix == SAFETENSORS_SUFFIX:
        for entry in entries:
            _safetensors_dtype(entry)  # every rank raises, before anything is opened or gathered
    rank0 = ctx.rank == 0
    committing = False
    commit_failure: Optional[BaseException] = None
    try:
        with contextlib.ExitStack() as stack:
            failure: Optional[BaseException] = None
            writer: Optional[_Writer] = None
            if rank0:
                try:
                    tmp = stack.enter_context(atomic_file(path))
                    writer = stack.enter_context(_open_writer(path, tmp, entries, order))
                except Exception as err:  # held until every rank knows (see [Note: failing together])
                    failure = _unwritable(path, err) if isinstance(err, OSError) else err
            _agree_quoting(ctx, failure, f"saving {path}")
            for entry, value in _host_values(units, ctx, on_host=rank0):
                if writer is not None and failure is None:
                    try:
                        writer.write(entry, value)
                    except Exception as err:  # keep gathering with the others; all raise below
                        failure = _unwritable(path, err)
            if writer is not None and failure is None:
                try:
                    writer.finish()
                except Exception as err:
                    failure = _unwritable(path, err)
            _agree_quoting(ctx, failure, f"saving {path}")
            committing = True  # leaving the stack fsyncs and renames the file (rank 0)
    except OSError as err:
        if not committing:
            raise
        commit_failure = _unwritable(path, err)
    _agree_quoting(ctx, commit_failure, f"saving {path}")


def _unwritable(path: Path, err: BaseException) -> RuntimeError:
    return unwritable(str(path), err, "rank 0 writes the file: give a path in a folder it can create and write, on a "
                      "disk with room for the model; the previous file at that path, if any, is unchanged")
