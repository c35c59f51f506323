"""wrap() in one process: its errors, re-wrapping, stale optimizers, plans and the plan command."""

import copy
import json
import subprocess
import sys

import pytest
import torch
import transformers
from torch import nn

import bmtwrap as bmt


@pytest.fixture(scope="module", autouse=True)
def world():
    if not bmt.engine.dist.is_initialized():
        bmt.init_distributed(seed=0)


def tiny_llama(**overrides) -> transformers.LlamaForCausalLM:
    values = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32)
    config = transformers.LlamaConfig(**{**values, **overrides})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_wrap_rejects_a_non_module():
    with pytest.raises(TypeError, match="wrap expects an nn.Module, got dict"):
        bmt.wrap({"weight": torch.zeros(2)})


def test_wrap_rejects_bad_options():
    with pytest.raises(ValueError, match="checkpoint must be True, False or 'auto'"):
        bmt.wrap(nn.Linear(2, 2), checkpoint="sometimes")
    with pytest.raises(ValueError, match="zero_level must be 2 or 3"):
        bmt.wrap(nn.Linear(2, 2), zero_level=1)
    with pytest.raises(ValueError, match="offload_params must be True, False or 'auto', got 'yes'"):
        bmt.wrap(nn.Linear(2, 2), offload_params="yes")
    with pytest.raises(ValueError, match="keep_logits must be True or False, got 'no'"):
        bmt.wrap(nn.Linear(2, 2), keep_logits="no")


def test_layer_class_not_in_model_is_named():
    with pytest.raises(ValueError, match="layer class 'GPT2Block' is not in this model"):
        bmt.wrap(tiny_llama(), layers=["GPT2Block"])


def test_wrapping_twice_is_a_no_op_with_the_same_options():
    model = bmt.wrap(tiny_llama())
    shards = [p for p in model.parameters()]
    assert bmt.wrap(model) is model
    assert [p for p in model.parameters()] == shards and all(p.dim() == 1 for p in shards)


def test_wrapping_twice_with_other_options_is_an_error():
    model = bmt.wrap(tiny_llama())
    with pytest.raises(ValueError, match="already wrapped with"):
        bmt.wrap(model, checkpoint=False)


def test_a_model_nobody_refers_to_is_freed():
    """The engine refers weakly to what wrap made of a model: once the program drops the model and its optimizer,
    the model, its parameters and its flat buffers are freed (on a GPU, their memory with them), and a model built
    next trains alone. So after training steps, after an evaluation forward, and after a forward whose backward
    never came."""
    import gc
    import weakref

    from bmtwrap.engine.schedule import engine

    ids = torch.randint(0, 64, (2, 8))

    def train(model):
        optimizer = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-3)
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return optimizer

    def evaluate(model):
        with torch.no_grad():
            model(input_ids=ids, labels=ids)

    def forward_only(model):
        model(input_ids=ids, labels=ids)

    for use in (train, evaluate, forward_only):
        model = bmt.wrap(tiny_llama())
        kept = use(model)
        pieces = [next(model.parameters()), model.model.layers[1].mlp.up_proj.weight]  # the root's and a block's
        buffers = [engine().registry.lookup(p)[0] for p in pieces]
        refs = [weakref.ref(x) for x in (model, *pieces, *buffers, *(b.full for b in buffers))]
        del model, kept, pieces, buffers
        while gc.collect():  # cycles through tensors can take more than one pass
            pass
        assert [r() is None for r in refs] == [True] * len(refs), use.__name__
    assert train(bmt.wrap(tiny_llama())) is not None


def test_a_shard_group_of_one_gathers_by_aliasing_the_shard(monkeypatch):
    """In a world of one the shard is the whole buffer: a gather views it (no copy, no second buffer) and a release
    frees nothing, and training is the unwrapped model's."""
    ref = tiny_llama()
    model = bmt.wrap(copy.deepcopy(ref), compile=False, keep_logits=True)
    registry = bmt.engine.schedule.engine().registry
    buffers = list({id(b): b for b in (registry.lookup(p)[0] for p in model.parameters())}.values())
    assert buffers and all(b.aliased and b.full.data_ptr() == b.local.data_ptr() for b in buffers)
    copies = []
    real_copy = torch.Tensor.copy_

    def counting_copy(self, source, *args, **kwargs):
        copies.append(any(self.data_ptr() == b.full.data_ptr() for b in buffers))
        return real_copy(self, source, *args, **kwargs)

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(5))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        monkeypatch.setattr(torch.Tensor, "copy_", real_copy)
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert not any(copies), "a gather copied into a gathered buffer"
    assert all(b.local.untyped_storage().nbytes() > 0 for b in buffers), "a release freed a shard"
    full = bmt.full_state_dict(model)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=1e-6, msg=name)


