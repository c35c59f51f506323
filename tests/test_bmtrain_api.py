"""BMTrain's semantics on bmtwrap at world sizes 1 to 3 (gloo, CPU): one process group per world size
runs every case of ``dist_cases/bmtrain_api.py``.

Tolerances are fp32 rounding: averaging gradients over ranks rounds differently from one process
summing the whole batch (see test_parity.py); a missed, doubled or stale gradient moves parameters
by about the learning rate (1e-3) and fails.
"""

import pytest

from launch import case, run_cases

WORLD_SIZES = [1, 2, 3]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def results(request):
    return request.param, run_cases("bmtrain_api.py", request.param)


FULL = {"keys": True, "shapes": True, "cpu": True, "equal": True, "same_on_ranks": True}


def test_state_dict_is_full_shaped_on_every_rank(results):
    world, r = case(results, "state_dict_shapes")
    assert r["model"] == FULL and r["block"] == FULL and r["list"] == FULL, f"world {world}: {r}"
    assert r["keep_vars_gives_shards"], "state_dict(keep_vars=True) must give the sharded parameters themselves"
    assert r["torch_save_loads"], "torch.save(model.state_dict()) must load into the unwrapped model"
    assert r["load_full"]


def test_wrapped_model_state_dict_is_full_shaped(results):
    world, r = case(results, "wrapped_state_dict")
    layer = r.pop("layer")
    assert r == FULL and layer == FULL, f"world {world}: {r} {layer}"


def test_state_dict_gathers_one_buffer_at_a_time(results):
    world, r = case(results, "state_dict_memory")
    assert r["max_gathered"] == 1 and r["gathers"] == r["buffers"] and r["all_released"], f"world {world}: {r}"


@pytest.mark.parametrize("name", ["nested_wrap", "adopted_blocks"])
def test_wrapping_inside_blocks_trains_like_the_unwrapped_model(results, name):
    world, r = case(results, name)
    assert r["keys_match"]
    assert r["loss_max_rel"] <= 1e-6, f"world {world}: loss differs by {r['loss_max_rel']:.3g}"
    assert r["param_max_abs"] <= 1e-5, f"world {world}: {r['param_worst']} differs by {r['param_max_abs']:.3g}"
    if name == "nested_wrap":
        assert r["block_owns_inner"] and r["dissolved"] and r["root_kept"], r
    else:
        assert r["runners_shared"], "the block list must run wrap's blocks, not shard them again"
        assert all(r["checkpoint_block_checks"].values()), r["checkpoint_block_checks"]  # BMTrain's isinstance


def test_requires_grad_changed_after_sharding(results):
    world, r = case(results, "frozen_then_trained")
    assert r["frozen_has_no_grad"], "a parameter frozen after sharding must keep .grad None"
    assert r["unfrozen_grad_max_abs"] <= 1e-6, f"world {world}: {r}"


def test_bmt_nn_linear(results):
    world, r = case(results, "bmt_nn_linear")
    assert r["zeros_before_init"] and r["init_equal"] and r["bias_zero"] and r["op_linear_grad_w"], r
    for key in ("forward_max_abs", "grad_x_max_abs", "grad_w_max_abs", "grad_b_max_abs"):
        assert r[key] <= 1e-6, f"world {world}: {key} = {r[key]}"
    assert r["repr"] == "Linear(in_features=6, out_features=5, bias=True)"


def test_block_parameters_are_the_inner_modules(results):
    world, r = case(results, "block_is_a_view")
    state = r.pop("state")
    grad = r.pop("grad_max_abs")
    assert all(r.values()), f"world {world}: {r}"
    assert state == FULL, f"world {world}: {state}"
    assert grad <= 1e-5, f"world {world}: gradients differ by {grad:.3g}"


def test_inspect_model_matches_the_unwrapped_model(results):
    world, r = case(results, "inspect_stats")
    assert r["names"] == r["ref_names"]
    assert r["no_grad_zero"], "parameters without a gradient show 0.0, as in BMTrain"
    assert r["worst_rel"] <= 1e-5, f"world {world}: statistics differ by {r['worst_rel']:.3g} (relative)"
    assert r["same_on_ranks"] and r["summary_empty"] and r["table_rows"] == 1 + len(r["names"])


def test_record_tensor_summarises_every_rank(results):
    world, r = case(results, "record_tensor_summary")
    assert r["names"] == ["hidden"] and r["shape"] == [6, 4], r
    assert max(r["max_err"], r["min_err"], r["mean_err"]) <= 1e-6 and r["grad_mean"] == 1.0, f"world {world}: {r}"


def test_inspector_summary_holds_the_recorded_tensors(results):
    world, r = case(results, "record_tensor_summary")
    share = 6 // world
    assert r["empty_inside"], "inspector.summary is filled when the `with` ends, as in BMTrain"
    assert r["records"] == [["hidden", "0.hidden", None, [share, 4], True], ["hidden", "1.hidden", None, [share, 4], True]]
    assert r["tensor_grad_err"] <= 1e-5, f"world {world}: a loss of summary tensors gives wrong gradients: {r}"


def test_helpers(results):
    world, r = case(results, "helpers")
    assert r["gather_equal"] and r["gather_cpu"] and r["slice_equal"], r
    assert r["scalar"] == [float(rank) for rank in range(world)]
    assert r["debug_ok"] and r["groups"]
    assert r["average"] == pytest.approx(r["average_expected"])


def test_zero_context(results):
    _, r = case(results, "zero_context")
    assert r == {"inside": True, "after": True, "released": True, "alias": True}


def test_optim_manager_options(results):
    world, r = case(results, "manager_options")
    assert r["grad_scale_half"] <= 1e-6, f"world {world}: grad_scale is not applied: {r}"
    assert r["scaled_by_hand"] <= 1e-6, f"world {world}: a loss scaled by hand is not unscaled: {r}"
    assert r["hold_steps_moved"] == [False, False, True] and r["hold_left"] == 0
    assert "gather_opt=True) is not supported" in r["gather_opt"]


def test_load_returns_missing_and_unexpected_keys(results):
    _, r = case(results, "save_load_returns_keys")
    assert r == {"strict": [[], []], "loose": [["up.bias"], ["extra"]]}
