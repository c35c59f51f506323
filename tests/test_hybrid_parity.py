"""test_parity.py's and test_wrap_dist.py's cases under hybrid sharding: world 4 in shard groups of 2 (two
replicas) and of 1 (data parallelism), with their tolerances. The test functions are theirs; the fixtures here
run the case scripts in the hybrid layouts."""

import pytest

from launch import run_cases
from test_parity import (test_float64_is_exact, test_inference_without_grad,  # noqa: F401
                         test_offload_steps_in_backward, test_optimizer_state_resumes_bit_exactly,
                         test_return_hidden_states, test_split_masters_resume_bit_exactly,
                         test_split_masters_train_as_whole_ones, test_training_matches_unwrapped)


@pytest.fixture(scope="module", params=[2, 1], ids=lambda s: f"world4-shard{s}")
def results(request):
    return 4, run_cases("parity.py", 4, env={"BMTWRAP_SHARD_SIZE": str(request.param)})
