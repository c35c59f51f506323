"""Sharded checkpoints: every rank writes its own pieces, any world size reads them back.

This module orchestrates saving and loading across ranks; the files themselves (their names,
the index, tagged JSON values, writing and reading the pieces) are defined in ``sharded_format``
(see [Note: sharded checkpoint format] there).

[Note: commit protocol]
1. Rank 0 draws the tag. Every rank writes its files (each through ``atomic_file``: hidden
   temporary name, fsync, rename).
2. Every rank reports to rank 0 (a gather: it completes only when every file is in place) what it
   wrote, or the error it hit.
3. Rank 0 writes ``index.json`` atomically: this rename is the commit. Then it deletes the files
   the previous index named and any stray file of an interrupted save (unreferenced shard files,
   hidden temporaries), and tells every rank the outcome.
A save killed before step 3 leaves the previous index naming the previous, complete files; one
killed during the deletions leaves the new index naming the new, complete files. Loading reads
only the files the index names and ignores everything else in the folder.
"""

from __future__ import annotations

import json
import math
import os
import uuid
import warnings
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch import nn

from ..engine.dist import DistContext
from ..engine.schedule import engine
from ..optim import OptimManager
from ..wrap.materialize import restore_buffers
from .agree import _agree, _broadcast, _describe, _first_failure, _raise
from .io import PathLike, atomic_file, unwritable
from .sharded_format import (
    _SHARD_FILE,
    _TEMPORARY,
    INDEX,
    _build_index,
    _encode,
    _RankPart,
    _read_index,
    _ShardReader,
    _write_files,
)
from .sharded_rng import _collect_rng, _plan_rng, _restore_rng
from .sharded_targets import _model_targets, _optimizer_params, _param_names, _Target

__all__ = ["CheckpointInfo", "load_checkpoint", "save_checkpoint"]

