"""``bmt.config``: BMTrain's global settings mapping, as a read-only view of the process context.

BMTrain keeps its settings in a module-level dict filled by ``init_distributed``. bmtwrap keeps
one :class:`~bmtwrap.engine.dist.DistContext` instead; :data:`config` reads it on every lookup, so it
holds no state of its own and can never disagree with :func:`bmtwrap.rank` and the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator

import torch

from ..engine import dist as _dist
from . import comm as _comm

__all__ = ["ConfigView", "config"]

# BMTrain's keys that bmtwrap answers, and how, from the context. Without pipeline or tensor
# parallelism the ZeRO group is the shard group (every rank, unless init_distributed(shard_size=...) made groups of
# fewer): the zero rank is the rank in it. With tensor parallelism the shard group is the tp_zero group and BMTrain's
# ZeRO group every rank, or with pipelines the stage (see bmtrain/comm.py and engine/stages.py). The communicators
# (comm, zero_comm, tp_comm, ...) and the topology are made on each lookup from the context (see bmtrain/comm.py): equal communicators compare equal.
_KEYS: Dict[str, Callable[[_dist.DistContext], Any]] = {
    "initialized": lambda ctx: True,
    "rank": lambda ctx: ctx.rank,
    "world_size": lambda ctx: ctx.world_size,
    "local_rank": lambda ctx: ctx.local_rank,
    "zero_level": lambda ctx: ctx.zero_level,
    "zero_rank": lambda ctx: ctx.rank % (ctx.world_size // ctx.pipe_size) if ctx.tp_size > 1 else ctx.shard_rank,
    "pipe_size": lambda ctx: ctx.pipe_size,
    "pipe_enabled": lambda ctx: ctx.pipe_size > 1,
    "pipe_rank": lambda ctx: ctx.rank // (ctx.world_size // ctx.pipe_size),
    "micros": lambda ctx: ctx.micro_batches,
    "tp_size": lambda ctx: ctx.tp_size,
    "tp_rank": lambda ctx: ctx.tp_rank,
    "tp_zero_rank": lambda ctx: ctx.shard_rank,
    "zero_size": lambda ctx: ctx.world_size // ctx.pipe_size if ctx.tp_size > 1 else ctx.shard_size,
    "tp_zero_size": lambda ctx: ctx.shard_size,
    "seed": lambda ctx: ctx.seed,
    "topology": lambda ctx: _comm.current_topology(),
    **{key: (lambda ctx, key=key: _comm.config_communicator(key)) for key in _comm.CONFIG_COMMS},
}

# BMTrain's streams, on a GPU. BMTrain programs order their own work against the parameters' loads with
# `torch.cuda.current_stream().wait_stream(bmt.config["load_stream"])`, and queue work beside them with
# `with torch.cuda.stream(bmt.config["load_stream"])`. Here the load stream is the engine's stream of copies
# to the device (offloaded shards come through it; wait_loader() waits for it), so both order correctly
# with the engine's copies; gathers from GPU shards are ordered by the engine itself and need no wait.
# The computation runs on the device's default stream, BMTrain's calc_stream.
_STREAMS: Dict[str, Callable[[_dist.DistContext], Any]] = {
    "load_stream": lambda ctx: ctx.copy_stream("to_device"),
    "calc_stream": lambda ctx: torch.cuda.default_stream(ctx.device),
}

# BMTrain's keys with no meaning here, and why.
_ABSENT: Dict[str, str] = {
    "load_event": "bmtwrap keeps no event of BMTrain's; call bmt.wait_loader() to wait for the loads",
    "barrier_stream": "bmtwrap does not keep BMTrain's streams; use bmt.synchronize()",
    "local_size": "bmtwrap does not record the number of processes per host",
    "loss_scale_factor": "loss scaling is an argument of bmt.optim.OptimManager, not a global setting",
    "loss_scale_steps": "loss scaling is an argument of bmt.optim.OptimManager, not a global setting",
    "save_param_to_cpu": "bmt.save always gathers to the host; there is no switch",
}


class ConfigView(Mapping):
    """The class of :data:`config`: a read-only mapping of BMTrain's setting names to this process's values.

    Every lookup reads the context made by :func:`bmtwrap.init_distributed`. Keys: ``initialized``,
    ``rank``, ``world_size``, ``local_rank``, ``zero_level``, ``zero_rank``, ``pipe_size``,
    ``pipe_enabled``, ``pipe_rank`` (the stage), ``micros`` (a pipeline's micro-batches), ``tp_size``,
    ``tp_rank`` (the place in ``tp_comm``),
    ``tp_zero_rank``, ``zero_size``, ``tp_zero_size``, ``seed``, ``topology`` (a
    :class:`~bmtwrap.bmtrain.comm.Topology`), the communicators ``comm`` (every rank), ``zero_comm``,
    ``tp_zero_comm``, ``pp_zero_comm``, ``pp_tp_zero_comm`` (the ranks parameters are sharded over; with
    ``tp_size`` above 1, ``zero_comm`` and ``pp_zero_comm`` are every rank), ``tp_comm`` (the
    tensor-parallel group) and ``pipe_comm`` (one rank of each stage; this rank alone without pipelines) (each a :class:`~bmtwrap.bmtrain.comm.Communicator`);
    on a GPU also ``load_stream`` (the engine's stream of copies to the
    device: waiting for it waits for the parameters it loads) and ``calc_stream`` (the device's
    default stream, where the model computes).

    Raises:
        RuntimeError: on lookup before :func:`bmtwrap.init_distributed`.
        KeyError: a key bmtwrap does not have; the message says why (``load_event``, the streams of a
            process on the CPU) or that BMTrain has no such key.
        TypeError: on assignment (the settings are arguments of ``init_distributed``).

    Example::

        bmt.init_distributed(seed=0)
        if bmt.config["rank"] == 0: ...
    """

    def __getitem__(self, key: str) -> Any:
        ctx = _dist.current()
        reader = _KEYS.get(key)
        if reader is not None:
            return reader(ctx)
        stream = _STREAMS.get(key)
        if stream is not None:
            if ctx.device.type != "cuda":
                raise KeyError(f"bmt.config[{key!r}] is a CUDA stream, and this process runs on {ctx.device}: "
                               "there is nothing to order against")
            return stream(ctx)
        if key in _ABSENT:
            raise KeyError(f"bmt.config[{key!r}] does not exist in bmtwrap: {_ABSENT[key]}")
        raise KeyError(f"bmt.config has no key {key!r}; it has {sorted(_KEYS)}")

    def __setitem__(self, key: str, value: Any) -> None:
        raise TypeError(
            f"bmt.config is read-only (tried to set {key!r}); pass settings to bmt.init_distributed() instead"
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    @staticmethod
    def _keys() -> list:
        return list(_KEYS) + (list(_STREAMS) if _dist.current().device.type == "cuda" else [])

    def __repr__(self) -> str:
        if not _dist.is_initialized():
            return "bmt.config (not initialised: call bmt.init_distributed())"
        return f"bmt.config({dict(self)!r})"


config = ConfigView()
"""BMTrain's ``config``: read-only settings of this process (see :class:`ConfigView`)."""
