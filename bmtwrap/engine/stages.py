"""Pipeline stages: the ranks of ``init_distributed(pipe_size=P)``'s stages and the engine's groups among them.

[Note: pipeline layout]
BMTrain's layout (see [Note: BMTrain's layout] in ``bmtwrap/bmtrain/comm.py``): W ranks form P stages of
S = W / P consecutive ranks, and each stage is cut into tensor-parallel groups of T consecutive ranks. The
engine's groups, for rank r:

    shard     the ranks of r's stage with r's tensor-parallel place (S / T of them; BMTrain's
              ``pp_tp_zero`` group, the stage's ZeRO group when T is 1): every flat buffer is sharded over it.
    replica   the ranks with r's place in their stage, one per stage (BMTrain's ``pipe`` group, S of them
              in all): a parameter every stage holds (outside the pipeline's layers) is replicated over it
              and its gradient shard averaged over it, as under hybrid sharding; a pipeline's activations
              go along it.
    tp        T consecutive ranks, as without pipelines.

A layer of a ``PipelineTransformerBlockList`` is held by one stage only (see ``bmtwrap/bmtrain/pipeline.py``),
so its gradient is reduce-scattered in the shard group and not averaged over the replica group, whose other
ranks do not hold it; it is divided by P instead (``collectives.reduce_scatter_mean(..., one_stage=True)``).
Each stage's layers ran on the micro-batches of all P ranks of its pipeline, so the gradient is then, as
for every other parameter, the mean over the W ranks' losses.
"""

from __future__ import annotations

import datetime
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

__all__ = ["check_sizes", "make_stage_subgroups", "stage_groups", "stage_peers"]


def check_sizes(pipe_size: int, tp_size: int, num_micro_batches: Optional[int]) -> Tuple[int, int]:
    """``(pipe_size, micro-batches)`` after BMTrain's defaults (a pipe size of -1 is 1; micro-batches: the pipe size).

    Raises:
        ValueError: a size or number of micro-batches that is not a whole number >= 1.
    """
    pipe_size = 1 if pipe_size == -1 else pipe_size
    for name, size in (("pipe_size", pipe_size), ("tp_size", tp_size)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a whole number of ranks >= 1, got {size!r}")
    micros = pipe_size if num_micro_batches is None else num_micro_batches
    if isinstance(micros, bool) or not isinstance(micros, int) or micros < 1:
        raise ValueError(f"num_micro_batches must be a whole number >= 1 (or None: pipe_size), got {micros!r}")
    return pipe_size, micros


def stage_groups(world: int, pipe_size: int, tp_size: int) -> Dict[str, List[List[int]]]:
    """Every group of each kind, as global ranks (see [Note: pipeline layout]): ``"shard"``, ``"replica"``, ``"tp"``,
    and with ``tp_size`` above 1 ``"stage"``."""
    stage = world // pipe_size
    groups = {
        "shard": [list(range(start + place, start + stage, tp_size))
                  for start in range(0, world, stage) for place in range(tp_size)],
        "replica": [list(range(place, world, stage)) for place in range(stage)],
        "tp": [list(range(start, start + tp_size)) for start in range(0, world, tp_size)],
    }
    if tp_size > 1:  # the stage's ranks (BMTrain's ZeRO group of a pipeline), where the shard group is fewer
        groups["stage"] = [list(range(start, start + stage)) for start in range(0, world, stage)]
    return groups


def stage_peers(kind: str, rank: int, world: int, pipe_size: int, tp_size: int) -> Tuple[int, ...]:
    """The global ranks of ``rank``'s group of ``kind``."""
    return next(tuple(group) for group in stage_groups(world, pipe_size, tp_size)[kind] if rank in group)


def make_stage_subgroups(world: int, pipe_size: int, tp_size: int, timeout: datetime.timedelta) -> Dict[str, Any]:
    """The process groups of each kind; every rank makes every group, in the same order. None is made for
    a kind whose groups have one rank each (nothing runs in them) or one group of every rank (the world's serves)."""
    out: Dict[str, Any] = {}
    for kind, groups in stage_groups(world, pipe_size, tp_size).items():
        if len(groups[0]) > 1 and len(groups) > 1:
            out[kind], _ = dist.new_subgroups_by_enumeration(groups, timeout=timeout)
    return out