OptimizerArg = Union[OptimManager, torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None]


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`load_checkpoint` found besides the tensors.

    Attributes:
        step: the ``step`` given to :func:`save_checkpoint` (``None`` if none was).
        extra: the ``extra`` given to :func:`save_checkpoint`, as saved.
        world_size: the world size the checkpoint was saved at.
        tag: the save's identifier (part of its file names).
        shard_size: the ranks each parameter was sharded over at the save (hybrid sharding); the world
            size for a save made before it was recorded.
    """

    step: Optional[int]
    extra: Any
    world_size: int
    tag: str
    shard_size: int = 0


# --- what the arguments mean ---------------------------------------------------------------------


def _as_optimizers(optimizer: OptimizerArg) -> Tuple[List[torch.optim.Optimizer], Optional[OptimManager]]:
    if optimizer is None:
        return [], None
    if isinstance(optimizer, OptimManager):
        return list(optimizer.optimizers), optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer], None
    if isinstance(optimizer, (list, tuple)) and all(isinstance(o, torch.optim.Optimizer) for o in optimizer):
        return list(optimizer), None
    raise TypeError(f"optimizer must be an OptimManager, a torch.optim.Optimizer, a list of them or None, "
                    f"got {type(optimizer).__name__}")


def _as_schedulers(lr_scheduler: Any) -> List[Any]:
    if lr_scheduler is None:
        return []
    schedulers = list(lr_scheduler) if isinstance(lr_scheduler, (list, tuple)) else [lr_scheduler]
    for scheduler in schedulers:
        if not (hasattr(scheduler, "state_dict") and hasattr(scheduler, "load_state_dict")):
            raise TypeError(f"lr_scheduler must have state_dict() and load_state_dict() (a bmtwrap.lr_scheduler or "
                            f"torch.optim.lr_scheduler class), got {type(scheduler).__name__}")
    return schedulers


# --- saving ---------------------------------------------------------------------------------------


def _refuse_tensor_parallel(ctx: DistContext) -> None:
    # TODO: each rank's file would need its tensor-parallel place and pipeline stage; waits for a layout that
    # records them.
    if ctx.tp_size > 1 or ctx.pipe_size > 1:
        raise NotImplementedError(
            f"sharded checkpoints with init_distributed({'tp' if ctx.tp_size > 1 else 'pipe'}_size="
            f"{ctx.tp_size if ctx.tp_size > 1 else ctx.pipe_size}) are not supported: save the model "
            "with bmt.save (whole tensors, loaded at any layout) and the optimizers per rank with torch.save")


def _written_here(targets: Dict[str, _Target], ctx: DistContext) -> Set[int]:
    """The sharded tensors (ids) whose pieces this rank writes, with their optimizer state.

    Every rank holds a piece of each; under hybrid sharding the replicas hold the same pieces, and
    each tensor is written by one replica, the next one for the next tensor, so that the writes
    spread over the nodes (every rank computes the same turns from the same state dict).
    """
    replica, turn, mine = ctx.rank // ctx.shard_size, 0, set()
    for target in targets.values():
        if target.sharded and id(target.tensor) not in mine:
            if turn % ctx.replicas == replica:
                mine.add(id(target.tensor))
            turn += 1
    return mine


def _collect_model(part: _RankPart, targets: Dict[str, _Target], rank: int, written: Set[int]) -> Dict[str, str]:
    """Queue this rank's pieces of the model; return {state dict key: tensor name} (tied keys share one).

    A rank adds its pieces of the sharded tensors in ``written``; rank 0 also the replicated ones, and
    describes every tensor (it knows every full shape, like any rank).
    """
    by_id: Dict[int, str] = {}
    keys: Dict[str, str] = {}
    for key, target in targets.items():
        name = keys[key] = by_id.setdefault(id(target.tensor), f"model/{key}")
        if name != f"model/{key}":
            continue  # a tied parameter, stored under its first key
        if target.sharded:
            if id(target.tensor) in written:
                part.add(name, target.tensor, target.start, target.shape, describe=rank == 0)
            elif rank == 0:
                part.describe(name, target.tensor, target.shape)
        elif rank == 0:
            part.add(name, target.tensor, 0, target.shape)
    return keys


def _reports_state(target: _Target, rank: int, written: Set[int]) -> bool:
    """Whether this rank reports a parameter's optimizer state: where it writes a non-empty piece.

    Replicated parameters and parameters of no elements: rank 0. So the scalars in the index
    come from a rank whose state was really stepped (an empty piece's may not be).
    """
    if not target.sharded or math.prod(target.shape) == 0:
        return rank == 0
    return target.end > target.start and id(target.tensor) in written


def _collect_optimizer(part: _RankPart, i: int, state_dict: Dict[str, Any], optimizer: torch.optim.Optimizer,
                       groups: List[List[str]], targets: Dict[str, _Target], rank: int, written: Set[int]) -> None:
    """Queue this rank's optimizer state: tensors shaped like the local shard are pieces, 0-dim ones scalars."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = [name for group in groups for name in group]
    positions = [pos for group in state_dict["param_groups"] for pos in group["params"]]
    mine: Dict[str, Dict[str, Any]] = {}
    for param, name, pos in zip(params, names, positions):
        entry = state_dict["state"].get(pos)
        target = targets[name]
        if not entry or not _reports_state(target, rank, written):
            continue
        mine[name] = {}
        for key, value in entry.items():
            where = f"optimizer {i} ({type(optimizer).__name__}) state '{key}' of '{name}'"
            if not (isinstance(value, torch.Tensor) and value.dim() > 0):
                mine[name][key] = {"value": _encode(value, where)}
                continue
            tensor = f"optim/{i}/{name}/{key}"
            mine[name][key] = {"tensor": tensor}
            if not target.sharded:
                part.add(tensor, value, 0, tuple(value.shape))
            elif value.numel() == param.numel():
                part.add(tensor, value, target.start, target.shape)
            else:
                raise NotImplementedError(
                    f"{where} has shape {tuple(value.shape)}, neither a scalar nor the shape of the parameter's "
                    f"local shard {tuple(param.shape)}: a sharded checkpoint cannot reshard it")
    part.optim_state.append(mine)


def _remove_unreferenced(folder: Path, keep: Set[str]) -> None:
    """After a commit: delete the previous save's files and strays of interrupted ones (rank 0).

    The new checkpoint is already complete, so a file that cannot be deleted is only warned about.
    """
    for entry in os.scandir(folder):
        if entry.name in keep or not (_SHARD_FILE.match(entry.name) or _TEMPORARY.match(entry.name)):
            continue
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            pass
        except OSError as caught:
            warnings.warn(f"could not delete {entry.path}, a file no checkpoint index names: {caught}", stacklevel=3)


def _save_head(model_keys: Dict[str, str], optimizers: List[torch.optim.Optimizer], states: List[Dict[str, Any]],
               groups: List[List[List[str]]], schedulers: List[Any], manager_state: Optional[Dict[str, Any]],
               step: Optional[int], extra: Any) -> Dict[str, Any]:
    """The index entries that rank 0 alone knows (or that every rank knows alike); ``extra`` is encoded."""
    described = []
    for i, (optimizer, state, names) in enumerate(zip(optimizers, states, groups)):
        param_groups = []
        for g, (group, group_names) in enumerate(zip(state["param_groups"], names)):
            hyper = {k: v for k, v in group.items() if k != "params"}
            param_groups.append({**_encode(hyper, f"optimizer {i} group {g}"), "params": group_names})
        described.append({"type": type(optimizer).__name__, "param_groups": param_groups, "state": {}})
    return {"model": model_keys, "optimizers": described,
            "lr_schedulers": [_encode(s.state_dict(), f"lr_scheduler {i}") for i, s in enumerate(schedulers)],
            "optim_manager": None if manager_state is None else _encode(manager_state, "OptimManager state"),
            "step": step, "extra": extra}


@torch.no_grad()
def save_checkpoint(folder: PathLike, model: nn.Module, optimizer: OptimizerArg = None, lr_scheduler: Any = None,
                    *, step: Optional[int] = None, extra: Any = None, max_file_bytes: int = 2**31) -> None:
    """Save the model, optimizers, schedulers, loss scale and RNG states as a sharded checkpoint.

    A collective: every rank calls it with the same arguments. Each rank writes its own pieces of
    every sharded parameter and of the optimizer state shaped like them; rank 0 also writes the
    replicated tensors and, last, ``index.json`` (see [Note: sharded checkpoint format] in
    ``sharded_format``).
    :func:`load_checkpoint` reads it back at any world size. The folder may hold an earlier
    checkpoint: it stays loadable until the new one is complete and is then removed (see
    [Note: commit protocol]); a save that is killed leaves the earlier checkpoint in place.
    The folder must be one every rank can reach (a shared file system across nodes).

    Args:
        folder: the checkpoint folder (created if missing).
        model: the sharded model (``bmtwrap.wrap``, or made of bmtwrap blocks); any module works.
        optimizer: an :class:`~bmtwrap.optim.OptimManager` (its optimizers, its schedulers and its
            loss-scale state are saved), a ``torch.optim.Optimizer``, a list of them, or ``None``.
            Every optimized parameter must belong to ``model``: state is stored by parameter name.
        lr_scheduler: a scheduler (bmtwrap's or torch's), a list of them, or ``None``.
        step: the training step, returned by :func:`load_checkpoint`.
        extra: anything JSON can hold (numbers, strings, lists, dicts; tuples come back as tuples).
        max_file_bytes: a rank starts another file past this many bytes (on a GPU, at most this
            much is staged in host memory at once).

    Raises:
        TypeError: an argument of the wrong kind; ``extra`` or scheduler state JSON cannot hold.
        ValueError: an optimizer holds parameters that are not the model's.
        NotImplementedError: optimizer state that is neither a scalar nor shaped like the
            parameter's shard (it could not be resharded).
        RuntimeError: the folder cannot be created or written (named, with the system's reason:
            a file in its place, no permission, a full disk). On any error no index is written:
            the folder's earlier checkpoint is untouched, and every rank raises.

    Example::

        bmtwrap.checkpoint.sharded.save_checkpoint("ckpt", model, manager, step=step, extra={"epoch": epoch})
    """
    ctx = engine().ctx
    _refuse_tensor_parallel(ctx)
    folder = Path(folder)
    optimizers, manager = _as_optimizers(optimizer)
    schedulers = _as_schedulers(lr_scheduler)
    if step is not None and not isinstance(step, int):
        raise TypeError(f"step must be an int or None, got {type(step).__name__}")
    if max_file_bytes <= 0:
        raise ValueError(f"max_file_bytes must be > 0, got {max_file_bytes}")
    extra = _encode(extra, "extra")  # before anything is written, on every rank alike
    tag = _broadcast(ctx, uuid.uuid4().hex[:16] if ctx.rank == 0 else None)
    part, head, written, error = _RankPart(), None, [], None
    try:
        head = _collect(part, ctx, model, optimizers, manager, schedulers, step, extra)
        written = _write_rank_files(folder, tag, ctx.rank, part, max_file_bytes)
    except Exception as caught:  # every rank must still reach the gather below
        error = caught
    # The gather completes on rank 0 only once every rank's files are in place: the barrier
    # before the commit.
    reports: Optional[List[Any]] = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object((_describe(error), None if error else part.for_index()), reports, dst=0, group=ctx.group)
    failure = None
    if ctx.rank == 0:
        failure = _first_failure([report[0] for report in reports])
        if failure is None:
            try:
                _commit(folder, _build_index(tag, ctx.world_size, [report[1] for report in reports], head,
                                             ctx.shard_size))
            except OSError as caught:  # the index is JSON: no safetensors error can come from here
                error = _unwritable(folder, caught)
                failure = _describe(error)
            except Exception as caught:
                error, failure = caught, _describe(caught)
    failure = _broadcast(ctx, failure)
    if failure is not None:
        for path in written:  # no index names them
            path.unlink(missing_ok=True)
        _raise(error, failure)


def _write_rank_files(folder: Path, tag: str, rank: int, part: _RankPart, max_file_bytes: int) -> List[Path]:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return _write_files(folder, tag, rank, part, max_file_bytes)
    except (OSError, SafetensorError) as caught:  # safetensors' own error names only a temporary file
        raise _unwritable(folder, caught) from caught


def _unwritable(folder: Path, err: BaseException) -> RuntimeError:
    return unwritable(f"the checkpoint in {folder}", err, "give a folder every rank can create and write, on a disk "
                      "with room for it; the earlier checkpoint there, if any, is unchanged")


def _collect(part: _RankPart, ctx: DistContext, model: nn.Module, optimizers: List[torch.optim.Optimizer],
             manager: Optional[OptimManager], schedulers: List[Any], step: Optional[int],
             extra: Any) -> Optional[Dict[str, Any]]:
    """Queue everything this rank writes; return (rank 0) the index entries only it writes."""
    _collect_rng(part, ctx)  # first: nothing below may have drawn from an RNG yet
    manager_state = manager.state_dict() if manager is not None else None
    states = manager_state.pop("optimizers") if manager_state is not None else [o.state_dict() for o in optimizers]
    targets = _model_targets(model)
    _settle(optimizers, targets, ctx)
    names, param_targets = _param_names(model, targets)
    groups = [_optimizer_params(o, names, i) for i, o in enumerate(optimizers)]
    written = _written_here(targets, ctx)
    model_keys = _collect_model(part, targets, ctx.rank, written)
    for i, (opt, state, group_names) in enumerate(zip(optimizers, states, groups)):
        _collect_optimizer(part, i, state, opt, group_names, param_targets, ctx.rank, written)
    if ctx.rank != 0:
        return None
    return _save_head(model_keys, optimizers, states, groups, schedulers, manager_state, step, extra)


def _commit(folder: Path, index: Dict[str, Any]) -> None:
    """Write the index (the commit), then remove what no index names any more (rank 0)."""
    text = json.dumps(index, indent=1)
    with atomic_file(folder / INDEX) as tmp:
        tmp.write_text(text)
    _remove_unreferenced(folder, set(index["files"]) | {INDEX})


# --- loading --------------------------------------------------------------------------------------


def _check_model(index: Dict[str, Any], reader: _ShardReader, targets: Dict[str, _Target], strict: bool) -> None:
    """Keys and shapes, every mismatch listed by name; then the pieces this rank will read."""
    saved: Dict[str, str] = index["model"]
    missing = [k for k in targets if k not in saved]
    unexpected = [k for k in saved if k not in targets]
    shapes = [f"{k}: checkpoint {reader.shape(saved[k])}, model {t.shape}" for k, t in targets.items()
              if k in saved and reader.shape(saved[k]) != t.shape]
    problems = []
    if strict and missing:
        problems.append(f"missing keys ({len(missing)}): {_listing(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {_listing(unexpected)}")
    if shapes:
        problems.append(f"shape mismatches ({len(shapes)}): {_listing(shapes, '; ')}")
    if problems:
        hint = "\n  (strict=False loads the keys both have)" if not shapes else ""
        raise ValueError("cannot load this checkpoint into the model (a checkpoint of another model?); nothing was "
                         "changed:\n  " + "\n  ".join(problems) + hint)
    for key, target in targets.items():
        if key in saved:
            reader.require(saved[key], target.start, target.end)


def _listing(names: Sequence[str], separator: str = ", ") -> str:
    return separator.join(names[:20]) + (" ..." if len(names) > 20 else "")


class _OptimizerPlan(NamedTuple):
    """How one optimizer's saved state maps onto its parameters here."""

    saved: Dict[str, Any]  # its entry in the index
    params: List[Tuple[torch.Tensor, str, _Target]]  # in state_dict() order
    groups: List[List[int]]  # positions of each group's parameters


def _plan_optimizers(index: Dict[str, Any], reader: _ShardReader, optimizers: List[torch.optim.Optimizer],
                     manager: Optional[OptimManager], targets: Dict[str, _Target],
                     names: Dict[int, str]) -> List[_OptimizerPlan]:
    saved_all = index["optimizers"]
    if optimizers and len(saved_all) != len(optimizers):
        raise ValueError(f"the checkpoint holds {len(saved_all)} optimizer(s) but {len(optimizers)} were given; "
                         "pass the same optimizers, in the same order, as to save_checkpoint")
    if manager is not None and index["optim_manager"] is None:
        raise ValueError("an OptimManager was given but the checkpoint was saved without one (no loss-scale "
                         "state); pass its optimizers instead")
    plans = []
    for i, (optimizer, saved) in enumerate(zip(optimizers, saved_all)):
        who = f"optimizer {i} ({type(optimizer).__name__})"
        if saved["type"] != type(optimizer).__name__:
            raise ValueError(f"{who}: the checkpoint holds the state of an optimizer of type "
                             f"{saved['type']}; pass the kind of optimizer it was saved with")
        groups = _optimizer_params(optimizer, names, i)
        saved_groups = [g["params"] for g in saved["param_groups"]]
        if len(groups) != len(saved_groups) or any(len(a) != len(b) for a, b in zip(groups, saved_groups)):
            raise ValueError(f"{who} has {len(groups)} parameter group(s) of sizes {[len(g) for g in groups]}, the "
                             f"checkpoint's {len(saved_groups)} of sizes {[len(g) for g in saved_groups]}; build "
                             "the optimizer over the same parameters as when saving")
        for g, (mine, theirs) in enumerate(zip(groups, saved_groups)):
            if mine != theirs:
                absent = [n for n in mine if n not in theirs]
                extra = [n for n in theirs if n not in mine]
                raise ValueError(f"{who}, group {g}: parameters differ from the checkpoint's: not in the checkpoint: "
                                 f"{_listing(absent) or '-'}; only in the checkpoint: {_listing(extra) or '-'}"
                                 f"{'; same names in another order' if not absent and not extra else ''}")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        entries = [(p, names[id(p)], targets[names[id(p)]]) for p in params]
        for param, name, target in entries:
            for key, stored in saved["state"].get(name, {}).items():
                if "tensor" in stored:
                    where = f"{who} state '{key}' of '{name}'"
                    reader.require(stored["tensor"], *_state_range(reader, stored["tensor"], param, target, where))
        positions, cursor = [], 0
        for group in groups:
            positions.append(list(range(cursor, cursor + len(group))))
            cursor += len(group)
        plans.append(_OptimizerPlan(saved, entries, positions))
    return plans


def _state_range(reader: _ShardReader, tensor: str, param: torch.Tensor, target: _Target,
                 where: str) -> Tuple[int, int]:
    """The flat range of a saved state tensor that belongs to this rank's piece of ``param``."""
    shape = reader.shape(tensor)
    if target.sharded and target.tensor is param:
        if shape != target.shape:
            raise ValueError(f"{where} was saved with shape {shape}, but the parameter's is {target.shape}")
        return target.start, target.end
    return 0, int(torch.Size(shape).numel())


def _optimizer_state_dict(plan: _OptimizerPlan, reader: _ShardReader) -> Dict[str, Any]:
    """A normal ``state_dict()`` for this rank, with every state tensor resharded to its local piece."""
    state: Dict[int, Dict[str, Any]] = {}
    for position, (param, name, target) in enumerate(plan.params):
        entry = plan.saved["state"].get(name)
        if entry is None:
            continue
        state[position] = {}
        for key, stored in entry.items():
            if "tensor" not in stored:
                state[position][key] = stored["value"]
                continue
            start, end = _state_range(reader, stored["tensor"], param, target, "")
            value = reader.read(stored["tensor"], start, end)
            sharded = target.sharded and target.tensor is param
            state[position][key] = value.view(param.shape) if sharded else value.view(reader.shape(stored["tensor"]))
    groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": positions}
              for saved, positions in zip(plan.saved["param_groups"], plan.groups)]
    return {"state": state, "param_groups": groups}


