"""Shard arithmetic and :class:`DistributedParameter`.

[Note: flat layout]
A group of parameters of one dtype is laid end to end in one flat buffer::

    full buffer (world_size * shard_size elements)
    |-- p0 --|pad|---- p1 ----|pad|-- p2 --|...........padding...........|
    |<-- rank 0's shard -->|<-- rank 1's shard -->|<-- rank 2's shard -->|

Every parameter starts at a multiple of ``align`` elements, so that its full view is aligned for
vectorised kernels. Rank r owns the contiguous slice ``[r * shard_size, (r + 1) * shard_size)``.
A parameter may be split between ranks, owned by one, or (when it is small and the world large)
not owned by some ranks at all: the local piece is then empty. After sharding, each original
parameter object becomes a 1-D view of its local piece, so optimizers keep working per parameter.
Invariants: ``shard_size * world_size >= total`` and ``shard_size`` is a multiple of ``align``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from . import dist as _dist

__all__ = ["DistributedParameter", "FlatLayout", "LocalPiece", "build_layout"]

# Parameters start at multiples of 64 bytes inside a flat buffer: enough for 16-byte vector loads
# and for cuBLAS's alignment preference, cheap in padding.
ALIGN_BYTES = 64


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class LocalPiece:
    """The part of one parameter that one rank owns.

    ``param_start:param_end`` index the parameter's flattened elements; ``shard_start`` is where
    that part begins inside the rank's shard. An empty piece has ``param_start == param_end``.
    """

    __slots__ = ("param_start", "param_end", "shard_start")

    def __init__(self, param_start: int, param_end: int, shard_start: int) -> None:
        self.param_start = param_start
        self.param_end = param_end
        self.shard_start = shard_start

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start

    @property
    def shard_end(self) -> int:
        return self.shard_start + self.numel

    def __repr__(self) -> str:
        return f"LocalPiece(param[{self.param_start}:{self.param_end}] at shard[{self.shard_start}])"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LocalPiece) and (self.param_start, self.param_end, self.shard_start) == (
            other.param_start,
            other.param_end,
            other.shard_start,
        )


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of a flat buffer lives (see [Note: flat layout]).

    Attributes:
        numels: element count of each parameter, in buffer order.
        offsets: start of each parameter in the full buffer.
        world_size: number of shards.
        shard_size: elements per shard, padding included.
    """

    numels: Tuple[int, ...]
    offsets: Tuple[int, ...]
    world_size: int
    shard_size: int

    @property
    def padded_total(self) -> int:
        return self.shard_size * self.world_size

    def piece(self, index: int, rank: int) -> LocalPiece:
        """The part of parameter ``index`` that ``rank`` owns (possibly empty)."""
        start = self.offsets[index]
        end = start + self.numels[index]
        lo = max(start, rank * self.shard_size)
        hi = min(end, (rank + 1) * self.shard_size)
        if hi <= lo:
            return LocalPiece(0, 0, 0)
        return LocalPiece(lo - start, hi - start, lo - rank * self.shard_size)