def test_wrap_keeps_class_keys_and_parameter_objects():
    model = tiny_llama()
    before_keys = list(model.state_dict())
    before_params = list(model.parameters())
    assert bmt.wrap(model) is model
    assert type(model) is transformers.LlamaForCausalLM
    assert list(model.state_dict()) == before_keys
    assert all(a is b for a, b in zip(model.parameters(), before_params))
    assert model._is_fsdp_managed_module


def test_optimizer_that_stepped_before_wrap_is_caught():
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 8))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    bmt.wrap(model)
    model(ids, labels=ids).loss.backward()
    with pytest.raises(ValueError, match="stepped before bmtwrap.wrap"):
        optimizer.step()


def test_optimizer_built_before_wrap_but_not_stepped_works():
    model = tiny_llama()
    reference = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    # transformers' own loss: Adam's first step divides each gradient by its size, so the chunked loss's
    # rounding (1e-8 on gradients near zero) would show at the tolerance this test asks of the optimizer.
    bmt.wrap(model, keep_logits=True)
    ids = torch.randint(0, 64, (2, 8))
    for m, opt in ((model, optimizer), (reference, ref_opt)):
        m(ids, labels=ids).loss.backward()
        opt.step()
    full = bmt.full_state_dict(model)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=1e-6, msg=name)


def test_casting_after_wrap_is_reported():
    model = bmt.wrap(tiny_llama())
    model.to(torch.float64)
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(RuntimeError, match="was replaced after sharding"):
        model(ids)


def test_running_an_unloaded_meta_model_is_reported():
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(tiny_llama().config)
    bmt.wrap(model)
    with pytest.raises(RuntimeError, match="built on the meta device and hold no values yet"):
        model(torch.randint(0, 64, (1, 4)))


