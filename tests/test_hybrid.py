"""Hybrid sharding (``init_distributed(shard_size=...)``) over gloo at world 4: shard groups of 2 (two replicas)
and of 1 (every rank a replica). The parity and wrap cases of test_parity.py and test_wrap_dist.py run again in
those layouts with the same tolerances, beside hybrid's own: the layout, replicas that stay bit-identical, the
gradient's norm and the non-finite check over every shard once. The option's validation and the plan's figures
run in this process."""

import pytest

import bmtwrap as bmt
from bmtwrap.engine.dist import _resolve_shard_size
from launch import case, run_cases

SHARD_SIZES = [2, 1]


@pytest.fixture(scope="module", params=SHARD_SIZES, ids=lambda s: f"world4-shard{s}")
def hybrid(request):
    return request.param, run_cases("hybrid.py", 4, env={"BMTWRAP_SHARD_SIZE": str(request.param)})


def test_layout(hybrid):
    shards, r = case(hybrid, "topology")
    assert (r["world"], r["shard_size"], r["replicas"]) == (4, shards, 4 // shards)
    assert r["layout_shards"] == [shards], "flat buffers are laid out over the shard group"
    # [global rank, shard rank, BMTrain's zero_rank, bmt.rank(), bmt.world_size()]
    assert r["ranks"] == [[rank, rank % shards, rank % shards, rank, 4] for rank in range(4)]
    # bmt.config["zero_comm"]: [its ranks, this rank's place, an allReduce of rank + 1 over it]
    groups = [list(range(rank - rank % shards, rank - rank % shards + shards)) for rank in range(4)]
    assert r["zero_comm"] == [[group, rank % shards, float(sum(q + 1 for q in group))]
                              for rank, group in enumerate(groups)]


@pytest.mark.parametrize("name", ["replicas_torch", "replicas_adam", "replicas_offload",
                                  "replicas_offload_params_in_backward"])
def test_replicas_stay_identical(hybrid, name):
    shards, r = case(hybrid, name)
    assert r["replicas_equal"], f"shard size {shards}: the ranks of a replica group hold different values"
    assert r["shards_distinct"] and r["tensors"] > 0


def test_norm_and_nonfinite_count_every_shard_once(hybrid):
    shards, r = case(hybrid, "norms_and_nonfinite")
    assert r["norm_2.0_rel"] <= 1e-6 and r["norm_inf_rel"] <= 1e-6, f"shard size {shards}: {r}"
    assert r["nonfinite_seen"] == [True] * 4 and not r["clean_seen"]


def test_wrapped_llama_trains_and_generates_like_the_unwrapped(hybrid):
    shards, r = case(hybrid, "wrapped_llama")
    assert r["keys_match"] and r["loss_max_rel"] <= 1e-5 and r["param_max_abs"] <= 1e-5, f"shard size {shards}: {r}"
    assert r["generate_equal"]


def test_shard_size_is_checked(monkeypatch):
    monkeypatch.delenv("BMTWRAP_SHARD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _resolve_shard_size(None, 8) == 8 and _resolve_shard_size(2, 8) == 2
    with pytest.raises(ValueError, match=r"shard_size=3 must divide the world size 8 .*for example 1, 2, 4, 8"):
        _resolve_shard_size(3, 8)
    with pytest.raises(ValueError, match="shard_size='local' takes the ranks of one node from LOCAL_WORLD_SIZE"):
        _resolve_shard_size("local", 8)
    with pytest.raises(TypeError, match="shard_size must be a number of ranks, 'local' or None, got 2.0"):
        _resolve_shard_size(2.0, 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _resolve_shard_size(None, 8) == 4, "spanning several nodes: one node's ranks"
    assert _resolve_shard_size(None, 4) == 4 and _resolve_shard_size("local", 8) == 4
    monkeypatch.setenv("BMTWRAP_SHARD_SIZE", "2")
    assert _resolve_shard_size(None, 8) == 2 and _resolve_shard_size(8, 8) == 8  # the argument wins
    monkeypatch.setenv("BMTWRAP_SHARD_SIZE", "two")
    with pytest.raises(ValueError, match="BMTWRAP_SHARD_SIZE='two': give a number of ranks, or 'local'"):
        _resolve_shard_size(None, 8)


def test_plan_for_a_shard_size():
    """Per rank, shard groups of 8 in a world of 16 hold what a world of 8 does; the header says so."""
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    hybrid = bmt.plan(model, world_size=16, shard_size=8, batch_size=2, seq_len=16)
    flat = bmt.plan(model, world_size=8, batch_size=2, seq_len=16)
    wide = bmt.plan(model, world_size=16, batch_size=2, seq_len=16)
    part = lambda m: (m.params, m.grads, m.optimizer, m.gathered)  # noqa: E731
    assert part(hybrid.memory) == part(flat.memory) and part(wide.memory) != part(flat.memory)
    assert "over 16 rank(s), sharded in groups of 8 (2 replicas)" in str(hybrid)
    with pytest.raises(ValueError, match="shard_size=3 must divide world_size=16"):
        bmt.plan(model, world_size=16, shard_size=3)
