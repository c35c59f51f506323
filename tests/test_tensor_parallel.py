"""Tensor parallelism (``init_distributed(tp_size=T)`` and ``bmt.nn``'s parallel layers), on gloo.

One process group of 4 ranks (tensor-parallel groups of 2, each parameter sharded over 2) runs
every case of dist_cases/tensor_parallel.py: each layer against its plain torch counterpart of the
whole weight, three training steps of a small model against the plain model on the whole batch in
one process, and whole-tensor checkpoints. A world of one (tensor-parallel size 1) loads the file the
4 ranks wrote, and they load one it wrote. Sizes in the case file; fp32, so within rounding.
"""

from __future__ import annotations

import pytest

from launch import case, run_cases

CLOSE = 1e-5


@pytest.fixture(scope="module")
def layouts():
    tp2 = (4, run_cases("tensor_parallel.py", 4, "2", timeout=300))
    tp1 = (1, run_cases("tensor_parallel.py", 1, "1", result(tp2, "save_and_load")["written"], timeout=300))
    back = (4, run_cases("tensor_parallel.py", 4, "2", result(tp1, "save_and_load")["written"], "save_and_load",
                         timeout=300))
    return tp2, tp1, back


def result(results, name):
    """Case ``name``'s result from a ``(world size, run_cases(...))`` pair; fails with its error if it raised."""
    return case(results, name)[1]


def test_config_names_the_tensor_parallel_groups(layouts):
    tp2, tp1, _ = layouts
    assert result(tp2, "config") == {"tp_size": 2, "tp_rank": 0, "tp_comm": [0, 1], "tp_zero_comm": [0, 2],
                                   "zero_comm": [0, 1, 2, 3], "tp_zero_size": 2, "zero_size": 4}
    assert result(tp1, "config")["tp_comm"] == [0] and result(tp1, "config")["tp_size"] == 1


@pytest.mark.parametrize("name", ["column", "row", "embedding_and_loss"])
@pytest.mark.parametrize("layout", [0, 1], ids=["tp2", "tp1"])
def test_layer_matches_plain_torch(layouts, name, layout):
    found = result(layouts[layout], name)
    assert found and all(len(v) >= 1 for v in found.values())
    worst = {option: max(values) for option, values in found.items()}
    assert all(v < CLOSE for v in worst.values()), worst


@pytest.mark.parametrize("layout", [0, 1], ids=["tp2", "tp1"])
def test_training_matches_plain_model(layouts, layout):
    found = result(layouts[layout], "training")
    for got, want in (found["losses"], found["norms"]):
        assert len(got) == 3 and max(abs(a - b) / abs(b) for a, b in zip(got, want)) < CLOSE, (got, want)
    assert found["keys"] and found["shapes"] == [] and found["params"] < CLOSE
    assert found["moved"] > 100 * CLOSE  # the parameters did change


def test_checkpoints_load_at_either_layout(layouts):
    tp2, tp1, back = layouts
    for found in (result(tp2, "save_and_load"), result(tp1, "save_and_load")):
        assert found["own"] == [True, 0.0] and found["own_state_dict"] == 0.0
    assert result(tp1, "save_and_load")["other"] == [True, 0.0]  # written at tp 2, loaded at tp 1
    assert result(back, "save_and_load")["other"] == [True, 0.0]  # written at tp 1, loaded at tp 2
    assert result(back, "save_and_load")["other_state_dict"] == 0.0


def test_bad_sizes_name_the_fix(layouts):
    errors = result(layouts[0], "save_and_load")["errors"]
    assert errors["tp_split_dim"][0] == "ValueError" and "tp_split_dim=1 is not a dimension" in errors["tp_split_dim"][1]
    assert errors["vocab"] == ["ValueError", "VPEmbedding: vocab_size=17 does not divide among tp_size=2 ranks; "
                                             "give a multiple of 2"]
    assert errors["wrap"][0] == "ValueError" and "splits a model by its Hugging Face tensor-parallel plan" in errors["wrap"][1]
    assert errors["sharded"][0] == "NotImplementedError" and "tp_size=2) are not supported: save the model with " \
        "bmt.save" in errors["sharded"][1]