class Scaled(nn.Module):
    """A layer with a non-persistent buffer made in its constructor, as Gemma's scaled embedding has.

    ``reset_parameters`` sets the buffer (and redraws the weight) when ``computes_buffer``; without
    it, nothing but the constructor knows the buffer's value.
    """

    def __init__(self, computes_buffer: bool) -> None:
        super().__init__()
        self.computes_buffer = computes_buffer
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("scale", torch.tensor(2.0), persistent=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        if self.computes_buffer:
            nn.init.constant_(self.scale, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight * self.scale


def scaled_stack(computes_buffer: bool) -> nn.Module:
    return nn.Sequential(*[Scaled(computes_buffer) for _ in range(2)])


def scaled_reference_and_meta(computes_buffer: bool) -> tuple:
    """The stack built on the CPU (seeded), and the same stack built on the meta device and wrapped."""
    torch.manual_seed(0)
    ref = scaled_stack(computes_buffer)
    with torch.device("meta"):
        model = scaled_stack(computes_buffer)
    return ref, bmt.wrap(model)


def test_buffers_built_on_meta_are_computed_after_loading_without_touching_loaded_weights():
    ref, model = scaled_reference_and_meta(computes_buffer=True)
    assert torch.isnan(model[0].scale).all(), "an unwritten buffer holds NaN, never leftover memory"
    bmt.load_state_dict(model, ref.state_dict())  # the weights only: the buffers are not persistent
    assert all(m.scale.item() == 2.0 for m in model), "the initialiser computes the buffers after loading"
    full = bmt.full_state_dict(model)
    assert all(torch.equal(full[k], v) for k, v in ref.state_dict().items()), "restoring a buffer changed a weight"
    x = torch.randn(3, 4)
    assert torch.equal(model(x), ref(x))


def test_a_buffer_nothing_computes_is_named():
    ref, model = scaled_reference_and_meta(computes_buffer=False)
    with pytest.raises(ValueError, match=r"buffer '0.scale' \(Scaled\), '1.scale' \(Scaled\) of this Sequential was "
                                         r"built on the meta device and has no value: .* Build the model on a real device"):
        bmt.load_state_dict(model, ref.state_dict())
    _, model = scaled_reference_and_meta(computes_buffer=False)
    with pytest.raises(ValueError, match=r"buffer '0.scale' .* reset_parameters\(\) that sets it"):
        bmt.materialize(model)


def test_materialize_needs_a_wrapped_model():
    with pytest.raises(ValueError, match="materialize expects a model returned by bmtwrap.wrap"):
        bmt.materialize(tiny_llama())


def test_load_state_dict_lists_problems_and_changes_nothing():
    model = bmt.wrap(tiny_llama())
    before = bmt.full_state_dict(model)
    state = tiny_llama(tie_word_embeddings=True).state_dict()
    state["extra.weight"] = torch.zeros(1)
    state["model.norm.weight"] = torch.zeros(5)
    del state["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError) as info:
        bmt.load_state_dict(model, state)
    message = str(info.value)
    assert "missing keys" in message and "model.layers.0.mlp.up_proj.weight" in message
    assert "unexpected keys" in message and "extra.weight" in message
    assert "shape mismatches" in message and "model.norm.weight" in message
    after = bmt.full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_auto_checkpoint_falls_back_to_checkpointing_on_cpu():
    model = bmt.wrap(tiny_llama(), checkpoint="auto")
    record = bmt.engine.schedule.engine().wrapped[id(model)]
    assert all(runner.recompute for _, runner in record.runners)


def test_plan_lists_blocks_and_memory():
    plan = bmt.plan(tiny_llama(), world_size=4, batch_size=2, seq_len=16)
    assert plan.block_names == ["model.layers.0", "model.layers.1"]
    assert plan.rule == "repeated layers"
    total = sum(p.numel() for p in tiny_llama().parameters())
    assert plan.root.params + sum(b.params for b in plan.blocks) == total
    # fp32 over 4 ranks: a quarter, plus at most 64 bytes of alignment per parameter and per shard
    count = sum(1 for _ in tiny_llama().parameters())
    assert total <= plan.memory.params <= total + 64 * (count + 3)
    text = str(plan)
    assert "model.layers.1" in text and "LlamaDecoderLayer" in text and "activations" in text
    assert "host memory per rank:     0.00 GiB" in text


def test_plan_with_offload_moves_state_to_the_host():
    on_gpu = bmt.plan(tiny_llama(), world_size=2)
    # Updates after backward: the gradients of the state on the host wait on the GPU.
    offload = bmt.plan(tiny_llama(), world_size=2, offload_optimizer=True, step_in_backward=False)
    both = bmt.plan(tiny_llama(), world_size=2, offload_optimizer=True, offload_params=True)
    assert offload.memory.optimizer == 0
    assert dict(offload.memory.host_detail)["optimizer state"] == on_gpu.memory.optimizer
    assert dict(offload.memory.host_detail)["pinned staging"] > 0
    root_shards = offload.root.shard_bytes
    assert both.memory.params == root_shards and both.memory.grads == root_shards  # blocks' shards on the host
    assert dict(both.memory.host_detail)["parameters and gradients"] >= 2 * sum(b.shard_bytes for b in both.blocks)
    # Starting the updates in backward (the default, or unchecked), a gradient shard whose state is on the host
    # leaves the GPU once final: one at a time.
    for mode in ("auto", "speculative", True):
        in_backward = bmt.plan(tiny_llama(), world_size=2, offload_optimizer=True, step_in_backward=mode)
        assert in_backward.memory.grads == max(g.shard_bytes for g in (in_backward.root, *in_backward.blocks))
        assert in_backward.memory.grads < offload.memory.grads == on_gpu.memory.grads
    half = bmt.plan(tiny_llama(), world_size=2, offload_optimizer=True, offload_fraction=0.5)
    assert 0 < half.memory.optimizer < on_gpu.memory.optimizer
    with pytest.raises(ValueError, match="offload_fraction must be 'auto' or in \\[0, 1\\], got 1.5"):
        bmt.plan(tiny_llama(), offload_fraction=1.5)


def test_a_gpu_budget_offloads_the_parameters_when_they_leave_no_room():
    """offload_params="auto": the blocks' parameters go to the host when this rank's parameters and gradients take more
    than PARAMS_SHARE of the budget less the margin and the memory outside the allocator; never without a budget."""
    from bmtwrap.engine.memory import MIN_MARGIN, outside_allocator_estimate
    from bmtwrap.wrap.plan import PARAMS_SHARE, offload_params_auto

    model = tiny_llama()
    both = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # parameters and gradients, one rank

    def budget(share: float, world_size: int = 1) -> int:  # the budget where both take ``share`` of what is usable
        return MIN_MARGIN + outside_allocator_estimate(world_size) + int(both / world_size / share)

    roomy = bmt.plan(model, max_gpu_memory=budget(PARAMS_SHARE - 0.05))
    tight = bmt.plan(model, max_gpu_memory=budget(PARAMS_SHARE + 0.05))
    assert not roomy.offload.params and tight.offload.params
    assert tight.memory.params == tight.root.shard_bytes  # the blocks' shards are on the host
    assert "offloaded to the host: block parameters" in str(tight)
    assert not bmt.plan(model, max_gpu_memory=budget(PARAMS_SHARE + 0.05), offload_params=False).offload.params
    assert not bmt.plan(model).offload.params and not offload_params_auto(model, 1, None)
    # Over two ranks each holds half: the same room per rank (NCCL's buffers aside) is enough again.
    same_room = budget(PARAMS_SHARE + 0.05) - outside_allocator_estimate(1) + outside_allocator_estimate(2)
    assert not bmt.plan(model, world_size=2, max_gpu_memory=same_room).offload.params
    assert bmt.plan(model, world_size=2, max_gpu_memory=budget(PARAMS_SHARE + 0.05, 2)).offload.params


def test_plan_activations_follow_the_batch_and_the_vocabulary():
    small = bmt.plan(tiny_llama(), world_size=1, batch_size=2, seq_len=16, keep_logits=True).memory
    large = bmt.plan(tiny_llama(), world_size=1, batch_size=4, seq_len=16, keep_logits=True).memory
    assert large.activations == 2 * small.activations
    config = tiny_llama().config
    vocab, hidden = config.vocab_size, config.hidden_size
    # The fp32 cross-entropy's backward over the logits counts at the loss, with no gradients yet.
    assert small.loss_peak - small.params - small.optimizer >= 12 * 2 * 16 * vocab
    assert large.loss_peak - small.loss_peak >= 12 * 2 * 16 * vocab
    # Without the logits: one chunk of them (all 64 tokens here, fp32), the head's fp32 gradient and the hidden
    # state's gradient.
    fused = bmt.plan(tiny_llama(), world_size=1, batch_size=4, seq_len=16).memory
    assert large.loss_peak - fused.loss_peak == 12 * 64 * vocab - (64 * vocab * 4 + vocab * hidden * 4 + 64 * hidden * 4)


def test_plan_a_compiled_block_recomputes_in_less():
    """A compiled block's recomputation keeps what its layer saves, once; an eager one also its norms' fp32 values,
    and twice (activations and their gradients). Nothing else in the estimate changes."""
    from bmtwrap.wrap.plan_activations import LAYER_FP32_H, LAYER_SAVED_H, LAYER_SAVED_I

    compiled = bmt.plan(tiny_llama(), world_size=1, batch_size=4, seq_len=16).memory
    eager = bmt.plan(tiny_llama(), world_size=1, batch_size=4, seq_len=16, compile=False).memory
    kept = bmt.plan(tiny_llama(), world_size=1, batch_size=4, seq_len=16, checkpoint=False).memory
    config = tiny_llama().config
    tokens, hidden, inner = 64, config.hidden_size, config.intermediate_size
    eager_layer = tokens * 4 * (LAYER_SAVED_H * hidden + LAYER_SAVED_I * inner)  # fp32 parameters here
    compiled_layer = kept.activations // 3  # two blocks kept, and one block's backward
    assert eager.activations - compiled.activations == 2 * (eager_layer + tokens * 4 * LAYER_FP32_H * hidden) - (
        compiled_layer)
    assert (eager.params, eager.grads, eager.gathered, eager.loss_peak) == (
        compiled.params, compiled.grads, compiled.gathered, compiled.loss_peak)


def test_plan_counts_what_a_compiled_block_saves():
    """The plan's activations of a kept compiled block are what the block saves for backward, counted with the
    saved-tensor hook of a real step (the compiler's partition, without its code generation); the rotary
    embedding's tables, shared by every layer, are not the block's."""
    from bmtwrap.engine.runners import BlockRunner

    model = tiny_llama().to(torch.bfloat16)
    planned = bmt.plan(model, world_size=1, batch_size=4, seq_len=16, checkpoint=False).memory
    model = bmt.wrap(model, checkpoint=False, compile={"backend": "aot_eager_decomp_partition"})
    saved = {}
    pack = BlockRunner._pack

    def counting(self, tensor):
        out = pack(self, tensor)
        if out is tensor and self.name == "model.layers.1":
            saved[tensor.untyped_storage().data_ptr()] = (tensor.untyped_storage().nbytes(), tuple(tensor.shape))
        return out

    ids = torch.randint(0, 64, (4, 16))
    try:
        BlockRunner._pack = counting
        for _ in range(2):  # the second step runs the compiled graph as every later one does
            saved.clear()
            model(input_ids=ids, labels=ids).loss.backward()
    finally:
        BlockRunner._pack = pack
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    tables = sum(size for size, shape in saved.values() if shape == (1, 16, head_dim))
    assert tables == 2 * 16 * head_dim * 2  # cos and sin
    assert sum(size for size, _ in saved.values()) - tables == planned.activations // 3


def test_plan_counts_float8_blocks_as_saving_less():
    """A kept compiled block computing in float8 saves less (the compiler recomputes the casts and two projections'
    inputs: ``FLOAT8_SAVED``, counted on an H200); the blocks kept at both ends in the model's dtype count as before,
    and a checkpointed block, which keeps its input only, the same either way."""
    from bmtwrap.wrap.plan_activations import layer_bytes

    model = tiny_llama(num_hidden_layers=8)
    shape = dict(world_size=1, batch_size=4, seq_len=16)
    layer = layer_bytes(model, 64, 4, compiled=True)  # fp32 parameters here
    saving = layer.kept - layer.kept_float8
    assert saving > 0
    plain = bmt.plan(model, checkpoint=False, **shape).memory
    every = bmt.plan(model, checkpoint=False, fp8=bmt.Float8("tensorwise", keep_ends=0), **shape).memory
    ends = bmt.plan(model, checkpoint=False, fp8=True, **shape).memory  # the first and the last block in fp32
    assert plain.loss_peak - every.loss_peak == 8 * saving
    assert plain.loss_peak - ends.loss_peak == 6 * saving
    checkpointed = dict(checkpoint=True, **shape)
    assert bmt.plan(model, fp8=True, **checkpointed).memory == bmt.plan(model, **checkpointed).memory


def test_plan_peak_is_the_larger_of_the_loss_and_backward():
    """A large vocabulary peaks at the loss, before backward makes the gradients; a small one in backward."""
    wide = bmt.plan(tiny_llama(vocab_size=4096), world_size=1, batch_size=4, seq_len=32, keep_logits=True).memory
    assert wide.loss_peak > wide.backward_peak and wide.total == wide.loss_peak
    assert wide.total < wide.backward_peak + 12 * 4 * 32 * 4096  # the gradients are not summed with the loss
    narrow = bmt.plan(tiny_llama(vocab_size=8), world_size=1, batch_size=4, seq_len=32, keep_logits=True).memory
    assert narrow.backward_peak > narrow.loss_peak and narrow.total == narrow.backward_peak
    assert bmt.plan(tiny_llama(), world_size=1).memory.loss_peak is None  # no batch shape


def test_plan_backward_peak_follows_the_blocks_last_to_first():
    """Backward runs the blocks last to first: at block i the gradient shards of blocks i and after (and the root's)
    are there beside the activations saved by blocks i and before, and one block's recomputation."""
    for seq_len in (8, 4096):  # the gradients outweigh the activations, then the other way round
        plan = bmt.plan(tiny_llama(vocab_size=8), world_size=1, batch_size=4, seq_len=seq_len, keep_logits=True)
        m, (g0, g1) = plan.memory, [b.shard_bytes for b in plan.blocks]
        saved = 4 * seq_len * tiny_llama().config.hidden_size * 4  # each checkpointed block's fp32 input
        recompute = m.activations - 2 * saved
        other = m.grads - g0 - g1  # the root's
        walk = max(other + g1 + 2 * saved, other + g0 + g1 + saved)
        assert m.backward_peak == m.params + m.optimizer + m.gathered + walk + recompute
        assert m.backward_peak < m.params + m.grads + m.optimizer + m.gathered + m.activations


def test_plan_counts_no_gathered_copies_in_a_shard_group_of_one():
    """A gather in a shard group of one aliases the shard: what is gathered is the full gradients only (the root's and
    the largest block's), unless the blocks' shards are on the host; sharded, the copies count too."""
    def plan_for(world_size, **options):
        return bmt.plan(tiny_llama(), world_size=world_size, batch_size=2, seq_len=16, **options)

    one = plan_for(1)
    grads = one.root.shard_bytes + max(b.shard_bytes for b in one.blocks)  # fp32: gradients as large as parameters
    assert one.memory.gathered == grads
    host = plan_for(1, offload_optimizer=True, offload_params=True)
    assert host.memory.gathered == grads + sum(sorted((b.shard_bytes for b in one.blocks), reverse=True)[:2])
    two = plan_for(2)
    copies = one.root.shard_bytes + sum(sorted((b.shard_bytes for b in one.blocks), reverse=True)[:2])
    assert two.memory.gathered == grads + copies


def test_plan_command(tmp_path, capsys):
    """``python -m bmtwrap plan`` as a user runs it, once (a fresh interpreter imports torch and transformers:
    8 s on two cores); the other targets through the same main() in this process."""
    from bmtwrap.__main__ import main

    tiny_llama().config.save_pretrained(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = subprocess.run([sys.executable, "-m", "bmtwrap", "plan", str(tmp_path / "model"), "--world-size", "2"],
                         capture_output=True, text=True, check=True).stdout
    assert "WrapPlan for LlamaForCausalLM over 2 rank(s): 2 blocks" in out
    main(["plan", str(tmp_path / "config.json"), "--world-size", "2"])
    assert "WrapPlan for LlamaForCausalLM over 2 rank(s): 2 blocks" in capsys.readouterr().out
    # SystemExit with a message: Python prints it to stderr and exits with status 1.
    with pytest.raises(SystemExit, match="no such file or folder"):
        main(["plan", str(tmp_path / "nowhere")])


def test_plan_command_options(tmp_path, capsys):
    from bmtwrap.__main__ import main

    tiny_llama().config.save_pretrained(tmp_path)
    main(["plan", str(tmp_path), "--world-size", "4", "--ranks-per-host", "2", "--offload", "--offload-params",
          "--checkpoint", "false", "--batch-size", "2", "--seq-len", "16", "--dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert "offloaded to the host: optimizer state (100%), block parameters" in out
    assert "GPU memory per rank (estimate)" in out and "host memory per host (2 rank(s))" in out
    assert "ckpt" in out and " no" in out.splitlines()[4]  # the first block (after the class, title, header, root)
    # A card by name: the optimizer's share on it, as auto_adam decides.
    main(["plan", str(tmp_path), "--max-gpu-memory", "H100", "--batch-size", "2", "--seq-len", "16"])
    assert "optimizer: auto_adam's choice for 79.18 GiB: the state of 100% of the parameters on the GPU" in \
        capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = capsys.readouterr().out
    assert "--offload-params" in help_text and "--batch-size" in help_text
    assert "``" not in help_text and ":func:" not in help_text, "reStructuredText in --help"
    for argv, message in ((["--batch-size", "2"], "give --batch-size and --seq-len together"),
                          (["--offload-fraction", "0.5"], "--offload-fraction applies to --optimizer offload"),
                          (["--offload", "--offload-fraction", "half"], "--offload-fraction must be a number in "
                                                                         "\\[0, 1\\] or auto, got 'half'"),
                          (["--world-size", "0"], "--world-size must be >= 1, got 0")):
        with pytest.raises(SystemExit, match=message):
            main(["plan", str(tmp_path), *argv])


class _FamilyModel(nn.Module):
    """A model of a family bmtwrap does not know: its layers live in ``stack``."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.prepared = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.stack:
            x = layer(x)
        return x


def test_a_registered_adapter_is_used_for_its_family():
    from bmtwrap.wrap.adapters import ModelAdapter, adapter_for, register_adapter

    @register_adapter
    class FamilyAdapter(ModelAdapter):
        @classmethod
        def build(cls, model):
            return cls() if isinstance(model, _FamilyModel) else None

        def prepare(self, model):
            model.prepared = True

    model = bmt.wrap(_FamilyModel())
    assert model.prepared, "wrap did not call the family's adapter"
    assert type(adapter_for(nn.Linear(2, 2))) is ModelAdapter  # other models are not claimed
    with pytest.raises(TypeError, match="register_adapter expects a subclass of ModelAdapter, got <class 'int'>"):
        register_adapter(int)
    with pytest.raises(TypeError, match="NoBuild must define its own classmethod build"):
        @register_adapter
        class NoBuild(ModelAdapter):
            pass
    assert type(adapter_for(nn.Linear(2, 2))) is ModelAdapter, "a class without build() claimed every model"


def test_fp8_is_refused_without_float8_tensor_cores_and_leaves_the_model_as_it_was():
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"wrap\(fp8='tensorwise'\) needs a CUDA GPU with float8 tensor cores"):
        bmt.wrap(model, fp8=True)
    with pytest.raises(RuntimeError, match=r"wrap\(fp8='rowwise'\) needs a CUDA GPU"):
        bmt.wrap(model, fp8="rowwise")
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_fp8_rejects_unknown_recipes_and_configs_for_fsdp_gathers():
    from torchao.float8 import Float8LinearConfig

    with pytest.raises(ValueError, match="fp8='fast' is not a float8 recipe; give True .tensorwise., one of"):
        bmt.wrap(tiny_llama(), fp8="fast")
    with pytest.raises(TypeError, match="fp8 must be True, False, a recipe name"):
        bmt.wrap(tiny_llama(), fp8=8)
    with pytest.raises(ValueError, match="bmtwrap gathers the weights itself"):
        bmt.wrap(tiny_llama(), fp8=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True))


def test_fp8_off_leaves_every_linear_as_it_is():
    model = bmt.wrap(tiny_llama(), fp8=False)
    assert {type(m) for m in model.modules() if isinstance(m, nn.Linear)} == {nn.Linear}
    assert bmt.plan(tiny_llama()).fp8 == "off"
    assert bmt.plan(tiny_llama(), fp8="rowwise").fp8 == "rowwise: 14 of the blocks' 14 linear layers in float8"


def _float8_layers(model: nn.Module) -> list:
    return sorted({int(n.split(".")[2]) for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"})


def test_fp8_keeps_the_blocks_at_both_ends_in_the_model_dtype_and_trains_like_the_model_converted_so():
    """By default the first and last 2 blocks stay in the model's dtype, at most a quarter of the blocks: 1 at each
    end of 8, none of 4. The wrapped model's losses and weights follow the unwrapped model converted the same way."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    emulated = Float8LinearConfig(emulate=True)
    assert bmt.plan(tiny_llama(num_hidden_layers=16), fp8=True).fp8 == (
        "tensorwise: 84 of the blocks' 112 linear layers in float8 (the first and last 2 blocks in the model's dtype)")
    assert bmt.plan(tiny_llama(num_hidden_layers=4), fp8="rowwise").fp8 == (
        "rowwise: 28 of the blocks' 28 linear layers in float8")
    assert bmt.plan(tiny_llama(num_hidden_layers=4), fp8=bmt.Float8("rowwise", keep_ends=1)).fp8 == (
        "rowwise: 14 of the blocks' 28 linear layers in float8 (the first and last block in the model's dtype)")
    plain = tiny_llama(num_hidden_layers=8)

    def middle(module: nn.Module, fqn: str) -> bool:  # blocks 1 to 6 of 8
        return any(f".layers.{i}." in f".{fqn}" for i in range(1, 7))

    ref = convert_to_float8_training(copy.deepcopy(plain), config=emulated, module_filter_fn=middle)
    model = bmt.wrap(plain, fp8=bmt.Float8(emulated))
    assert _float8_layers(ref) == _float8_layers(model) == [1, 2, 3, 4, 5, 6]
    assert bmt.wrap(model, fp8=bmt.Float8(emulated)) is model
    with pytest.raises(ValueError, match="already wrapped"):
        bmt.wrap(model, fp8=bmt.Float8(emulated, keep_ends=0))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    for _ in range(3):
        losses = []
        for m, opt in zip((ref, model), opts):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    full, expected = bmt.full_state_dict(model), ref.state_dict()
    assert max((full[k] - expected[k]).abs().max().item() for k in expected) < 1e-5
    everything = bmt.wrap(tiny_llama(num_hidden_layers=8), fp8=bmt.Float8(emulated, keep_ends=0))
    assert _float8_layers(everything) == list(range(8))


def test_fp8_refuses_ends_that_leave_no_block_in_float8_and_leaves_the_model_as_it_was():
    model = tiny_llama(num_hidden_layers=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"Float8\(keep_ends=2\): the model has 4 blocks, .* give keep_ends below 2"):
        bmt.plan(model, fp8=bmt.Float8(keep_ends=2))
    with pytest.raises(ValueError, match=r"keep_ends=-1.*give a whole number of blocks >= 0"):
        bmt.plan(model, fp8=bmt.Float8(keep_ends=-1))
    with pytest.raises(TypeError, match=r"Float8\(recipe=True\): the recipe is a name"):
        bmt.plan(model, fp8=bmt.Float8(True))
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_fp8_leaves_a_block_that_is_itself_a_linear_layer_as_it_is():
    """The engine runs each block module itself: one that is an nn.Linear keeps its class (and is counted so)."""
    from torchao.float8 import Float8LinearConfig

    emulated = Float8LinearConfig(emulate=True)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)])
    assert bmt.plan(model, fp8=emulated).fp8 == "config: 0 of the blocks' 3 linear layers in float8"
    bmt.wrap(model, fp8=emulated)
    assert [type(m) for m in model] == [nn.Linear] * 3
    assert model(torch.randn(2, 32)).shape == (2, 32)


def _counting_on_demand_calls(monkeypatch):
    """Counts the on-demand mode's calls, as (paused, calls): those made while the engine's code ran, and all."""
    from bmtwrap.engine import on_demand

    counts = {"paused": 0, "calls": 0}
    original = on_demand.OnDemandGathers.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        counts["calls"] += 1
        counts["paused"] += bool(self.paused)
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(on_demand.OnDemandGathers, "__torch_function__", counting)
    return counts


def test_the_engines_own_torch_calls_do_not_go_through_the_on_demand_mode(monkeypatch):
    """While a block's gathers, views and hooks run, the mode that watches the model's code is off the stack: the
    model's own calls outside the blocks still reach it, the engine's (about 80 a block) do not."""
    model = bmt.wrap(tiny_llama(num_hidden_layers=3), compile=False)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    counts = _counting_on_demand_calls(monkeypatch)
    model(input_ids=ids, labels=ids).loss.backward()
    assert counts["calls"] > 0 and counts["paused"] == 0, counts


class _Passthrough(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _ModeAroundLayers(nn.Module):
    """Runs its layers under a torch-function mode of its own (above the engine's), and reads the first layer's
    weight outside that layer's block."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        with _Passthrough():
            for layer in self.layers:
                x = torch.tanh(layer(x))
        return (x * self.layers[0].weight.sum()).pow(2).mean()


def test_a_model_running_its_layers_under_its_own_mode_trains_as_unwrapped(monkeypatch):
    """With the model's mode above the engine's on the stack, the engine's mode cannot leave it while a block's
    code runs: it pauses instead, and gathers on demand as usual."""
    ref = _ModeAroundLayers()
    model = bmt.wrap(copy.deepcopy(ref), layers=[nn.Linear], compile=False)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    counts = _counting_on_demand_calls(monkeypatch)
    for _ in range(2):
        ref_loss, loss = ref(x), model(x)
        ref_loss.backward()
        loss.backward()
        assert torch.allclose(loss, ref_loss, rtol=1e-6), (loss, ref_loss)
        grads = bmt.full_grad_dict(model)
        for name, p in ref.named_parameters():
            assert torch.allclose(grads[name], p.grad, atol=1e-6), name
            p.grad = None
        model.zero_grad(set_to_none=True)
    assert counts["paused"] > 0, counts  # the engine's code ran under the model's mode, the engine's paused
