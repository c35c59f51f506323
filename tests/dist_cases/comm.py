"""BMTrain's communicators (bmt.config["comm"], ...) and bmt.nccl's calls, against plain torch.distributed.

Every bmt.nccl call is checked against the same collective done with torch.distributed on a copy of
the inputs, or, where torch has no single call for it (all2all, all2one, send/recv), against values
every rank computes from the sender's rank. Values are float64 multiples of 0.5, so sums, products,
extrema and their copies are exact: results must be equal, not close. Each case returns flags that are
true only if true on every rank; error cases return (exception type, message) pairs.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist

import bmtwrap as bmt
from bmtwrap import nccl
from bmtwrap.bmtrain.comm import Topology
from common import on_device, raised, run

OPS = ("sum", "avg", "max", "min", "prod")
TORCH_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
             "prod": dist.ReduceOp.PRODUCT}


def values(q: int, n: int) -> torch.Tensor:
    """Rank q's input: multiples of 0.5 in -1.5 … 2, never 0, ties across ranks."""
    return ((torch.arange(n, dtype=torch.float64) * (q + 2) + q) % 8 - 3) * 0.5 + (torch.arange(n) % 8 == 3) * 0.25


def everywhere(flags: Dict[str, bool]) -> Dict[str, bool]:
    """Each flag, true only if true on every rank (reduced with torch.distributed itself)."""
    keys = sorted(flags)
    bad = torch.tensor([0.0 if flags[k] else 1.0 for k in keys], dtype=torch.float64)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return {k: v == 0.0 for k, v in zip(keys, bad.tolist())}


def torch_all_reduce(x: torch.Tensor, op: str) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, op=TORCH_OPS[op])
    return out / dist.get_world_size() if op == "avg" else out


def communicators() -> Dict[str, Any]:
    c, rank, world = bmt.config, bmt.rank(), bmt.world_size()
    every = tuple(range(world))
    flags = {f"{key}_spans_every_rank": c[key].ranks == every and c[key].rank == rank and c[key].size == world
             for key in ("comm", "zero_comm", "tp_zero_comm", "pp_zero_comm", "pp_tp_zero_comm")}
    flags.update({f"{key}_is_this_rank": c[key].ranks == (rank,) and c[key].rank == 0 and c[key].size == 1
                  for key in ("tp_comm", "pipe_comm")})
    flags.update(
        zero_is_comm=c["zero_comm"] == c["comm"] and hash(c["zero_comm"]) == hash(c["comm"]),
        tp_is_not_comm=c["tp_comm"] != c["comm"],
        same_on_lookup=c["tp_comm"] == c["tp_comm"] and len({c["comm"], c["comm"], c["zero_comm"]}) == 1,
        counts=nccl.commCount(c["comm"]) == dist.get_world_size() and nccl.commRank(c["comm"]) == dist.get_rank()
        and nccl.commCount(c["tp_comm"]) == 1 and nccl.commRank(c["pipe_comm"]) == 0,
        process_group=nccl.commCount(dist.group.WORLD) == world and nccl.commRank(dist.group.WORLD) == rank,
        is_nccl_communicator=isinstance(c["comm"], nccl.NCCLCommunicator),
        topology=c["topology"] == Topology(rank=rank, world_size=world)
        and c["topology"].get_group_rank("zero") == c["zero_rank"]
        and c["topology"].get_group_rank("tp") == c["tp_rank"]
        and c["topology"].get_group_rank("pipe") == c["pipe_rank"] and c["zero_size"] == world,
        world_group=c["comm"].group is dist.group.WORLD,
        own_group=dist.get_world_size(c["tp_comm"].group) == 1,
    )
    return everywhere(flags)


def all_reduce_checks() -> Dict[str, bool]:
    rank, flags = bmt.rank(), {}
    for op in OPS:
        want = torch_all_reduce(values(rank, 6), op)
        x = values(rank, 6)
        nccl.allReduce(x.storage(), x.storage(), op, bmt.config["comm"])  # in place, BMTrain's habit
        flags[f"{op}_storage_in_place"] = torch.equal(x, want)
        out = torch.full((6,), -7.0, dtype=torch.float64)
        src = values(rank, 6)
        nccl.allReduce(src, out, op, bmt.config["zero_comm"])
        flags[f"{op}_tensors"] = torch.equal(out, want) and torch.equal(src, values(rank, 6))
        untyped = torch.empty(6, dtype=torch.float64)
        nccl.allReduce(values(rank, 6).storage(), untyped.untyped_storage(), op, dist.group.WORLD)
        flags[f"{op}_untyped_dst"] = torch.equal(untyped, want)
    wide = torch.zeros(3, 2, dtype=torch.float64)
    nccl.allReduce(values(rank, 6), wide.t(), "sum", bmt.config["comm"])  # a non-contiguous dst is written back
    flags["non_contiguous_dst"] = torch.equal(wide.t().reshape(-1), torch_all_reduce(values(rank, 6), "sum"))
    mine = torch.tensor(float(rank + 1))
    nccl.allReduce(mine.storage(), mine.storage(), "sum", bmt.config["comm"])  # BMTrain's test_training
    flags["test_training_norm"] = mine.item() == sum(range(1, bmt.world_size() + 1))
    return flags


