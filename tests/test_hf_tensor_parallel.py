"""``wrap(model, tp_size=2)`` of a tiny Hugging Face Llama (GQA), on gloo, against the model unwrapped.

Three jobs of dist_cases/hf_tensor_parallel.py: world 4 (tensor-parallel groups of 2, each parameter
sharded over 2; there wrap sets up the process group itself), a world of one that loads the checkpoints
the 4 ranks wrote, and world 2 (tensor parallelism alone) that loads the ones the world of one wrote.
A Llama with biases and GQA, and a Qwen3 (per-head norms, tied embedding). fp32 on the CPU, so within
rounding.
"""

from __future__ import annotations

import pytest

from launch import case, run_cases

CLOSE = 1e-5


@pytest.fixture(scope="module")
def layouts():
    tp2_zero2 = (4, run_cases("hf_tensor_parallel.py", 4, "2", timeout=300))
    world1 = (1, run_cases("hf_tensor_parallel.py", 1, "1", result(tp2_zero2, "checkpoints")["written"], timeout=300))
    tp2 = (2, run_cases("hf_tensor_parallel.py", 2, "2", result(world1, "checkpoints")["written"], timeout=300))
    return {"tp2_zero2": tp2_zero2, "world1": world1, "tp2": tp2}


def result(results, name):
    return case(results, name)[1]


@pytest.mark.parametrize("layout,model", [("tp2_zero2", "training"), ("tp2", "training"), ("tp2_zero2", "qwen3"),
                                          ("tp2", "compiled")])
def test_training_matches_the_unwrapped_model(layouts, layout, model):
    found = result(layouts[layout], model)
    assert len(found["losses"]) == 3 and max(found["losses"]) < CLOSE, found["losses"]
    assert found["grads"]["shapes"] == [] and found["grads"]["max_abs"] < CLOSE
    assert found["grads"]["norm"] < CLOSE  # clipping's norm counts each slice once
    if model != "qwen3":  # the Llama: the padding id's row, held by one rank of the group, gets no gradient
        assert found["grads"]["padding_row"] == 0.0
    assert found["shapes"] == [] and found["keys_match"] and found["param_max_abs"] < CLOSE, found
    assert found["moved"] > 100 * CLOSE  # the parameters did change
    ours, plain = found["generated"]
    assert ours == plain and len(ours[0]) == 3 + 4


@pytest.mark.parametrize("layout", ["tp2_zero2", "tp2"])
def test_plan_counts_the_slices(layouts, layout):
    planned, held, unchanged = result(layouts[layout], "training")["plan"]
    assert planned == held and unchanged  # bmt.plan(model, tp_size=2): this rank's shards of its slices, exactly