def build_layout(numels: Sequence[int], world_size: int, element_size: int) -> FlatLayout:
    """Lay parameters of ``numels`` elements end to end and split them into ``world_size`` shards.

    Raises:
        ValueError: a negative element count, or ``world_size < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    align = max(1, ALIGN_BYTES // element_size)
    offsets = []
    cursor = 0
    for n in numels:
        if n < 0:
            raise ValueError(f"parameter sizes must be >= 0, got {n}")
        offsets.append(cursor)
        cursor = _round_up(cursor + n, align)
    shard_size = _round_up(-(-cursor // world_size), align) if cursor else 0
    return FlatLayout(tuple(int(n) for n in numels), tuple(offsets), world_size, shard_size)


class DistributedParameter(torch.nn.Parameter):
    """A parameter stored in shards over all ranks (BMTrain's class, same meaning).

    At construction the full ``data`` (the same on every rank) is cut into ``world_size``
    pieces and only this rank's piece is kept: the object becomes a 1-D tensor of that piece.
    Inside a :class:`~bmtwrap.Block` the block re-lays it into its own flat buffer; outside any
    block it belongs to the model's root group, gathered for each forward.

    Args:
        data: the full initial value (or an empty tensor to be filled by ``init_method``).
        requires_grad: whether it is trained.
        init_method: called as ``init_method(full_tensor)`` by :func:`bmtwrap.init_parameters`.
        group: BMTrain's optional name of a parameter group; kept for compatibility.
        tp_mode: BMTrain's tensor-parallel switch: ``data`` is this rank's slice of a parameter split over
            the tensor-parallel group (``init_distributed(tp_size=...)``), or, with ``tp_split_dim`` below
            0, a parameter every rank of the group holds whole. Either way it is sharded over the ranks
            with the same tensor-parallel place.
        tp_split_dim: with ``tp_mode``, the dimension the full parameter is split along (BMTrain's -1: none).

    Raises:
        TypeError: ``data`` is not a tensor.
        RuntimeError: :func:`bmtwrap.init_distributed` was not called.
        ValueError: ``tp_split_dim`` not a dimension of ``data``.

    Example::

        self.weight = bmt.DistributedParameter(torch.empty(out_f, in_f), init_method=torch.nn.init.xavier_normal_)
    """

    _original_shape: torch.Size  # this rank's slice when split by tensor parallelism
    _tp_mode: bool  # BMTrain's tp_mode under tp_size > 1: its gradient is not summed over the tensor-parallel group
    _tp_split_dim: Optional[int]  # the dimension tensor parallelism splits it along; None: not split
    _init_method: Optional[Callable[[torch.Tensor], None]]
    _group: Optional[str]
    # (layout, local shard) while the parameter is sharded on its own; None once a block owns it.
    _standalone: Optional[Tuple[FlatLayout, torch.Tensor]]
    _lone_buffer: Any  # the FlatBuffer of a lone parameter, once the registry made it (it holds it weakly)

    def __new__(
        cls,
        data: torch.Tensor,
        requires_grad: bool = True,
        init_method: Optional[Callable[[torch.Tensor], None]] = None,
        group: Optional[str] = None,
        tp_mode: bool = False,
        tp_split_dim: int = -1,
    ) -> "DistributedParameter":
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"DistributedParameter expects a tensor, got {type(data).__name__}")
        if tp_mode and tp_split_dim >= data.dim():
            raise ValueError(f"DistributedParameter: tp_split_dim={tp_split_dim} is not a dimension of a tensor of "
                             f"shape {tuple(data.shape)}; give one below {data.dim()}, or -1 for no split")
        ctx = _dist.current()
        device = ctx.device if data.device.type in ("cpu", "meta") else data.device
        layout = build_layout([data.numel()], ctx.shard_size, data.element_size())
        local = torch.zeros(layout.shard_size, dtype=data.dtype, device=device)
        piece = layout.piece(0, ctx.shard_rank)
        if data.device.type != "meta":
            flat = data.detach().reshape(-1)
            local[piece.shard_start : piece.shard_end].copy_(flat[piece.param_start : piece.param_end])
        view = local[piece.shard_start : piece.shard_end]
        self = torch.Tensor._make_subclass(cls, view, requires_grad)
        self._original_shape = data.shape
        self._tp_mode = bool(tp_mode) and ctx.tp_size > 1
        self._tp_split_dim = tp_split_dim if self._tp_mode and tp_split_dim >= 0 else None
        self._init_method = init_method
        self._group = group
        self._standalone = (layout, local)
        self._lone_buffer = None
        return self

    @property
    def tp_mode(self) -> bool:
        """Whether it was made with ``tp_mode=True`` under ``init_distributed(tp_size>1)``."""
        return self._tp_mode

    @property
    def tp_split_dim(self) -> Optional[int]:
        """The dimension its full value is split along over the tensor-parallel group; ``None`` when not split."""
        return self._tp_split_dim

    def tp_full_shape(self, tp_size: int) -> torch.Size:
        """The shape of the full value: ``_original_shape`` with the split dimension ``tp_size`` times longer."""
        shape = list(self._original_shape)
        if self._tp_split_dim is not None:
            shape[self._tp_split_dim] *= tp_size
        return torch.Size(shape)

    @property
    def group(self) -> Optional[str]:
        """The ``group`` name given at construction (``None`` if none); bmtwrap does not use it."""
        return self._group

    def __getstate__(self) -> dict:
        """What pickling keeps: the attributes, less the engine's buffer of a lone parameter (rebuilt on use)."""
        state = dict(self.__dict__)
        state.pop("_lone_buffer", None)
        return state

    def __deepcopy__(self, memo: dict) -> torch.nn.Parameter:
        """A plain ``nn.Parameter`` holding a copy of this rank's piece (1-D), as a deep copy of any sharded
        parameter gives; a snapshot to compare against, not a sharded parameter (copy models before
        sharding them)."""
        if id(self) not in memo:
            memo[id(self)] = torch.nn.Parameter(self.detach().clone(), requires_grad=self.requires_grad)
        return memo[id(self)]

    def __repr__(self) -> str:
        return f"DistributedParameter(shape={tuple(self._original_shape)}, local={self.numel()}, dtype={self.dtype})"
