"""test_wrap_dist.py's cases under hybrid sharding, world 4 in shard groups of 2: generate() with ranks stopping
at different lengths, models built on meta, offloaded parameters, and the plan's exact bytes. The test functions
are test_wrap_dist.py's; the fixture runs its case script in the hybrid layout."""

import pytest

from launch import run_cases
from test_wrap_dist import (test_generate_with_ranks_stopping_at_different_lengths,  # noqa: F401
                            test_meta_model_then_load, test_meta_model_then_materialize, test_plan_bytes_are_exact,
                            test_offloaded_parameters_train_like_the_unwrapped_model)


@pytest.fixture(scope="module", params=[2], ids=lambda s: f"world4-shard{s}")
def results(request):
    return 4, run_cases("wrap_dist.py", 4, env={"BMTWRAP_SHARD_SIZE": str(request.param)})
