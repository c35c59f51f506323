"""Joining the job: the process group, the device, the seed, and the helpers built on them.

bmtwrap keeps exactly one piece of process-wide state: the :class:`DistContext` made by
:func:`init_distributed`. Everything else hangs off that object, so there are no global dicts
to keep in step.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import math
import numbers
import os
import random
import warnings
from dataclasses import dataclass, field
from typing import Any, ContextManager, Dict, List, Optional, Protocol, Tuple, Union

import torch
import torch.distributed as dist

from .stages import check_sizes, make_stage_subgroups, stage_peers
from .watchdog import Watchdog, default_store

__all__ = [
    "DEFAULT_TIMEOUT",
    "DistContext",
    "agree_max",
    "current",
    "init_distributed",
    "is_initialized",
    "print_rank",
    "rank",
    "sum_loss",
    "synchronize",
    "wait_loader",
    "world_size",
]


# How long a collective may wait for the slowest rank before the job fails (see init_distributed's
# ``timeout``). Legitimate waits that long exist: while rank 0 writes a consolidated checkpoint of a
# model of tens of billions of parameters (100+ GB at a few hundred MB/s on a network file system:
# 5-10 minutes) the other ranks wait in its next collective, and creating the NCCL communicators of
# a job of hundreds of nodes (at the first collective) takes a minute or more. torch's 10 minutes for NCCL is
# known to cut such saves short; 30 minutes (torch's gloo default, DeepSpeed's default) does not,
# and still ends a hung job within the half-hour instead of holding its machines for days.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


class AttachedEngine(Protocol):
    """What the context knows of the engine it carries: :class:`bmtwrap.engine.schedule.Engine`.

    Declared here because the engine's module sits above this one and imports it.
    """

    ctx: "DistContext"


@dataclass(eq=False)
class DistContext:
    """What every other part of bmtwrap needs to know about this process.

    Attributes:
        rank: this process's rank in ``group``.
        world_size: number of processes in ``group``.
        shard_size: the ranks one parameter is sharded over (see [Note: hybrid sharding]): groups of
            ``shard_size`` consecutive ranks each hold the whole model in shards, and the groups
            replicate each other. ``world_size`` (the default) shards over every rank.
        tp_size: ranks of one tensor-parallel group (``init_distributed(tp_size=...)``; see [Note: tensor
            parallelism] in ``tp.py``); parameters are then sharded over ``shard_size = world_size // tp_size``.
        pipe_size: pipeline stages (``init_distributed(pipe_size=...)``; see [Note: pipeline layout] in
            ``stages.py``); parameters are then sharded inside the stage; ``micro_batches``: a pipeline's per batch.
        traffic: what the engine's collectives moved since the last reset (``collectives.traffic``).
        local_rank: rank on this host; picks the CUDA device.
        device: where parameters, gathers and reductions live (``cuda:<local_rank>`` or ``cpu``).
        zero_level: default ZeRO level of new blocks (2: keep gathered parameters from forward
            until backward; 3: release them after forward and gather again in backward).
        seed: the seed every RNG was seeded with.
        timeout: how long a collective of ``group`` may wait for the slowest rank: the ``timeout``
            given to :func:`init_distributed`, or the group's own where the program made it.
        engine: the engine's run-time state (execution order, pending reductions), created on
            first use by :mod:`bmtwrap.engine.schedule`; ``None`` until then.
        inspector: the ``bmtwrap.bmtrain.inspect.inspect_tensor()`` record being taken, if any (see
            [Note: the active inspector] in ``bmtwrap/bmtrain/inspect/tensor.py``).
        copy_streams: CUDA streams for copies between host and device beside the computation,
            by direction (see :meth:`copy_stream`).
        debug_values: what the program stored with ``bmtwrap.bmtrain.debug.set`` (BMTrain's debug store).
        watchdog: the heartbeat that names the rank at fault when a collective fails (see
            ``bmtwrap/engine/watchdog.py``); ``None`` in a world of one.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    zero_level: int
    seed: int
    timeout: datetime.timedelta
    engine: Optional[AttachedEngine] = field(default=None, repr=False)
    inspector: Optional[Any] = field(default=None, repr=False)
    copy_streams: Dict[str, Any] = field(default_factory=dict, repr=False)
    debug_values: Dict[str, Any] = field(default_factory=dict, repr=False)
    watchdog: Optional[Watchdog] = field(default=None, repr=False)
    shard_size: int = 0  # 0: world_size (set in __post_init__)
    tp_size: int = 1
    pipe_size: int = 1
    micro_batches: int = 1
    # What the engine's collectives moved: {operation: [calls, bytes each rank sent]} (see collectives.traffic).
    traffic: Dict[str, List[float]] = field(default_factory=dict, repr=False)
    # The sub-groups of a hybrid layout (None where the world group or no group serves): see shard_group; and
    # "self", this rank alone, made on first use for BMTrain's communicators of one rank (bmtrain/comm.py).
    subgroups: Dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.shard_size:
            self.shard_size = self.world_size

    @property
    def shard_rank(self) -> int:
        """This rank's place in its shard group: which piece of each flat buffer it holds."""
        return (self.rank // self.tp_size) % self.shard_size

    @property
    def replicas(self) -> int:
        """How many shard groups hold the same shards: ``world_size // shard_size``, divided by ``tp_size``
        (the shard groups of different tensor-parallel places hold different slices: none replicates another)."""
        return self.world_size // (self.shard_size * self.tp_size)

    @property
    def shard_group(self) -> Optional[dist.ProcessGroup]:
        """The group gathers and reduce-scatters run on: this rank's shard group (the world group when
        parameters are sharded over every rank; ``None`` with shards of one rank, where nothing is gathered)."""
        if self.shard_size == 1:
            return None
        return self.subgroups.get("shard") or self.group

    @property
    def replica_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks holding the same shards as this one (one per shard group), over which gradient shards are
        averaged after the reduce-scatter; ``None`` with one shard group."""
        if self.replicas == 1:
            return None
        return self.subgroups.get("replica") or self.group

    @functools.cached_property
    def shard_peers(self) -> Optional[Tuple[int, ...]]:
        """The global ranks of :attr:`shard_group`, this one included; ``None`` when it is the world."""
        if self.shard_size == self.world_size:
            return None
        if self.pipe_size * self.tp_size > 1:  # the stage's ranks with this tensor-parallel place (pp_tp_zero)
            return stage_peers("shard", self.rank, self.world_size, self.pipe_size, self.tp_size)
        return tuple(_shard_groups(self.world_size, self.shard_size)[self.rank // self.shard_size])

    @functools.cached_property
    def replica_peers(self) -> Optional[Tuple[int, ...]]:
        """The global ranks of :attr:`replica_group`, this one included; ``None`` when it is the world."""
        if self.shard_size == 1 or self.replicas == 1 or self.replicas == self.world_size:
            return None
        if self.pipe_size > 1:  # one rank of each stage: the pipeline's
            return stage_peers("replica", self.rank, self.world_size, self.pipe_size, self.tp_size)
        return tuple(_replica_groups(self.world_size, self.shard_size)[self.shard_rank])

    @property
    def tp_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's tensor-parallel group (``tp_size`` consecutive ranks); ``None`` when ``tp_size`` is 1."""
        return None if self.tp_size == 1 else self.subgroups.get("tp") or self.group

    @property
    def tp_rank(self) -> int:
        """This rank's place in its tensor-parallel group: which slice of a tensor-parallel parameter it holds."""
        return self.rank % self.tp_size

    def copy_stream(self, direction: str) -> "torch.cuda.Stream":
        """The stream of ``direction``'s copies ("to_device" or "to_host") on this CUDA device, made on first use.

        One per direction, so that parameters going to the GPU and gradients leaving it use both
        copy engines at once.
        """
        return self._side_stream(direction)

    def reduce_stream(self) -> "torch.cuda.Stream":
        """The CUDA stream that waits for a gradient's reduce-scatter and issues its all-reduce over the replicas
        (hybrid sharding), so that the computation never waits between the two; made on first use."""
        return self._side_stream("reduce")

    def _side_stream(self, name: str) -> "torch.cuda.Stream":
        stream = self.copy_streams.get(name)
        if stream is None:
            stream = self.copy_streams[name] = torch.cuda.Stream(self.device)
        return stream

    def watched(self, kind: str, label: str = "") -> ContextManager[None]:
        """Around a blocking collective on :attr:`group`: its failure raises ``bmtwrap.CollectiveError``
        naming ``kind`` (``"barrier"``), ``label`` and the ranks at fault, not the backend's bare error."""
        if self.watchdog is None:
            return contextlib.nullcontext()
        return self.watchdog.blocking((kind, label))

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group every collective of the engine runs on (the default group).

        Looked up, not stored: holding it would keep it alive after ``destroy_process_group()``,
        and gloo's threads with it until interpreter shutdown, where they can abort the process.
        """
        return dist.group.WORLD

    @property
    def backend(self) -> str:
        """The backend of :attr:`group`: ``"nccl"`` or ``"gloo"``."""
        return dist.get_backend(self.group)


_CONTEXT: Optional[DistContext] = None


def is_initialized() -> bool:
    """Whether :func:`init_distributed` has run (and its process group has not been destroyed)."""
    return _CONTEXT is not None and dist.is_initialized()


def current() -> DistContext:
    """The context made by :func:`init_distributed`.

    Raises:
        RuntimeError: if :func:`init_distributed` has not been called yet, or the process group
            was destroyed since.
    """
    if not is_initialized():
        raise RuntimeError(
            "bmtwrap is not initialised: call bmtwrap.init_distributed() before building blocks "
            "or calling rank(), world_size(), synchronize() or sum_loss()."
        )
    return _CONTEXT


def _seed_everything(seed: int) -> None:
    # The same seed on every rank: modules built with torch's default initialisers then hold the
    # same values everywhere before they are sharded, and init_parameters() draws the same numbers
    # a single process would.
    random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass


def _pick_device(local_rank: int, backend: Optional[str]) -> torch.device:
    use_cuda = torch.cuda.is_available() if backend is None else backend == "nccl"
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, but torch.cuda.is_available() is False; use backend='gloo'")
    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices are visible; "
            "start at most one process per GPU"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _check_rendezvous(init_method: str) -> None:
    """RANK and WORLD_SIZE without MASTER_ADDR/MASTER_PORT: torch's error names neither torchrun nor the variables."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if init_method == "env://" and missing:
        raise RuntimeError(
            f"RANK and WORLD_SIZE are set (rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}) but "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: init_distributed joins the job at "
            "MASTER_ADDR:MASTER_PORT, the address and a free port of rank 0's machine, as torchrun sets them. "
            "Start the program with torchrun (e.g. `torchrun --nproc_per_node=2 train.py`), set MASTER_ADDR and MASTER_PORT in "
            "every process, or unset RANK and WORLD_SIZE to run as a world of one")


def init_distributed(
    seed: int = 0,
    zero_level: int = 3,
    *,
    init_method: str = "env://",
    backend: Optional[str] = None,
    timeout: Union[datetime.timedelta, float, None] = None,
    check_collectives: bool = False,
    shard_size: Union[int, str, None] = None,
    pipe_size: int = -1,
    tp_size: int = 1,
    num_micro_batches: Optional[int] = None,
    sp_size: int = 1,
) -> DistContext:
    """Join the job and seed every RNG.

    Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) this joins the process group through
    ``torch.distributed``: NCCL when CUDA is available, gloo otherwise. Without a launcher it
    makes a world of one, with no environment needed. If ``torch.distributed`` was already
    initialised by the caller, its default group is used as it is.

    Args:
        seed: seeds ``random``, NumPy and torch (CPU and CUDA) identically on every rank.
        zero_level: default for new blocks: 3 frees gathered parameters after each block's
            forward and gathers them again for backward; 2 keeps them until backward.
        init_method: passed to ``torch.distributed.init_process_group`` under a launcher.
        backend: ``"nccl"`` or ``"gloo"``; default: NCCL if CUDA is available, else gloo.
        timeout: how long a collective may wait for the slowest rank, as a ``timedelta`` or in
            seconds; default (``None``) :data:`DEFAULT_TIMEOUT`, 30 minutes: long enough for rank 0
            to write a consolidated checkpoint of a large model while the others wait, and for the
            first NCCL collective of a large job. When a rank dies or stops taking part, the others
            raise :class:`bmtwrap.CollectiveError` within it (a dead rank that breaks a connection:
            at once), naming the rank and the operation (see ``bmtwrap/engine/watchdog.py``). When
            ``torch.distributed`` was initialised by the caller, the group's own timeout applies,
            with a warning if it differs from this one.
        check_collectives: a debugging aid: before each of the engine's collectives the ranks
            compare what they are about to run, and raise :class:`bmtwrap.CollectiveError` naming
            both operations and the ranks of each when they differ (ranks running different blocks
            would otherwise pair unrelated buffers). Costs one small extra collective, and on CUDA a
            synchronisation, per collective.
        shard_size: hybrid sharding (see [Note: hybrid sharding]): parameters, gradients and optimizer
            state are sharded over groups of this many consecutive ranks, and the groups replicate each
            other; gradients are reduce-scattered in the group, then averaged over the groups. An int that
            divides the world size, ``"local"`` for the ranks of one node (torchrun's
            ``LOCAL_WORLD_SIZE``), or ``None``: the environment variable ``BMTWRAP_SHARD_SIZE`` if set,
            else one node's ranks when the job spans several nodes and every rank otherwise.
        pipe_size: BMTrain's pipeline stages: the ranks are cut into this many stages of consecutive ranks,
            each holding a contiguous part of the layers of every ``PipelineTransformerBlockList``, and
            parameters are sharded (ZeRO) inside the stage (see [Note: pipeline layout] in ``stages.py``).
            ``pipe_size * tp_size`` must divide the world size; ``shard_size`` cannot be combined with it.
        tp_size: BMTrain's tensor-parallel size: groups of this many consecutive ranks split the
            parameters made with ``DistributedParameter(tp_mode=True)`` (``bmt.nn.ColumnParallelLinear``
            and the others), and every parameter is sharded (ZeRO) over the ranks with the same place
            in their group, ``world_size // tp_size`` of them (BMTrain's ``tp_zero_comm``). Must divide
            the world size; ``shard_size`` cannot be combined with it.
        num_micro_batches: micro-batches a pipeline splits each batch into; default: ``pipe_size``.
        sp_size: BMTrain's sequence-parallel size, accepted for compatibility; above 1 raises
            ``NotImplementedError`` (there is no sequence parallelism).

    Returns:
        The process's :class:`DistContext`.

    Raises:
        ValueError: ``zero_level`` not 2 or 3; an unknown backend; ``pipe_size * tp_size`` not dividing the
            world size; ``backend="nccl"`` without CUDA; ``timeout`` not positive and finite; a ``shard_size``
            that does not divide the world size, or that the ranks disagree on.
        TypeError: ``timeout`` neither a ``timedelta`` nor a number of seconds.
        RuntimeError: ``LOCAL_RANK`` names a GPU this process cannot see (more processes than GPUs);
            ``RANK`` and ``WORLD_SIZE`` set without ``MASTER_ADDR`` or ``MASTER_PORT`` (not under torchrun).
        NotImplementedError: ``sp_size`` above 1; ``shard_size`` with ``pipe_size`` or ``tp_size`` above 1.

    Example::

        import bmtwrap as bmt
        bmt.init_distributed(seed=0, timeout=600)  # fail within 10 minutes when a rank stops
        bmt.print_rank(f"rank {bmt.rank()} of {bmt.world_size()}")
        # Debugging ranks that hang or diverge: each collective first checks that all ranks run it.
        # bmt.init_distributed(seed=0, check_collectives=True)
    """
    global _CONTEXT
    if zero_level not in (2, 3):
        raise ValueError(f"zero_level must be 2 or 3, got {zero_level!r}")
    if backend not in (None, "nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl', 'gloo' or None, got {backend!r}")
    if sp_size > 1:
        raise NotImplementedError(f"sequence parallelism is not supported (sp_size={sp_size}); bmtwrap shards "
                                  "parameters (ZeRO), with pipeline and tensor parallelism by pipe_size and tp_size")
    pipe_size, micros = check_sizes(pipe_size, tp_size, num_micro_batches)
    if pipe_size * tp_size > 1 and shard_size is not None:
        raise NotImplementedError(
            f"init_distributed(shard_size={shard_size!r}) with {'tp' if tp_size > 1 else 'pipe'}_size="
            f"{tp_size if tp_size > 1 else pipe_size}: parameters are sharded over the ranks of a pipeline stage with "
            "the same tensor-parallel place; leave shard_size out")
    parallel, world = pipe_size * tp_size, (dist.get_world_size() if dist.is_initialized() else
                                            int(os.environ.get("WORLD_SIZE", "1")))  # before anything is made
    if world % parallel:
        raise ValueError(f"pipe_size * tp_size = {pipe_size} * {tp_size} must divide the world size {world}; start a "
                         f"multiple of {parallel} processes")
    wait_limit = _check_timeout(timeout)
    if is_initialized():
        warnings.warn("bmtwrap.init_distributed() was called again; keeping the first context", stacklevel=2)
        return _CONTEXT
    if _CONTEXT is not None and _CONTEXT.watchdog is not None:
        _CONTEXT.watchdog.stop()  # the group it watched was destroyed

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _pick_device(local_rank, backend)
    if not dist.is_initialized():
        # Activation checkpointing imports torch._dynamo on first use; imported after the process
        # group exists, it keeps the group alive past destroy_process_group(), and gloo's threads
        # then abort the process at exit. Imported first, it does not.
        import torch._dynamo  # noqa: F401
        chosen = backend or ("nccl" if device.type == "cuda" else "gloo")
        kwargs: dict = {"timeout": wait_limit}
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            _check_rendezvous(init_method)
            if device.type == "cuda":
                kwargs["device_id"] = device
            dist.init_process_group(chosen, init_method=init_method, **kwargs)
        else:
            # No launcher: a world of one needs no rendezvous, only a store.
            dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        # BMTrain programs never destroy the group; a group alive at interpreter shutdown can abort
        # the process from gloo's threads. The group made here is destroyed at exit.
        atexit.register(_destroy_at_exit)
    else:
        # The program's group keeps its timeout; asking for that same one (as its maker did) is no mistake.
        asked, wait_limit = wait_limit, _group_timeout(device)
        if timeout is not None and asked != wait_limit:
            warnings.warn(f"init_distributed(timeout={asked.total_seconds():g} s) has no effect: torch.distributed "
                          f"was initialised before, with a timeout of {wait_limit.total_seconds():g} s; pass the "
                          "timeout to init_process_group instead", stacklevel=2)
    world = dist.get_world_size()
    shards = world // parallel if parallel > 1 else _agreed_shard_size(_resolve_shard_size(shard_size, world), device)
    _CONTEXT = DistContext(
        rank=dist.get_rank(),
        world_size=world,
        local_rank=local_rank,
        device=device,
        zero_level=zero_level,
        seed=seed,
        timeout=wait_limit,
        shard_size=shards,
        tp_size=tp_size,
        pipe_size=pipe_size,
        micro_batches=micros,
        subgroups=(make_stage_subgroups(world, pipe_size, tp_size, wait_limit) if parallel > 1 else
                   _make_subgroups(world, shards, wait_limit)),
    )
    if _CONTEXT.world_size > 1:
        _CONTEXT.watchdog = Watchdog(default_store(), _CONTEXT.rank, _CONTEXT.world_size, wait_limit,
                                     check_collectives=check_collectives,
                                     watch_completion=dist.get_backend() == "nccl")
        _CONTEXT.watchdog.start()
    _seed_everything(seed)
    return _CONTEXT


def _resolve_shard_size(shard_size: Union[int, str, None], world: int) -> int:
    """The shard group's size ``init_distributed(shard_size=...)`` asks for (see its docstring)."""
    where = "shard_size"
    if shard_size is None and os.environ.get("BMTWRAP_SHARD_SIZE"):
        shard_size, where = os.environ["BMTWRAP_SHARD_SIZE"], "BMTWRAP_SHARD_SIZE"
        if shard_size != "local":
            try:
                shard_size = int(shard_size)
            except ValueError:
                raise ValueError(f"BMTWRAP_SHARD_SIZE={shard_size!r}: give a number of ranks, or 'local'") from None
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if shard_size is None:
        # One node's ranks when the job spans several nodes (torchrun's agents each start LOCAL_WORLD_SIZE).
        several_nodes = local is not None and 0 < int(local) < world and world % int(local) == 0
        return int(local) if several_nodes else world
    if shard_size == "local":
        if local is None:
            raise ValueError(f"{where}='local' takes the ranks of one node from LOCAL_WORLD_SIZE, which is not set: "
                             "start under torchrun, or give the number of ranks")
        shard_size = int(local)
    if isinstance(shard_size, bool) or not isinstance(shard_size, int):
        raise TypeError(f"{where} must be a number of ranks, 'local' or None, got {shard_size!r}")
    if shard_size < 1 or world % shard_size:
        raise ValueError(f"{where}={shard_size} must divide the world size {world} (groups of equal size), "
                         f"for example {', '.join(str(d) for d in range(1, world + 1) if world % d == 0)}")
    return shard_size


def _agreed_shard_size(shards: int, device: torch.device) -> int:
    """``shards``, once every rank has found the same (each reads its own environment)."""
    if dist.get_world_size() == 1:
        return shards
    sizes = torch.tensor([shards, -shards], device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    if int(sizes[0]) != -int(sizes[1]):
        raise ValueError(f"the ranks chose different shard sizes, from {-int(sizes[1])} to {int(sizes[0])} (this one "
                         f"{shards}): give init_distributed(shard_size=...) or BMTWRAP_SHARD_SIZE the same on every "
                         "rank, or start the same number of processes on every node")
    return shards


def _make_subgroups(world: int, shards: int, wait_limit: datetime.timedelta) -> Dict[str, Any]:
    """The shard and replica groups of a hybrid layout; every rank makes every group, in the same order.

    None are made where the world group serves: sharding over every rank (one shard group) needs
    none, and with shard groups of one rank the replica group is the world.
    """
    if shards in (1, world):
        return {}
    shard, _ = dist.new_subgroups_by_enumeration(_shard_groups(world, shards), timeout=wait_limit)
    replica, _ = dist.new_subgroups_by_enumeration(_replica_groups(world, shards), timeout=wait_limit)
    return {"shard": shard, "replica": replica}


def _shard_groups(world: int, shards: int) -> List[List[int]]:
    """The shard groups of a hybrid layout: ``shards`` consecutive ranks each (see [Note: hybrid sharding])."""
    return [list(range(start, start + shards)) for start in range(0, world, shards)]


def _replica_groups(world: int, shards: int) -> List[List[int]]:
    """The replica groups: group ``i`` holds the ranks with shard rank ``i``, one per shard group."""
    return [list(range(offset, world, shards)) for offset in range(shards)]


def _check_timeout(timeout: Union[datetime.timedelta, float, None]) -> datetime.timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be a datetime.timedelta or a number of seconds, got {type(timeout).__name__} "
                        f"{timeout!r}")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"timeout must be a positive, finite time, got {timeout!r}; "
                         f"the default is {DEFAULT_TIMEOUT.total_seconds():g} s")
    return datetime.timedelta(seconds=seconds)


def _group_timeout(device: torch.device) -> datetime.timedelta:
    """The timeout of a default group made by the caller (private torch attributes; the torch default if gone)."""
    try:
        return dist.group.WORLD._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return datetime.timedelta(minutes=10 if dist.get_backend() == "nccl" else 30)


def _destroy_at_exit() -> None:
    if _CONTEXT is not None and _CONTEXT.watchdog is not None:
        _CONTEXT.watchdog.stop()  # before the store it writes to goes away with the group
    if _CONTEXT is not None:
        _CONTEXT.subgroups.clear()  # destroyed with the default group below
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    """This process's rank (0 … world_size-1)."""
    return current().rank


def world_size() -> int:
    """The number of processes in the job (parameters are sharded over ``shard_size`` of them: see
    :func:`init_distributed`)."""
    return current().world_size


def synchronize() -> None:
    """Wait for every rank (a barrier), after this rank's queued GPU work is done."""
    ctx = current()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    # Naming the GPU tells NCCL which device the barrier runs on (else it guesses, with a warning).
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" and ctx.device.index is not None else None
    with ctx.watched("barrier", "synchronize()"):
        dist.barrier(group=ctx.group, device_ids=device_ids)


def sum_loss(loss: torch.Tensor, method: str = "mean") -> torch.Tensor:
    """The loss reduced over ranks, for logging (BMTrain's name; ``method`` "mean" or "sum").

    Returns a new, detached tensor; ``loss`` is left untouched.
    """
    if method not in ("mean", "sum"):
        raise ValueError(f"method must be 'mean' or 'sum', got {method!r}")
    ctx = current()
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"sum_loss expects a tensor, got {type(loss).__name__}")
    out = loss.detach().clone()
    with ctx.watched("all-reduce", "sum_loss()"):
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=ctx.group)
    if method == "mean":
        out = out / ctx.world_size
    return out


def agree_max(values: List[int], label: str) -> List[int]:
    """The largest of each of ``values`` over the ranks: one small all-reduce, named ``label`` to the watchdog.
    Automatic choices agree through it (with negated values, on the smallest)."""
    ctx = current()
    if ctx.world_size == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.int64, device=ctx.device)
    with ctx.watched("all-reduce", label):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=ctx.group)
    return tensor.tolist()


def wait_loader() -> None:
    """Make the current CUDA stream wait for the parameter copies bmtwrap has queued from the host so far
    (BMTrain's name for waiting on its loading stream); nothing to wait for on the CPU."""
    ctx = current()
    if ctx.device.type == "cuda" and "to_device" in ctx.copy_streams:
        torch.cuda.current_stream(ctx.device).wait_stream(ctx.copy_streams["to_device"])


def print_rank(*args: Any, rank: int = 0, **kwargs: Any) -> None:
    """``print`` on one rank only (rank 0 by default); a plain ``print`` before initialisation."""
    if not is_initialized() or _CONTEXT.rank == rank:
        print(*args, **kwargs)
