"""BMTrain's communicators and rank layout, over ``torch.distributed`` process groups.

BMTrain keeps NCCL communicators of its own in ``bmt.config`` (``comm``, ``zero_comm``, ``tp_comm``, ...)
and a ``topology`` object that says which ranks each one joins. Here a :class:`Communicator` names a
group of ranks and runs on a ``torch.distributed`` process group (NCCL on GPUs, gloo on CPUs);
:class:`Topology` is BMTrain's layout of pipeline, tensor-parallel and ZeRO groups, computed for any
sizes.

[Note: BMTrain's layout]
With W ranks, P pipeline stages and T tensor-parallel ranks (W divisible by P * T), BMTrain cuts the
ranks into P stages of S = W / P consecutive ranks, and each stage into tensor-parallel groups of T
consecutive ranks. For rank r:

    group        its members                          r's place in it (BMTrain's ``..._id``)
    pipe         r % S + k * S       (k < P)            r // S   (the stage)
    pp_zero      (r // S) * S + j    (j < S)            r % S
    tp           (r // T) * T + j    (j < T)            r % T
    tp_zero      r % T + k * T       (k < W / T)        r // T
    pp_tp_zero   the stage's ranks with r's tp place    (r % S) // T
    zero         every rank                           r

Each group kind partitions the ranks; BMTrain numbers the groups of a kind by ``..._idx`` (the
pipeline, the stage, the tensor-parallel group, ...). bmtwrap shards parameters over its shard groups
(every rank unless ``init_distributed(shard_size=...)``), so the communicators of ZeRO groups
(``zero_comm``, ``pp_zero_comm``, ``tp_zero_comm``, ``pp_tp_zero_comm``) run over the shard group; with
pipeline and tensor-parallel sizes of 1 that is BMTrain's layout exactly. With ``init_distributed(tp_size=T)``
the shard group is BMTrain's tp_zero group (``tp_zero_comm``, ``pp_tp_zero_comm``), ``tp_comm`` runs over the
tensor-parallel group, and ``zero_comm``, ``pp_zero_comm`` over every rank, as in BMTrain. With
``init_distributed(pipe_size=P)`` ``pipe_comm`` runs over the pipe group (the engine's replica group),
``zero_comm`` and ``pp_zero_comm`` over the stage (BMTrain's ZeRO group of a pipeline), and ``tp_zero_comm``,
``pp_tp_zero_comm`` over the shard group (the stage's ranks with this tensor-parallel place: see [Note:
pipeline layout] in ``bmtwrap/engine/stages.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch.distributed as dist

from ..engine import dist as _dist

__all__ = ["Communicator", "Topology"]

GROUP_KINDS = ("pipe", "pp_zero", "tp", "tp_zero", "pp_tp_zero", "zero")

# bmt.config's communicator keys and the group kind each one spans (None: every rank).
CONFIG_COMMS: Mapping[str, Optional[str]] = MappingProxyType({
    "comm": None, "zero_comm": "zero", "pipe_comm": "pipe", "pp_zero_comm": "pp_zero", "tp_comm": "tp",
    "tp_zero_comm": "tp_zero", "pp_tp_zero_comm": "pp_tp_zero",
})


@dataclass(frozen=True)
class Topology:
    """BMTrain's rank layout (``bmt.config["topology"]``): which group of each kind a rank joins, and its place there.

    See [Note: BMTrain's layout] in this module for the formulas. Computed from four numbers, so it
    can be built for any rank and sizes without starting a process group.

    Attributes:
        rank: the rank described, 0 … ``world_size - 1``.
        world_size: the number of ranks.
        pipe_size: pipeline stages (BMTrain's ``stages``).
        tp_size: ranks of one tensor-parallel group.

    BMTrain's attributes are properties: ``stage_id``/``pipe_idx`` (place in the pipeline, which
    pipeline), ``tp_id``/``tp_idx``, ``pp_zero_id``/``pp_zero_idx``, ``tp_zero_id``/``tp_zero_idx``,
    ``pp_tp_zero_id``/``pp_tp_zero_idx``, ``zero_id``/``zero_idx`` (``..._id``: the rank's place in its
    group; ``..._idx``: which group of that kind).

    Raises:
        ValueError: a size below 1, ``rank`` outside the world, or ``world_size`` not divisible by
            ``pipe_size * tp_size``.

    Example::

        topo = Topology(rank=5, world_size=8, pipe_size=2, tp_size=2)
        topo.stage_id, topo.tp_id, topo.ranks("tp_zero")   # (1, 1, (1, 3, 5, 7))
    """

    rank: int
    world_size: int
    pipe_size: int = 1
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "pipe_size", "tp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology: {name} must be a whole number of ranks >= 1, got {value!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"Topology: rank must be from 0 to {self.world_size - 1}, got {self.rank!r}")
        if self.world_size % (self.pipe_size * self.tp_size):
            raise ValueError(
                f"Topology: the world size {self.world_size} is not divisible by pipe_size * tp_size = "
                f"{self.pipe_size} * {self.tp_size}; start a multiple of {self.pipe_size * self.tp_size} processes")

    @property
    def stages(self) -> int:
        """Pipeline stages: ``pipe_size``."""
        return self.pipe_size

    @property
    def stage_size(self) -> int:
        """Ranks in one pipeline stage: ``world_size // pipe_size``."""
        return self.world_size // self.pipe_size

    stage_id = property(lambda self: self.rank // self.stage_size, doc="The rank's stage: its place in its pipeline.")
    pipe_rank = property(lambda self: self.stage_id, doc="The place in the pipe group: the stage (BMTrain's other name).")
    pipe_idx = property(lambda self: self.rank % self.stage_size, doc="Which pipeline: the place in the stage.")
    tp_id = property(lambda self: self.rank % self.tp_size, doc="The place in the tensor-parallel group.")
    tp_idx = property(lambda self: self.rank // self.tp_size, doc="Which tensor-parallel group.")
    pp_zero_id = property(lambda self: self.pipe_idx, doc="The place in the stage's ZeRO group (the stage).")
    pp_zero_idx = property(lambda self: self.stage_id, doc="Which stage's ZeRO group.")
    tp_zero_id = property(lambda self: self.tp_idx, doc="The place among the ranks with this tensor-parallel place.")
    tp_zero_idx = property(lambda self: self.tp_id, doc="Which tensor-parallel place's ZeRO group.")
    pp_tp_zero_id = property(lambda self: self.pipe_idx // self.tp_size,
                             doc="The place among the stage's ranks with this tensor-parallel place.")
    pp_tp_zero_idx = property(lambda self: self.stage_id * self.tp_size + self.tp_id,
                              doc="Which (stage, tensor-parallel place) ZeRO group.")
    zero_id = property(lambda self: self.rank, doc="The place among every rank: the rank.")
    zero_idx = property(lambda self: 0, doc="Which ZeRO group of every rank: the only one, 0.")

    def get_group_id(self, group_name: str) -> int:
        """Which group of kind ``group_name`` this rank joins (BMTrain's ``..._idx``); kinds: ``"pipe"``,
        ``"pp_zero"``, ``"tp"``, ``"tp_zero"``, ``"pp_tp_zero"``, ``"zero"``. Raises ValueError for another name."""
        return getattr(self, f"{_checked_kind(group_name)}_idx")

    def get_group_rank(self, group_name: str) -> int:
        """This rank's place in its group of kind ``group_name`` (BMTrain's ``..._id``; ``"pipe"``: the stage)."""
        if group_name == "pipe":
            return self.stage_id
        return getattr(self, f"{_checked_kind(group_name)}_id")

    def groups(self, group_name: str) -> List[Tuple[int, ...]]:
        """Every group of kind ``group_name``, by group id, each as its global ranks ordered by place."""
        kind = _checked_kind(group_name)
        found: Dict[int, Dict[int, int]] = {}
        for r in range(self.world_size):
            other = dataclasses.replace(self, rank=r)
            found.setdefault(other.get_group_id(kind), {})[other.get_group_rank(kind)] = r
        return [tuple(members[place] for place in sorted(members)) for _, members in sorted(found.items())]

    def ranks(self, group_name: str) -> Tuple[int, ...]:
        """The global ranks of this rank's group of kind ``group_name``, ordered by place."""
        return self.groups(group_name)[self.get_group_id(group_name)]


def _checked_kind(group_name: str) -> str:
    if group_name not in GROUP_KINDS:
        raise ValueError(f"unknown group kind {group_name!r}; BMTrain's topology has {', '.join(GROUP_KINDS)}")
    return group_name


@dataclass(frozen=True)
class Communicator:
    """A group of ranks that BMTrain's collectives run on (``bmt.config["comm"]``, ``["zero_comm"]``, ...).

    Stands where BMTrain passes its NCCL communicators: to ``bmt.nccl``'s functions,
    ``bmt.distributed``'s (which also take a ``torch.distributed.ProcessGroup``) and
    ``allgather_object``. Two communicators over the same ranks and process group compare equal and
    hash alike (``bmt.config["zero_comm"] == bmt.config["comm"]`` when parameters are sharded over
    every rank, as BMTrain's are the same object).

    Attributes:
        name: the ``bmt.config`` key it came from (``"comm"``, ``"tp_comm"``, ...) or ``"group"``
            for a wrapped process group; not compared.
        ranks: the global ranks of the group, ordered by their place in it.
        rank: this process's place in ``ranks`` (BMTrain's ``nccl.commRank``); not compared.

    Example::

        comm = bmt.config["zero_comm"]
        comm.rank, comm.size, comm.ranks     # (bmt.nccl.commRank(comm), bmt.nccl.commCount(comm), ...)
    """

    name: str = dataclasses.field(compare=False)
    ranks: Tuple[int, ...]
    rank: int = dataclasses.field(compare=False)
    # A process group the program made; None for bmtwrap's own groups, looked up on use (see `group`).
    explicit_group: Optional[dist.ProcessGroup] = dataclasses.field(default=None, repr=False)

    @property
    def size(self) -> int:
        """The number of ranks (BMTrain's ``nccl.commCount``)."""
        return len(self.ranks)

    world_size = size

    @property
    def group(self) -> dist.ProcessGroup:
        """The ``torch.distributed`` process group the communicator runs on.

        bmtwrap's own groups are looked up on each use, never held: the default group for every rank,
        the shard group of hybrid sharding, and a group of this rank alone (made on first use, with
        local synchronisation) for a communicator of one rank, whose collectives bmtwrap runs locally.
        """
        if self.explicit_group is not None:
            return self.explicit_group
        ctx = _dist.current()
        if len(self.ranks) == ctx.world_size:
            return ctx.group
        if self.ranks == ctx.shard_peers and ctx.shard_size > 1:
            return ctx.shard_group
        if ctx.tp_size > 1 and self.ranks == current_topology().ranks("tp"):
            return ctx.tp_group
        if ctx.pipe_size > 1 and self.ranks == current_topology().ranks("pipe"):
            return ctx.replica_group
        if ctx.pipe_size > 1 and self.ranks == current_topology().ranks("pp_zero"):
            return ctx.subgroups.get("stage") or ctx.shard_group
        assert self.ranks == (ctx.rank,), f"rank {ctx.rank}: no process group for the ranks {self.ranks}"
        if "self" not in ctx.subgroups:
            ctx.subgroups["self"] = dist.new_group([ctx.rank], use_local_synchronization=True)
        return ctx.subgroups["self"]

    def global_rank(self, place: int) -> int:
        """The global rank at ``place`` in the group."""
        return self.ranks[place]


CommLike = Union[None, Communicator, dist.ProcessGroup]
"""What collectives accept as ``comm``: ``None`` (every rank), a :class:`Communicator` or a ProcessGroup."""


def as_communicator(comm: Any, caller: str) -> Communicator:
    """``comm`` as a :class:`Communicator`; ``caller`` names the function in errors.

    ``None`` is every rank (``bmt.config["comm"]``); a ``torch.distributed.ProcessGroup`` is wrapped.

    Raises:
        RuntimeError: before :func:`bmtwrap.init_distributed`.
        ValueError: a group this rank is not a member of.
        TypeError: anything else.
    """
    ctx = _dist.current()
    if comm is None:
        return config_communicator("comm")
    if isinstance(comm, Communicator):
        return comm
    if isinstance(comm, int) and comm == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{caller}: this rank ({ctx.rank}) is not a member of the group passed as comm; call it only on "
            "the ranks that torch.distributed.new_group(ranks) was given")
    if not isinstance(comm, dist.ProcessGroup):
        raise TypeError(
            f"{caller}: comm must be a communicator of bmt.config (bmt.config['comm'], ['zero_comm'], ...), a "
            f"torch.distributed.ProcessGroup or None (every rank), got {type(comm).__name__}")
    return Communicator("group", tuple(dist.get_process_group_ranks(comm)), dist.get_rank(comm), comm)


def current_topology() -> Topology:
    """This process's :class:`Topology` (``bmt.config["topology"]``): ``init_distributed``'s ``pipe_size`` and
    ``tp_size``."""
    ctx = _dist.current()
    return Topology(rank=ctx.rank, world_size=ctx.world_size, pipe_size=ctx.pipe_size, tp_size=ctx.tp_size)


def config_communicator(key: str) -> Communicator:
    """The communicator ``bmt.config[key]`` names (a key of :data:`CONFIG_COMMS`); see [Note: BMTrain's layout]."""
    ctx = _dist.current()
    kind = CONFIG_COMMS[key]
    if kind is None:
        ranks: Tuple[int, ...] = tuple(range(ctx.world_size))
    elif kind in ("zero", "pp_zero") and ctx.pipe_size > 1:
        ranks = current_topology().ranks("pp_zero")  # BMTrain's ZeRO group of a pipeline: the stage
    elif kind in ("zero", "pp_zero") and ctx.tp_size > 1:
        ranks = tuple(range(ctx.world_size))  # BMTrain's ZeRO group of every rank (the stage's, of one stage)
    elif kind.endswith("zero"):
        # Parameters are sharded over the shard group; with pipe and tp sizes of 1 BMTrain's ZeRO groups
        # are every rank, which the shard group is unless init_distributed(shard_size=...) made it smaller.
        ranks = ctx.shard_peers or tuple(range(ctx.world_size))
    else:
        ranks = current_topology().ranks(kind)
    return Communicator(key, ranks, ranks.index(ctx.rank))
