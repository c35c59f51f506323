"""Module trees beyond the zoo, and non-finite gradients, at world sizes 1 to 3 (gloo, CPU).

Trees: a container only iterated (a ModuleList of ModuleLists), a layer's sub-module called and a
layer's weight read outside the layer, a layer reading another layer's weight. Each trains with SGD
against the unwrapped model on the whole batch (fp32 rounding only: 1e-5), and every gathered group
is released after backward and after a forward without autograd.

Non-finite: a loss that is inf on the last rank only. Every rank must raise (or skip) together, and
no parameter may change.
"""

import pytest

from launch import case, run_cases

WORLD_SIZES = [1, 2, 3]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def results(request):
    return request.param, run_cases("robustness.py", request.param)


@pytest.mark.parametrize("name,blocks", [("nested_lists", ["Mlp"] * 6), ("used_outside", ["Mlp"] * 3),
                                         ("cross_block", ["Layer"] * 3)])
def test_module_trees_train_like_the_unwrapped_model(results, name, blocks):
    world, r = case(results, name)
    assert r["blocks"] == blocks, "blocks must be the modules that are called, never a container"
    assert r["loss_max_rel"] <= 1e-5 and r["grad_max_abs"] <= 1e-5, f"world {world}: {r}"
    assert r["keys_match"] and r["param_max_abs"] <= 1e-5, f"world {world}: {r['param_worst']} {r['param_max_abs']}"
    assert r["released"] and r["released_no_grad"] and r["no_grad_equal"], r


@pytest.mark.parametrize("kind", ["adam", "offload", "manager"])
def test_nonfinite_gradient_raises_on_every_rank(results, kind):
    world, r = case(results, "nonfinite")
    raised = r[f"{kind}_raise"]
    assert raised["outcome"].startswith("raised: ") and "inf or NaN" in raised["outcome"], f"world {world}: {raised}"
    assert "nonfinite='skip'" in raised["outcome"]
    assert raised["unchanged"] and raised["finite"]
    skipped = r[f"{kind}_skip"]
    assert skipped["unchanged"] and skipped["finite"], f"world {world}: {skipped}"
    assert skipped["outcome"] == ("stepped: False" if kind == "manager" else "stepped: None")
    if kind != "manager":
        assert skipped["skipped"] == 1
    finite = r[f"{kind}_finite"]
    assert not finite["unchanged"] and finite["finite"], "a finite step must still update the parameters"


def test_nonfinite_names_the_parameters(results):
    world, r = case(results, "nonfinite")
    # Gradients are averaged over ranks, so the inf reaches every rank's pieces: each names its own.
    outcome = r["adam_raise"]["outcome"]
    assert "'0.up.weight'" in outcome, outcome


def test_the_check_reads_each_blocks_flat_gradient_once(results):
    """One check per block's flat gradient, not one per parameter; the check of some parameters reads none of the
    others' gradients; a gradient the user replaced is checked on its own; a NaN on one rank is found on all."""
    world, r = case(results, "one_check_per_block")
    assert r["clean"]["found"] is False and r["clean"]["checks"] == 3, f"world {world}: {r}"
    assert world == 3 or r["grads"] > 3, r  # at three ranks, rank 0 holds a piece of one parameter per block
    assert r["nan"]["found"] is True and r["nan"]["checks"] == 3, f"world {world}: {r}"
    assert r["first_block"]["found"] is False and r["first_block"]["checks"] == 1, f"world {world}: {r}"
    # The replaced gradient's block is checked view by view: more checks wherever it held more than one view.
    assert r["replaced"]["found"] is True and r["replaced"]["checks"] >= 3, f"world {world}: {r}"
    assert world == 3 or r["replaced"]["checks"] > 3, f"world {world}: {r}"


def test_offload_in_backward_reports_damaged_weights(results):
    _, r = case(results, "offload_in_backward_nonfinite")
    assert r["outcome"].startswith("raised: ") and "reload the last checkpoint" in r["outcome"], r


def test_a_container_is_never_a_block():
    import torch
    from torch import nn

    import bmtwrap as bmt

    model = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]), nn.ModuleList([nn.Linear(2, 2)]))
    with pytest.raises(ValueError, match=r"layers chose '0' \(ModuleList\), which has no forward of its own"):
        bmt.plan(model, layers=[nn.ModuleList])
    with pytest.raises(ValueError, match=r"which has no forward of its own: a block must be a module that is called"):
        bmt.plan(model, layers=lambda name, module: name == "1")
    names = [b.name for b in bmt.plan(model).blocks]
    assert names and all(name.count(".") == 1 for name in names), names  # the Linears, not the lists
    del torch


def test_nonfinite_option_errors():
    import torch

    import bmtwrap as bmt

    param = torch.nn.Parameter(torch.zeros(3))
    for make in (lambda: bmt.optim.AdamOptimizer([param], nonfinite="ignore"),
                 lambda: bmt.optim.OptimManager(nonfinite="ignore")):
        with pytest.raises(ValueError, match=r"nonfinite must be one of 'raise', 'skip', 'unchecked', got 'ignore'"):
            make()
    bmt.init_distributed()
    with pytest.raises(ValueError, match=r"cannot skip a step; use step_in_backward=False with nonfinite='skip'"):
        bmt.optim.AdamOffloadOptimizer([param], step_in_backward=True, nonfinite="skip")