def _settle(optimizers: List[torch.optim.Optimizer], targets: Dict[str, _Target], ctx: DistContext) -> None:
    """Let in-place updates still in flight land before the shards are read or overwritten.

    An offloading optimizer writes parameters back from a worker thread and copy streams; the
    engine knows those writes per flat buffer.
    """
    for opt in optimizers:
        wait = getattr(opt, "wait", None)
        if callable(wait):
            wait()
    eng = engine()
    for target in targets.values():
        found = eng.registry.lookup(target.tensor) if target.sharded else None
        if found is not None:
            found[0].wait_writes()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


@torch.no_grad()
def _load_model(index: Dict[str, Any], reader: _ShardReader, model: nn.Module, targets: Dict[str, _Target]) -> None:
    eng = engine()
    loaded: Set[int] = set()
    for key, target in targets.items():
        name = index["model"].get(key)
        if name is None or id(target.tensor) in loaded:
            continue
        value = reader.read(name, target.start, target.end)
        target.tensor.copy_(value.view(target.tensor.shape))
        loaded.add(id(target.tensor))
    for target in targets.values():
        found = eng.registry.lookup(target.tensor) if target.sharded else None
        if found is not None and all(id(slot.param) in loaded for slot in found[0].slots):
            found[0].initialized = True  # a meta-built model's shards now hold values
    restore_buffers(model)


