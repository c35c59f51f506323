"""BMTrain's communicators and bmt.nccl, on torch.distributed process groups.

The topology's rank layout is checked here without any process group, for several pipeline,
tensor-parallel and world sizes; the communicators and every bmt.nccl call run in one process
group per world size (dist_cases/comm.py), against plain torch.distributed.
"""

from __future__ import annotations

import itertools
import re

import pytest

from bmtwrap.bmtrain.comm import GROUP_KINDS, Topology
from launch import case, run_cases

# (world size, pipe size, tp size): every divisor layout of a few worlds.
LAYOUTS = [(w, p, t) for w in (1, 2, 4, 6, 8, 12) for p in range(1, w + 1) for t in range(1, w + 1) if w % (p * t) == 0]


def members(world: int, pipe: int, tp: int, kind: str):
    """Each rank's group of ``kind`` from BMTrain's definition, written out: the ranks that share every
    coordinate but the group's own ones (a rank is (stage, data-parallel index, tp place))."""
    stage_size = world // pipe

    def coords(r):
        return r // stage_size, (r % stage_size) // tp, r % tp  # (stage, dp index in the stage, tp place)

    varies = {"pipe": {0}, "pp_zero": {1, 2}, "tp": {2}, "tp_zero": {0, 1}, "pp_tp_zero": {1}, "zero": {0, 1, 2}}[kind]
    fixed = [i for i in range(3) if i not in varies]
    return {r: tuple(q for q in range(world) if all(coords(q)[i] == coords(r)[i] for i in fixed)) for r in range(world)}


@pytest.mark.parametrize("world,pipe,tp", LAYOUTS, ids=[f"w{w}-p{p}-t{t}" for w, p, t in LAYOUTS])
def test_topology_groups_follow_bmtrain_layout(world, pipe, tp):
    for kind in GROUP_KINDS:
        expected = members(world, pipe, tp, kind)
        groups = Topology(rank=0, world_size=world, pipe_size=pipe, tp_size=tp).groups(kind)
        assert sorted(itertools.chain(*groups)) == list(range(world)), f"{kind}: {groups} do not partition the ranks"
        for r in range(world):
            topo = Topology(rank=r, world_size=world, pipe_size=pipe, tp_size=tp)
            mine = topo.ranks(kind)
            assert set(mine) == set(expected[r]), f"rank {r}, {kind}: {mine} != {expected[r]}"
            assert mine[topo.get_group_rank(kind)] == r and groups[topo.get_group_id(kind)] == mine


def test_topology_names_bmtrain_reads():
    topo = Topology(rank=5, world_size=8, pipe_size=2, tp_size=2)
    # rank 5: stage 1 (ranks 4-7), place 1 in the stage, tp group (4, 5) at place 1.
    assert (topo.stage_id, topo.pipe_idx, topo.stages) == (1, 1, 2)
    assert (topo.tp_id, topo.tp_idx) == (1, 2)
    assert (topo.tp_zero_id, topo.tp_zero_idx, topo.pp_tp_zero_id, topo.pp_tp_zero_idx) == (2, 1, 0, 3)
    assert (topo.zero_id, topo.zero_idx) == (5, 0)
    assert topo.ranks("pipe") == (1, 5) and topo.ranks("tp") == (4, 5) and topo.ranks("pp_tp_zero") == (5, 7)


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(rank=0, world_size=6, pipe_size=4), r"world size 6 is not divisible by pipe_size \* tp_size = 4 \* 1"),
    (dict(rank=6, world_size=6), r"rank must be from 0 to 5, got 6"),
    (dict(rank=0, world_size=4, tp_size=0), r"tp_size must be a whole number of ranks >= 1, got 0"),
])
def test_topology_refuses_bad_sizes(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        Topology(**kwargs)


def test_topology_refuses_unknown_group():
    with pytest.raises(ValueError, match=r"unknown group kind 'data'; BMTrain's topology has pipe, "):
        Topology(rank=0, world_size=2).get_group_rank("data")


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return request.param, run_cases("comm.py", request.param, timeout=180)


@pytest.mark.parametrize("name", ["communicators", "collectives", "point_to_point", "objects"])
def test_matches_torch_distributed(results, name):
    world, r = case(results, name)
    failed = sorted(k for k, ok in r.items() if ok is not True)
    assert not failed, f"world {world}, {name}: {failed}"
    assert len(r) > 3  # the case ran its checks


# (case, exception type, pattern); "{world}", "{last}" are the world size and the last rank.
ERRORS = [
    ("op", "ValueError", r"allReduce: unknown op 'mean'; use one of 'sum', 'avg', 'max', 'min', 'prod'"),
    ("sizes", "ValueError", r"allReduce: mismatched sizes: src has 4 elements and dst 5; they must be equal"),
    ("gather_sizes", "ValueError", r"allGather: mismatched sizes: .* dst must hold {world} x 2 = "),
    ("scatter_sizes", "ValueError", r"reduceScatter: mismatched sizes: .* src must hold {world} x 2 = "),
    ("dtype", "TypeError", r"src holds torch.float32 and dst holds torch.float16; both buffers must have one dtype"),
    ("untyped", "TypeError", r"both untyped storages, so the dtype to reduce in is unknown; pass tensors or typed"),
    ("bytes", "ValueError", r"dst is an untyped storage of 6 bytes, not a whole number of torch.float32 elements"),
    ("root", "ValueError", r"broadcast: root must be a rank of the communicator, 0 to {last} .* got {world}"),
    ("peer", "ValueError", r"send: peer must be another rank of the communicator"),
    ("comm", "TypeError", r"comm must be a communicator of bmt.config .* got str"),
    ("buffer", "TypeError", r"src must be a tensor or a storage \(tensor.storage\(\)\), got list"),
    ("group_end", "RuntimeError", r"groupEnd\(\) without a groupStart\(\)"),
    ("unique_id", "NotImplementedError", r"getUniqueId is not available: .* torch.distributed.new_group"),
    ("activations_to_self", "ValueError", r"send_activations: next_rank must be another rank of the communicator"),
]


@pytest.mark.parametrize("name,kind,pattern", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_name_the_fix(results, name, kind, pattern):
    world, r = case(results, "errors")
    got_kind, message = r[name]
    assert got_kind == kind, f"world {world}: {name} raised {got_kind}: {message}"
    assert re.search(pattern.format(world=world, last=world - 1), message), message
