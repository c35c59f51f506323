"""Updates started in backward and checked at the step (``step_in_backward="speculative"``, the default on a GPU)
give the same training, bit for bit, as updates started at the step, in every case a fine-tune uses.

``tests/dist_cases/speculative.py`` trains each case twice at world size 3 over gloo, in bf16, and reports the
losses, the final parameters and which updates started in backward were kept, redone or undone; each case here
checks both that the results are equal and that the path it is named for was taken.
"""

import pytest
import torch

from launch import run_cases


@pytest.fixture(scope="module")
def results():
    return run_cases("speculative.py", 3)


def _case(results, name):
    result = results[name]
    assert "error" not in result, result.get("error")
    assert result["losses_equal"], f"{name}: losses differ: {result['losses']}"
    assert result["params_equal"], f"{name}: final parameters differ"
    assert result["finite"], f"{name}: non-finite parameters"
    return result["speculation"]


# case: (kept, redone, undone), each "+" (at least one) or 0
PATHS = {
    "plain": ("+", 0, 0),
    "wrapped_plain": ("+", 0, 0),
    "clipped": (0, "+", 0),
    "clip_not_reached": ("+", 0, 0),
    "clipped_as_the_trainer_clips": (0, "+", 0),
    "trainer_clip_not_reached": ("+", 0, 0),
    "accumulate_2_clipped": (0, "+", 0),
    "accumulate_2": ("+", 0, 0),
    "accumulation_changes": ("+", 0, "+"),
    "wrapped_accumulation_changes": ("+", 0, "+"),
    "lr_moves_before_step": (0, "+", 0),
    "loss_scale": (0, "+", 0),
    "nonfinite_skipped": ("+", 0, "+"),
    "zero_grad_without_step": ("+", 0, "+"),
    "evaluation_before_step": (0, 0, "+"),
    "closure": (0, 0, 0),
    "offload_params": ("+", 0, 0),
    "small_chunks": ("+", 0, 0),
}


@pytest.mark.parametrize("name", sorted(PATHS))
def test_same_training_and_the_path_taken(results, name):
    _check_paths(name, _case(results, name))


def _check_paths(name, speculation):
    for what, expected in zip(("kept", "redone", "undone"), PATHS[name]):
        got = speculation[what]
        assert (got > 0) if expected == "+" else (got == 0), f"{name}: {what} = {got}, expected {expected}"


HYBRID = ["plain", "clipped", "accumulation_changes", "nonfinite_skipped"]


def test_the_same_under_hybrid_sharding():
    """Shards over groups of 2 of 4 ranks, replicated across the groups: each replica updates the same shards, and
    every rank keeps or redoes the same updates."""
    results = run_cases("speculative.py", 4, "cpu", ",".join(HYBRID), env={"BMTWRAP_SHARD_SIZE": "2"})
    for name in HYBRID:
        _check_paths(name, _case(results, name))


def test_a_skipped_step_is_skipped_by_both(results):
    _case(results, "nonfinite_skipped")
    assert results["nonfinite_skipped"]["skipped"] == [1, 1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_same_on_a_gpu():
    """On a GPU the gradients go to the host on a side stream and the new parameters come back through the offload
    queue's copies: the same training as updates started at the step, bit for bit, on the same paths."""
    results = run_cases("speculative.py", 1, "cuda")
    for name in PATHS:
        _check_paths(name, _case(results, name))
