"""Sharded checkpoints across hybrid layouts (tests/dist_cases/checkpoint_sharded.py, its two GPT setups).

World 4 in shard groups of 2 saves (each tensor written by one replica: its pieces tile it exactly once, and
the index records the shard size); then loads at world 4 with shard groups of 4 (which also saves again) and of 1,
at world 2 with groups of 1, and at world 1: every value bit-equal to what was saved, the next steps within
fp32 rounding of the uninterrupted run. World 4 in groups of 2 resumes bit-exactly, and loads the checkpoint
saved in groups of 4 exactly."""

from pathlib import Path

import pytest

from launch import run_cases
from test_checkpoint_sharded import EXACT, _ok

SCRIPT = "checkpoint_sharded.py"
SETUPS = ["gpt_manager", "gpt_adamw"]
LOADS = [(4, 4), (4, 1), (2, 1), (1, 1)]  # (world, shard size)


def _shards(size: int) -> dict:
    return {"BMTWRAP_SHARD_SIZE": str(size)}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hybrid")


@pytest.fixture(scope="module")
def saved(work):
    return run_cases(SCRIPT, 4, "save", str(work), env=_shards(2))


@pytest.fixture(scope="module")
def loaded(work, saved):
    return {(world, shards): run_cases(SCRIPT, world, "load", str(work), *(["and-save"] if shards == 4 else []),
                                       env=_shards(shards)) for world, shards in LOADS}


@pytest.fixture(scope="module")
def resumed(work, loaded):
    return run_cases(SCRIPT, 4, "resume-only", str(work), env=_shards(2))


@pytest.mark.parametrize("setup", SETUPS)
def test_hybrid_save_writes_each_piece_once(saved, setup):
    r = _ok(saved[f"{setup}/save"])
    assert r["unperturbed"] and r["world_size"] == 4 and r["shard_size"] == 2 and r["files"] == 4
    assert r["pieces_tile"], "a tensor's pieces overlap or leave a gap"
    assert r["sharded_pieces"] == 2, "each tensor in two pieces, written by one replica's two ranks"


@pytest.mark.parametrize("world,shards", LOADS, ids=[f"world{w}-shard{s}" for w, s in LOADS])
def test_load_in_another_layout_is_exact_and_trains_on(loaded, world, shards):
    for setup in SETUPS:
        r = _ok(loaded[(world, shards)][f"{setup}/load"])
        failed = [key for key in EXACT if not r[key]]
        assert not failed, f"world {world}, shards {shards}, {setup}: {failed} {r['bad_params']} {r['bad_state']}"
        worst = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], r["expected_losses"]))
        assert worst <= 1e-5 and r["final_max_abs"] <= 1e-5, f"world {world}, shards {shards}, {setup}: {worst}"


@pytest.mark.parametrize("setup", SETUPS)
def test_resume_in_the_same_layout_is_bit_exact(resumed, setup):
    r = _ok(resumed[f"{setup}/resume"])
    assert not [key for key in EXACT if not r[key]], r
    assert r["losses"] == r["expected_losses"] and r["final_equal"]


def test_a_save_in_groups_of_four_loads_in_groups_of_two(resumed):
    r = _ok(resumed["load_saved_elsewhere"])
    assert not [key for key in EXACT if not r[key]], r
