"""bmt.distributed: BMTrain's autograd-aware collectives at world sizes 1 to 3 (gloo, CPU).

One torchrun launch per world size runs every case of dist_cases/distributed_ops.py. Inputs are
float64 multiples of 0.25, so forward values and gradients must match the formulas exactly.
"""

from __future__ import annotations

import re

import pytest
import torch

import bmtwrap.engine.dist
from bmtwrap import distributed as D
from launch import run_cases

WORLD_SIZES = [1, 2, 3]
LAYOUTS = ["contiguous", "transposed"]
COLLECTIVES = (["all_gather", "broadcast"] + [f"all_reduce-{op}" for op in ("sum", "avg", "max", "min", "prod")]
               + [f"reduce_scatter-{op}" for op in ("sum", "avg")])


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def results(request):
    return request.param, run_cases("distributed_ops.py", request.param, timeout=120)


def _case(results, name):
    """(world size, the case's result), failing with the case's traceback if it raised."""
    world, found = results
    assert "error" not in found[name], found[name].get("error")
    return world, found[name]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_forward_and_backward_match_the_formulas(results, collective, layout):
    world, r = _case(results, f"{collective}-{layout}")
    assert r["fwd"] == 0.0, f"world {world}: {collective} output is off by {r['fwd']}"
    assert r["grad"] == 0.0, f"world {world}: {collective} gradient is off by {r['grad']}"
    assert r["contiguous_input"] == (layout == "contiguous")
    assert r["x_untouched"] and r["new_tensor"], f"world {world}: {collective} wrote into its input: {r}"


def test_integer_tensors(results):
    world, r = _case(results, "integers")
    assert r["sum"] and r["max"] and r["gather"], f"world {world}: {r}"
    assert r["avg"] and r["dtype"] == "torch.int64", f"world {world}: avg of int64 is not truncated: {r}"


def test_process_group_as_comm(results):
    world, r = _case(results, "subgroup")
    assert r["members"] == min(world, 2)
    for key in ("gather", "gather_grad", "sum", "bcast", "bcast_grad"):
        assert r[key] == 0.0, f"world {world}: {key} off by {r[key]}"
    if world > 1:
        kind, message = r["non_member"]
        assert kind == "ValueError" and "not a member of the group passed as comm" in message, message


# (case, exception type, pattern the message must match); "{world}" is replaced by the world size.
ERRORS = [
    ("all_reduce_op", "ValueError", r"op must be one of 'sum', 'avg', 'max', 'min', 'prod', got 'mean'"),
    ("reduce_scatter_op", "ValueError", r"op must be one of 'sum', 'avg', got 'max'"),
    ("scalar", "ValueError", r"divisible by the world size {world}, got shape \(\)"),
    ("comm_str", "TypeError", r"comm must be a communicator of bmt.config .*ProcessGroup or None .* got str"),
    ("comm_object", "TypeError", r"comm must be a communicator of bmt.config .* got object"),
    ("root", "ValueError", r"root must be a rank from 0 to {last}, got {world}"),
    ("not_tensor", "TypeError", r"x must be a torch.Tensor, got list"),
    ("send", "ValueError", r"send_activations: next_rank must be another rank of the communicator .* got {world}"),
    ("recv", "ValueError", r"recv_activations: prev_rank must be another rank of the communicator .* got -1"),
    ("double_backward", "RuntimeError", r"differentiate twice"),
]


@pytest.mark.parametrize("case,kind,pattern", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_name_the_fix(results, case, kind, pattern):
    world, r = _case(results, "errors")
    got_kind, message = r[case]
    assert got_kind == kind, f"world {world}: {case} raised {got_kind}: {message}"
    assert re.search(pattern.format(world=world, last=world - 1), message), message


def test_first_dimension_must_divide_by_world_size(results):
    world, r = _case(results, "errors")
    if world == 1:
        pytest.skip("every first size divides by 1")
    kind, message = r["dim0"]
    assert kind == "ValueError"
    assert f"divisible by the world size {world}, got shape ({world + 1}, 2)" in message


BEFORE_INIT = {"all_gather": lambda x: D.all_gather(x), "all_reduce": lambda x: D.all_reduce(x),
               "reduce_scatter": lambda x: D.reduce_scatter(x), "broadcast": lambda x: D.broadcast(x, 0)}


@pytest.mark.parametrize("name", BEFORE_INIT)
def test_before_init_distributed(monkeypatch, name):
    monkeypatch.setattr(bmtwrap.engine.dist, "_CONTEXT", None)  # bmtwrap as it is before init_distributed()
    with pytest.raises(RuntimeError, match=r"call bmtwrap.init_distributed\(\)"):
        BEFORE_INIT[name](torch.ones(2))