def gather_scatter_checks() -> Dict[str, bool]:
    rank, world, flags = bmt.rank(), bmt.world_size(), {}
    parts = [torch.empty(4, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(parts, values(rank, 4))
    out = torch.full((4 * world + 3,), -7.0, dtype=torch.float64)  # larger than needed: the tail stays
    nccl.allGather(values(rank, 4).storage(), out.storage(), bmt.config["comm"])
    flags["all_gather"] = torch.equal(out[:4 * world], torch.cat(parts)) and bool((out[4 * world:] == -7).all())
    raw = torch.empty(4 * world, dtype=torch.float64)
    nccl.allGather(values(rank, 4).untyped_storage(), raw.untyped_storage(), bmt.config["comm"])  # bytes
    flags["all_gather_untyped"] = torch.equal(raw, torch.cat(parts))
    alone = torch.empty(4, dtype=torch.float64)
    nccl.allGather(values(rank, 4), alone, bmt.config["tp_comm"])
    flags["all_gather_one_rank"] = torch.equal(alone, values(rank, 4))
    for op in OPS:
        full = torch_all_reduce(values(rank, 3 * world), op)
        got = torch.empty(3, dtype=torch.float64)
        nccl.reduceScatter(values(rank, 3 * world).storage(), got.storage(), op, bmt.config["comm"])
        flags[f"reduce_scatter_{op}"] = torch.equal(got, full[3 * rank:3 * rank + 3])
    for root in range(world):
        want = values(rank, 5)
        dist.broadcast(want, src=root)
        x = values(rank, 5)
        nccl.broadcast(x.storage(), x.storage(), root, bmt.config["comm"])
        y = torch.empty(5, dtype=torch.float64)
        nccl.broadcast(values(rank, 5), y, root, bmt.config["comm"])
        flags[f"broadcast_root{root}"] = torch.equal(x, want) and torch.equal(y, want)
        for op in ("sum", "max", "avg"):
            total = torch_all_reduce(values(rank, 5), op)
            dst = torch.full((5,), -7.0, dtype=torch.float64)
            src = values(rank, 5)
            nccl.reduce(src.storage(), dst.storage(), op, root, bmt.config["comm"])
            expected = total if rank == root else torch.full((5,), -7.0, dtype=torch.float64)  # others: untouched
            flags[f"reduce_{op}_root{root}"] = torch.equal(dst, expected) and torch.equal(src, values(rank, 5))
    return flags


def exchange_checks() -> Dict[str, bool]:
    """all2all and all2one, whose results every rank computes from the senders' inputs."""
    rank, world, flags = bmt.rank(), bmt.world_size(), {}
    every = [values(q, 2 * world) for q in range(world)]
    got = torch.empty(2 * world, dtype=torch.float64)
    nccl.all2all(every[rank].storage(), got.storage(), bmt.config["comm"])
    flags["all2all"] = torch.equal(got, torch.cat([every[q][2 * rank:2 * rank + 2] for q in range(world)]))
    x = every[rank].clone()
    nccl.all2all(x, x, bmt.config["comm"])  # in place
    flags["all2all_in_place"] = torch.equal(x, got)
    for root in range(world):
        dst = torch.full((2 * world,), -7.0, dtype=torch.float64)
        nccl.all2one(every[rank], dst, root, bmt.config["comm"])
        want = torch.cat([every[q][2 * root:2 * root + 2] for q in range(world)]) if rank == root else \
            torch.full((2 * world,), -7.0, dtype=torch.float64)
        flags[f"all2one_root{root}"] = torch.equal(dst, want)
    return flags


def collectives() -> Dict[str, Any]:
    flags = {**all_reduce_checks(), **gather_scatter_checks(), **exchange_checks()}
    rank = bmt.rank()
    x = values(rank, 6).view(2, 3)
    flags["distributed_all_reduce_zero_comm"] = torch.equal(
        bmt.distributed.all_reduce(x, "sum", bmt.config["zero_comm"]), bmt.distributed.all_reduce(x, "sum"))
    flags["distributed_all_gather_tp_comm"] = torch.equal(bmt.distributed.all_gather(x, bmt.config["tp_comm"]), x[None])
    flags["distributed_broadcast_comm"] = torch.equal(bmt.distributed.broadcast(x, 0, bmt.config["comm"]),
                                                      values(0, 6).view(2, 3))
    return everywhere(flags)


def point_to_point() -> Dict[str, Any]:
    """A ring (each rank sends to the next and receives from the previous) inside one group: as blocking
    calls in this order every rank would wait in its send."""
    rank, world, comm = bmt.rank(), bmt.world_size(), bmt.config["comm"]
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    flags = {}
    got = torch.empty(4, dtype=torch.float64)
    nccl.groupStart()
    nccl.send(values(rank, 4).storage(), nxt, comm)
    nccl.recv(got.storage(), prev, comm)
    nccl.groupEnd()
    flags["ring"] = torch.equal(got, values(prev, 4))
    both = torch.zeros(3, 2, dtype=torch.float64)  # a non-contiguous receiver, and nested groups
    nccl.groupStart()
    nccl.groupStart()
    nccl.recv(both.t(), prev, comm)
    nccl.groupEnd()
    nccl.send(values(rank, 6), nxt, comm)
    nccl.groupEnd()
    flags["nested_non_contiguous"] = torch.equal(both.t().reshape(-1), values(prev, 6))
    flags.update(blocking_pair=True, activations=True)  # ranks outside the pairs below have nothing to check
    if rank in (0, 1):  # outside a group: a plain blocking pair
        buffer = values(rank, 3)
        (nccl.send if rank == 0 else nccl.recv)(buffer, 1 - rank, comm)
        flags["blocking_pair"] = torch.equal(buffer, values(0, 3))
    if rank == 0:
        bmt.distributed.send_activations(values(5, 24).view(2, 3, 4).to(torch.bfloat16).transpose(0, 2), 1, comm)
    elif rank == 1:
        hidden = bmt.distributed.recv_activations(0, comm)
        flags["activations"] = torch.equal(hidden, values(5, 24).view(2, 3, 4).to(torch.bfloat16).transpose(0, 2))
    return everywhere(flags)


def objects() -> Dict[str, Any]:
    from bmtwrap.bmtrain.compat import install_bmtrain_alias
    install_bmtrain_alias()
    from bmtrain.store import allgather_object, broadcast_object  # BMTrain's test_store, as it is

    rank, world = bmt.rank(), bmt.world_size()
    reference: List[Any] = [None] * world
    dist.all_gather_object(reference, {"rank": rank, "text": "r" * rank})
    return everywhere({
        "test_store": allgather_object(bmt.rank(), bmt.config["comm"]) == list(range(world)),
        "all_gather_object": bmt.distributed.all_gather_object({"rank": rank, "text": "r" * rank},
                                                                bmt.config["zero_comm"]) == reference,
        "one_rank": allgather_object(("mine", rank), bmt.config["tp_comm"]) == [("mine", rank)],
        "broadcast": broadcast_object({"from": rank}, bmt.config["comm"], src=world - 1) == {"from": world - 1},
    })


def errors() -> Dict[str, Any]:
    rank, world, comm = bmt.rank(), bmt.world_size(), bmt.config["comm"]
    x = torch.ones(4)
    found = {
        "op": raised(lambda: nccl.allReduce(x, x, "mean", comm)),
        "sizes": raised(lambda: nccl.allReduce(torch.ones(4), torch.ones(5), "sum", comm)),
        "gather_sizes": raised(lambda: nccl.allGather(torch.ones(2), torch.ones(2 * world - 1), comm)),
        "scatter_sizes": raised(lambda: nccl.reduceScatter(torch.ones(2 * world - 1), torch.ones(2), "sum", comm)),
        "dtype": raised(lambda: nccl.allReduce(torch.ones(4).storage(), torch.ones(4).half().storage(), "sum", comm)),
        "untyped": raised(lambda: nccl.allReduce(x.untyped_storage(), x.untyped_storage(), "sum", comm)),
        "bytes": raised(lambda: nccl.allReduce(x, torch.empty(6, dtype=torch.uint8).untyped_storage(), "sum", comm)),
        "root": raised(lambda: nccl.broadcast(x, x, world, comm)),
        "peer": raised(lambda: nccl.send(x, rank, comm)),
        "comm": raised(lambda: nccl.allReduce(x, x, "sum", "nccl")),
        "buffer": raised(lambda: nccl.allReduce([1.0], x, "sum", comm)),
        "group_end": raised(nccl.groupEnd),
        "unique_id": raised(nccl.getUniqueId),
        "activations_to_self": raised(lambda: bmt.distributed.send_activations(x, rank, comm)),
    }
    return found



if __name__ == "__main__":
    run({name: on_device(case) for name, case in [("communicators", communicators), ("collectives", collectives),
                                                  ("point_to_point", point_to_point), ("objects", objects),
                                                  ("errors", errors)]})