@pytest.mark.parametrize("layout", ["tp2_zero2", "tp2"])
def test_each_rank_holds_the_slices_of_the_plan(layouts, layout):
    found = result(layouts[layout], "training")
    held, config, tp = found["held"], found["config"], 2
    hidden, head_dim, ff = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    assert held["self_attn.q_proj.weight"] == [[config["num_attention_heads"] * head_dim // tp, hidden], 0]
    assert held["self_attn.k_proj.weight"] == [[config["num_key_value_heads"] * head_dim // tp, hidden], 0]
    assert held["self_attn.k_proj.bias"] == [[config["num_key_value_heads"] * head_dim // tp], 0]
    assert held["self_attn.o_proj.weight"] == [[hidden, config["num_attention_heads"] * head_dim // tp], 1]
    assert held["self_attn.o_proj.bias"] == [[hidden], None]  # rowwise: the bias whole, added once
    assert held["mlp.down_proj.weight"] == [[hidden, ff // tp], 1]
    assert held["model.embed_tokens.weight"] == [[config["vocab_size"] // tp, hidden], 0]
    assert held["lm_head.weight"] == [[config["vocab_size"], hidden], None]  # kept whole
    assert held["input_layernorm.weight"] == [[hidden], None]


def test_wrap_sets_up_the_tensor_parallel_groups(layouts):
    found = result(layouts["tp2_zero2"], "set_up_by_wrap")  # rank 0 of 4, wrap(tp_size=2) before init_distributed
    assert (found["tp_size"], found["shard_size"]) == (2, 2)
    assert found["tp_group"] == [0, 1] and found["shard_group"] == [0, 2]  # consecutive ranks; the same place
    assert found["loss"] < CLOSE


def test_blocks_compile_with_their_collectives(layouts):
    """A block's colwise layers share one copy of their input (found by identity as the block is traced): a check
    that dynamo cannot trace would leave every block in eager mode."""
    found = result(layouts["tp2"], "compiled")  # its training is checked with the others' above
    assert found["compiled"] and all(found["compiled"]), found["compiled"]


def test_colwise_layers_share_one_all_reduce_of_their_input_gradient(layouts):
    found = result(layouts["tp2_zero2"], "input_copies")
    # q, k, v share one; gate and up another (not 5 a layer); one more for the LM head's weight, whose gradient the
    # group sums as each rank computes the loss of its share of the rows.
    assert found["copies"] == 2 * found["layers"] + 1


def test_qwen3_keeps_its_per_head_norms_and_tied_embedding_whole(layouts):
    held = result(layouts["tp2_zero2"], "qwen3")["held"]
    assert held["self_attn.q_norm.weight"] == [[8], None]  # head_dim: whole, its gradient summed over the group
    assert held["self_attn.q_proj.weight"] == [[4 * 8 // 2, 32], 0]
    assert held["model.embed_tokens.weight"] == [[64, 32], None]  # tied to the whole LM head: kept whole
    assert "lm_head.weight" not in held  # the tied head is the embedding's parameter


def test_checkpoints_load_in_any_layout(layouts):
    world1, tp2 = result(layouts["world1"], "checkpoints"), result(layouts["tp2"], "checkpoints")
    for found in (world1, tp2):  # written at tp 2 x zero 2 and read at world 1; written at world 1, read at tp 2
        assert found["load"] == [[], 0.0] and found["load_state_dict"] == [[], 0.0]
        assert found["load_pretrained"] == [[], 0.0]  # a Hugging Face folder (bmt.save_pretrained)
        assert found["from_pretrained"] == [[], 0.0]
    assert world1["plain"] == 0.0  # plain transformers loads the file the tensor-parallel ranks wrote
    assert world1["plain_pretrained"] == [[], 0.0]  # and their Hugging Face folder


def test_materialize_initialises_split_parameters_whole(layouts):
    for layout in ("world1", "tp2"):
        found = result(layouts[layout], "checkpoints")
        assert found["padding_row"] == 0.0 and found["halves_differ"]
    assert result(layouts["tp2"], "checkpoints")["same_as_before"] == [[], 0.0]  # as materialized at world 1


@pytest.mark.parametrize("layout", ["tp2_zero2", "tp2"])
def test_bad_sizes_and_models_name_the_fix(layouts, layout):
    world = layouts[layout][0]
    errors = result(layouts[layout], "errors")
    assert errors["not_dividing_world"][0] == "ValueError"
    assert f"tp_size must divide the world size {world}" in errors["not_dividing_world"][1]
    assert errors["other_than_the_group"][0] == "ValueError"
    assert "call bmtwrap.init_distributed(tp_size=" in errors["other_than_the_group"][1]
    assert errors["heads"] == ["ValueError", "wrap(tp_size=2): this LlamaForCausalLM has 2 attention heads and 1 "
                               "key/value heads, which tensor parallelism deals out among the ranks of a group, so "
                               f"tp_size must divide both; valid tp sizes here (world size {world}): 1"]
    assert errors["no_plan"][0] == "ValueError" and "this Sequential has none" in errors["no_plan"][1]
    assert errors["plan_names_nothing"][0] == "ValueError"
    assert "names a module of this Module, so nothing would be split" in errors["plan_names_nothing"][1]
    assert errors["wrapped_inside"] == ["NotImplementedError", "this LlamaForCausalLM was wrapped with tp_size=2, and "
                                        "its parameters hold this rank's slices: it cannot be sharded again as part of "
                                        "another model or Block; wrap the outermost model once, with tp_size"]
