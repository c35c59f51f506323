"""bmt.init_parameters is bit-identical to initialising the full tensors in one process, at world sizes 1-4.

One torchrun per world size runs every case of tests/dist_cases/init_params.py (see its docstring
for the model and the hand-written reference). Each parameter is compared twice: gathered with
bmt.full_state_dict, and as each rank's own piece against its slice of the reference.
"""

import pytest

from launch import run_cases

WORLD_SIZES = [1, 2, 3, 4]
CASES = ["seed_0", "seed_1234_zero2", "reinit_7_after_99"]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def results(request):
    return request.param, run_cases("init_params.py", request.param)


@pytest.mark.parametrize("case", CASES)
def test_init_parameters_bit_identical(results, case):
    world, all_results = results
    result = all_results[case]
    assert "error" not in result, result.get("error")
    assert result["keys"] == result["ref_keys"], f"world {world}: state dict keys differ from the reference"
    wrong = {k: v for k, v in result["params"].items() if not v["equal"]}
    assert not wrong, f"world {world}: not bit-identical: {wrong}"
    wrong_local = sorted(k for k, v in result["params"].items() if not v["local_equal"])
    assert not wrong_local, f"world {world}: a rank's own piece differs from the reference for {wrong_local}"


def test_reference_is_not_trivial(results):
    # Guards the test itself: every drawn tensor holds non-zero values, so equality means something.
    _, all_results = results
    params = all_results["seed_0"]["params"]
    assert "error" not in all_results["seed_0"]
    assert all(v["drawn_nonzero"] for v in params.values()), [k for k, v in params.items() if not v["drawn_nonzero"]]
    assert params["scalar"]["shape"] == [] and params["empty"]["shape"] == [0, 5]
    assert params["fp16"]["dtype"] == "torch.float16" and params["layers.0.h"]["dtype"] == "torch.bfloat16"