def load_checkpoint(folder: PathLike, model: nn.Module, optimizer: OptimizerArg = None, lr_scheduler: Any = None,
                    *, strict: bool = True, restore_rng: bool = True) -> CheckpointInfo:
    """Load a checkpoint written by :func:`save_checkpoint`, at this or any other world size.

    A collective: every rank calls it with the same arguments. Each rank computes the flat range
    of every parameter it owns now and reads exactly the overlapping byte ranges of the saved
    files; optimizer state follows its parameter by name and reaches each optimizer through its
    own ``load_state_dict``. Everything is checked first (the index, keys and shapes, the
    optimizers, that every file this rank needs is present and whole, and the CRC-32 of every
    chunk of bytes it will read), on every rank; if any rank finds a problem, every rank raises
    and nothing is changed. Files in the folder that the index does not name (strays of an
    interrupted save) are ignored. A checkpoint of bmtwrap before checksums (index version 1)
    loads without the byte check (see [Note: sharded checkpoint format]).

    RNG states: rank r restores the Python ``random``, NumPy, torch CPU and (if both runs use
    CUDA) CUDA states that rank r saved. At a larger world size, a rank ``r >= saved world size``
    is seeded afresh with a seed derived from the checkpoint's tag and ``r``: deterministic for a
    given checkpoint, different on every rank.

    Args:
        folder: the folder given to :func:`save_checkpoint`.
        model: the model, sharded as for training (``bmtwrap.wrap`` or bmtwrap blocks; a model
            built on the meta device and wrapped may be loaded without materialising it).
        optimizer: as for :func:`save_checkpoint` (an OptimManager restores its optimizers,
            schedulers and loss scale); ``None`` leaves optimizer state alone.
        lr_scheduler: as for :func:`save_checkpoint`; ``None`` skips the saved schedulers.
        strict: missing or unexpected model keys are errors; with ``False`` the keys both have
            are loaded (shapes must still match).
        restore_rng: restore the RNG states the checkpoint holds (above); ``False`` leaves this
            process's RNGs as they are (``bmt.load`` of a folder, which loads a model only).

    Returns:
        A :class:`CheckpointInfo` with the saved ``step`` and ``extra``.

    Raises:
        FileNotFoundError: no ``index.json`` in ``folder``; a shard file the index names is
            missing (its path is given).
        ValueError: a truncated, corrupt or foreign shard file (its path is given; bytes that
            differ from their checksum name the file and the tensor); missing or
            unexpected keys or shape mismatches (listed by name); a different number or kind of
            optimizers, parameter groups or parameters; a different number of schedulers.
        OSError: a shard file cannot be read (an I/O error), its path given.

    Example::

        info = bmtwrap.checkpoint.sharded.load_checkpoint("ckpt", model, manager)
        start_step = info.step + 1
    """
    ctx = engine().ctx
    _refuse_tensor_parallel(ctx)
    folder = Path(folder)
    optimizers, manager = _as_optimizers(optimizer)
    schedulers = _as_schedulers(lr_scheduler)
    with ExitStack() as stack:
        error = None
        try:
            index = _read_index(folder)
            reader = _ShardReader(folder, index, stack)
            targets = _model_targets(model)
            _check_model(index, reader, targets, strict)
            names, param_targets = _param_names(model, targets)
            plans = _plan_optimizers(index, reader, optimizers, manager, param_targets, names)
            if schedulers and len(schedulers) != len(index["lr_schedulers"]):
                raise ValueError(f"the checkpoint holds {len(index['lr_schedulers'])} lr scheduler(s) but "
                                 f"{len(schedulers)} were given; pass the ones given to save_checkpoint")
            _plan_rng(index, reader, ctx.rank)
            reader.verify()  # the checksums of every chunk this rank will read
        except Exception as caught:  # every rank must reach the agreement below
            error = caught
        _agree(ctx, error)
        _settle(optimizers, targets, ctx)
        _load_model(index, reader, model, targets)
        states = [_optimizer_state_dict(plan, reader) for plan in plans]
        if manager is not None:
            manager.load_state_dict({**index["optim_manager"], "optimizers": states})
        else:
            for opt, state in zip(optimizers, states):
                opt.load_state_dict(state)
        for scheduler, state in zip(schedulers, index["lr_schedulers"]):
            scheduler.load_state_dict(state)
        if restore_rng:
            _restore_rng(index, reader, ctx)
    return CheckpointInfo(step=index["step"], extra=index["extra"], world_size=index["world_size"],
                          tag=index["tag"], shard_size=index.get("shard_size", index["world_size"]))
