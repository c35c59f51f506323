"""wrap() over gloo at world sizes 2 and 3: generate() in step across ranks; models built on meta."""

import math

import pytest

from launch import run_cases


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return request.param, run_cases("wrap_dist.py", request.param)


def _case(results, name):
    world, all_results = results
    result = all_results[name]
    assert "error" not in result, result.get("error")
    return world, result


@pytest.mark.parametrize("name", ["generate", "generate_offloaded"])
def test_generate_with_ranks_stopping_at_different_lengths(results, name):
    world, r = _case(results, name)
    assert r["all_equal"], f"world {world}: generated tokens differ from the unwrapped model's"
    assert r["lengths"][0] < max(r["lengths"]), f"rank 0 should stop first: {r['lengths']}"


def test_meta_model_then_load(results):
    world, r = _case(results, "meta_then_load")
    assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-5, r
    assert r["inv_freq_equal"], "rotary inv_freq was not restored"


def test_meta_model_then_materialize(results):
    world, r = _case(results, "meta_then_materialize")
    assert r["ranks_agree"], "ranks initialised different values"
    assert r["norm_is_one"] and r["inv_freq_equal"]
    assert abs(r["linear_std"] - 0.02) < 0.004, r["linear_std"]  # LlamaConfig.initializer_range
    assert math.isfinite(r["loss"])


def test_offloaded_parameters_train_like_the_unwrapped_model(results):
    """Shards in host memory, built on meta and loaded, trained with the offload optimizer in backward
    (on the CPU this runs the gather-in-place and gradient-copy paths; the GPU tests time them)."""
    world, r = _case(results, "offload_params_training")
    assert r["block_params_on_cpu"] and r["root_params_on_device"]
    assert r["loss_max_rel"] <= 1e-5 and r["param_max_abs"] <= 1e-5, f"world {world}: {r}"


def test_plan_bytes_are_exact(results):
    """Parameters, gradients and Adam state as planned, to the byte, at the rank holding the most."""
    world, r = _case(results, "plan_is_exact")
    for name, figures in r.items():
        assert figures["actual"] == figures["planned"], f"world {world}, {name}: (params, grads, optimizer) {figures}"
    assert r["offload_fp32"]["state_on_gpu"] == 0, "the offload optimizer's state was planned on the GPU"


def test_fp8_trains_like_the_unwrapped_float8_model_and_saves_its_master_weights(results):
    """wrap(fp8=...) with torchao's emulated float8: the blocks' linears (not the head) compute in float8, the
    sharded model trains as the unwrapped one converted alike, and its checkpoint holds the fp32 master weights."""
    world, r = _case(results, "fp8_training")
    assert r["converted"] == r["block_linears"] and r["converted"], r["converted"]
    assert r["loss_max_rel"] <= 1e-5 and r["param_max_abs"] <= 1e-5, f"world {world}: {r}"
    assert r["keys_match"] and r["saved_keys_match"] and r["saved_dtypes"] == ["torch.float32"], r
    assert r["reload_equal"], "loading the saved file into another fp8-wrapped model changed values"
    assert r["plan"] == "config: 21 of the blocks' 21 linear layers in float8", r["plan"]
