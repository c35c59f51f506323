"""Pipeline parallelism (``init_distributed(pipe_size=P)`` and ``PipelineTransformerBlockList``), on gloo.

One process group of 4 ranks (2 stages of 2 ranks, each layer sharded over its stage's 2) runs every case of
dist_cases/pipeline.py: three training steps of a small model in 4 micro-batches against the plain model on the
whole batch in one process, whole-tensor checkpoints, BMTrain's send/receive test, bad input. A world of one
(pipe size 1) trains too and loads the file the 4 ranks wrote; 4 ranks in 2 stages of one tensor-parallel
group each load one it wrote. Sizes in the case file; fp32, so within rounding.
"""

from __future__ import annotations

import pytest

from launch import case, run_cases

CLOSE = 1e-5


@pytest.fixture(scope="module")
def layouts():
    pipe2 = (4, run_cases("pipeline.py", 4, "2", timeout=300))
    pipe1 = (1, run_cases("pipeline.py", 1, "1", result(pipe2, "save_and_load")["written"], "training,save_and_load",
                          timeout=300))
    # Back at pipe 2, now with tensor-parallel groups of 2 (each stage one group): parameters unsharded in it.
    back = (4, run_cases("pipeline.py", 4, "2", result(pipe1, "save_and_load")["written"], "save_and_load,config", "2",
                         timeout=300))
    return pipe2, pipe1, back


def result(results, name):
    """Case ``name``'s result from a ``(world size, run_cases(...))`` pair; fails with its error if it raised."""
    return case(results, name)[1]


def test_config_names_the_stages(layouts):
    found = result(layouts[0], "config")
    assert found == {"pipe_size": 2, "pipe_rank": 0, "stage_id": 0, "micros": 4, "pipe_comm": [0, 2],
                     "zero_comm": [0, 1], "tp_comm": [0], "pp_tp_zero_comm": [0, 1], "zero_rank": 0,
                     "layers": [0, 1], "remote": ["2", "3"], "remote_numel": 0}
    with_tp = result(layouts[2], "config")
    assert with_tp["pipe_comm"] == [0, 2] and with_tp["zero_comm"] == [0, 1] and with_tp["tp_comm"] == [0, 1]
    assert with_tp["pp_tp_zero_comm"] == [0] and with_tp["layers"] == [0, 1]


@pytest.mark.parametrize("layout", [0, 1], ids=["pipe2", "pipe1"])
def test_training_matches_plain_model(layouts, layout):
    found = result(layouts[layout], "training")
    for got, want in (found["losses"], found["norms"]):
        assert len(got) == 3 and max(abs(a - b) / abs(b) for a, b in zip(got, want)) < CLOSE, (got, want)
    assert found["keys"] and found["params"] < CLOSE and found["no_grad"] < CLOSE
    assert found["moved"] > 100 * CLOSE  # the parameters did change
    names, worst = found["inspected"]
    assert len(names) == 20 and worst < CLOSE  # 4 layers of 5 parameters, each seen on rank 0


def test_checkpoints_load_at_either_layout(layouts):
    pipe2, pipe1, back = layouts
    for found in (result(pipe2, "save_and_load"), result(pipe1, "save_and_load")):
        assert found["own"] == [True, 0.0] and found["own_state_dict"] == [True, 0.0]
        assert found["own_load_state_dict"] == 0.0
    assert result(pipe1, "save_and_load")["other"] == [True, 0.0]  # written at pipe 2, loaded at pipe 1
    assert result(back, "save_and_load")["other"] == [True, 0.0]  # written at pipe 1, loaded at pipe 2 x tp 2
    assert result(back, "save_and_load")["other_state_dict"] == [True, 0.0]


def test_every_stage_draws_the_initial_values_of_one_process(layouts):
    assert result(layouts[0], "training")["init"] == result(layouts[1], "training")["init"]


def test_blocks_outside_a_pipeline_start_as_one_process(layouts):
    assert result(layouts[0], "init_parameters") == {"block_list": [True, 0.0], "checkpoint_blocks": [True, 0.0]}


def test_stage_groups_are_bmtrains_layout():
    from bmtwrap.bmtrain.comm import Topology
    from bmtwrap.engine.stages import stage_groups

    for world, pipe, tp in ((4, 2, 1), (8, 2, 2), (8, 4, 1), (8, 2, 4)):
        groups, topology = stage_groups(world, pipe, tp), Topology(rank=0, world_size=world, pipe_size=pipe, tp_size=tp)
        assert groups["shard"] == sorted(map(list, topology.groups("pp_tp_zero")))
        assert groups["replica"] == list(map(list, topology.groups("pipe")))
        assert groups["tp"] == list(map(list, topology.groups("tp")))


def test_send_and_receive_along_the_pipe_group(layouts):
    assert result(layouts[0], "send_recv") == {"received": [None, None, 0.0, 0.0]}  # stage 0 sent, stage 1 received


def test_inspecting_records_inside_and_outside_the_pipelined_layers(layouts):
    found = result(layouts[0], "inspector")
    assert found["outside"] == ["after"]
    assert found["names"] == ["inside"] * 4 and found["summary_names"] == [f"{i}.inside" for i in range(4)]
    for what in ("values", "record_grads", "grad_stats", "input_grad", "param_grads"):
        assert found[what] < CLOSE, (what, found[what])
    assert found["refused"][0] == "NotImplementedError" and "'total' of shape () does not lead with the " \
        "micro-batch's" in found["refused"][1] and "record outside the pipelined layers, or inspect with " \
        "pipe_size=1" in found["refused"][1]


def test_bad_input_names_the_fix(layouts):
    errors = result(layouts[0], "errors")
    assert errors["few_layers"] == [
        "ValueError", "PipelineTransformerBlockList: 1 layer(s) cannot be cut into pipe_size=2 stages of one layer at "
                      "least; give at least 2 layers, or call init_distributed with a smaller pipe_size"]
    assert errors["micro_batches"][0] == "ValueError" and "the pipeline's 2 x 1 rows do not split into " \
        "num_micro_batches=4 micro-batches" in errors["micro_batches"][1]
    assert errors["hidden_states"][0] == "NotImplementedError" and "takes neither return_hidden_states" in \
        errors["hidden_states"][1]
    assert errors["sharded"][0] == "NotImplementedError" and "init_distributed(pipe_size=2) are not supported: save " \
        "the model with bmt.save" in errors["sharded"][1]
    assert errors["wrap"] == ["none", ""]  # wrap() shards over the stage and replicates over the pipeline
