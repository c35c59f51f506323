"""Compiled blocks (``wrap(compile=...)``) and the loss without the logits, against unwrapped models.

Across ranks (gloo, world sizes 1-3: ``dist_cases/fast_layers.py``): compiled blocks, checkpointed or
not, ZeRO-2 and -3, frozen parameters, hooks and LoRA adapters train like the unwrapped model; the
loss computed from the last hidden state matches transformers' for Llama, Qwen2, Gemma, Gemma 2 and
GPT-2 with padding and ignored labels. In one process: a real inductor compilation, the fallback
to eager mode, the options, and the calls that keep transformers' logits.
"""

import copy
import warnings

import pytest
import torch
import transformers

import bmtwrap as bmt
from bmtwrap.wrap.compiled import compile_options
from launch import case, run_cases

COMPILED = ["compiled_checkpointed", "compiled_kept", "compiled_zero2", "compiled_frozen_and_hooked", "compiled_lora"]
FAMILIES = ["llama", "qwen2", "gemma", "gemma2", "gpt2"]


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"world{w}")
def results(request):
    return request.param, run_cases("fast_layers.py", request.param)


def _assert_trains_like_reference(world, r, tol=1e-5):
    assert r["loss_rel"] <= tol and r["grad_rel"] <= tol and r["param_abs"] <= tol, f"world {world}: {r}"


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_blocks_train_like_the_unwrapped_model(results, name):
    world, r = case(results, name)
    _assert_trains_like_reference(world, r)


def test_blocks_of_one_class_share_their_compilation(results):
    """One graph for every block, in forward and in its recomputation in backward (checkpointed blocks): the
    forward runs it without the on-demand mode that is absent in backward. The final norm adds one."""
    world, r = case(results, "compiled_graphs_shared")
    assert r["graphs_3_blocks"] == 2 and r["graphs_6_blocks"] == 2, f"world {world}: {r}"  # the blocks', the norm's


def test_a_layer_reading_another_blocks_parameter_runs_eagerly_on_every_rank(results):
    """It fails to compile on every rank alike (a rank holding the whole bias as its piece would otherwise run the
    compiled code while the others gather: a hang), and trains exactly, gathered on demand."""
    world, r = case(results, "compiled_cross_block")
    assert r["fallbacks"] == 2, r  # the second and third layers read their predecessor's bias; the first does not
    assert r["loss_max_rel"] <= 1e-6 and r["grad_max_abs"] <= 1e-6 and r["param_max_abs"] <= 1e-6, r


def test_a_checkpointed_compiled_layer_may_call_a_module_of_the_root(results):
    """A module outside the layers, called by each (a shared norm): forward and the recomputation in backward see its
    full parameters alike (torch's checkpoint refused the recomputation when they did not), and training is exact."""
    world, r = case(results, "compiled_calls_a_root_module")
    assert r["loss_max_rel"] <= 1e-5 and r["grad_max_abs"] <= 1e-5 and r["param_max_abs"] <= 1e-5, f"world {world}: {r}"


def test_the_check_for_other_blocks_parameters_costs_nothing_once_compiled(results):
    """The graphs are checked when compiled (the first step); the steps after run the compiled code with no check
    and no torch-function mode around it (each call of one cost host time that a fast GPU waited for)."""
    world, r = case(results, "compiled_checks_when_traced")
    assert r["checks"][0] > 0 and r["checks"][1] == 0 and r["mode_calls"] == [0, 0], f"world {world}: {r}"


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_without_logits_matches_transformers(results, family):
    world, r = case(results, f"head_loss_{family}")
    _assert_trains_like_reference(world, r)
    assert all(r["logits_none"]), "a training call with labels returned logits"


def test_loss_without_logits_divides_by_the_trainers_item_count(results):
    world, r = case(results, "head_loss_items_in_batch")
    _assert_trains_like_reference(world, r)


def test_keep_logits_runs_transformers_loss(results):
    world, r = case(results, "head_loss_kept_logits")
    assert r["logits_none"] == [False]
    assert r["loss_rel"] <= 1e-6 and r["grad_rel"] <= 1e-5, f"world {world}: {r}"


# --- one process ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def world():
    if not bmt.engine.dist.is_initialized():
        bmt.init_distributed(seed=0)


def tiny_llama(layers=2):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def _train(model, steps=2):
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, bmt.full_state_dict(model)


def _max_gap(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_inductor_compiled_blocks_match_eager(world):
    """The default backend, generating and running its own kernels (C++ on the CPU)."""
    eager = bmt.wrap(tiny_llama(), compile=False, checkpoint=True)
    compiled = bmt.wrap(tiny_llama(), compile=True, checkpoint=True)
    (eager_losses, eager_state), (losses, state) = _train(eager), _train(compiled)
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    assert _max_gap(state, eager_state) <= 1e-5


def _failing_backend(graph, example_inputs):
    raise RuntimeError("this backend compiles nothing")


def test_a_block_that_does_not_compile_runs_eagerly_with_one_warning(world):
    eager = bmt.wrap(tiny_llama(), compile=False)
    failing = bmt.wrap(tiny_llama(), compile={"backend": _failing_backend})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, state = _train(failing)
    messages = [str(w.message) for w in caught if "did not compile" in str(w.message)]
    # One per block and one for the final norm, once: the next step runs eagerly without asking again.
    assert len(messages) == 3, messages
    assert "block 'model.layers.0'" in messages[0] and "this backend compiles nothing" in messages[0]
    assert "module 'model.norm'" in messages[2]
    eager_losses, eager_state = _train(eager)
    assert losses == pytest.approx(eager_losses, rel=1e-6) and _max_gap(state, eager_state) <= 1e-6


def test_the_final_norm_compiles_and_torchs_own_modules_stay_eager(world):
    """Outside the blocks, the model's own modules that also run inside them (Llama's final RMSNorm) compile; torch's
    single-kernel modules (GPT-2's final LayerNorm, the embeddings, the head) and the blocks' parents do not."""
    from torch._dynamo.utils import counters

    from bmtwrap.wrap.compiled import compiled_outside_blocks

    llama = tiny_llama()
    assert compiled_outside_blocks(llama, list(llama.model.layers)) == [("model.norm", llama.model.norm)]
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                                 n_positions=32))
    assert compiled_outside_blocks(gpt2, list(gpt2.transformer.h)) == []

    torch._dynamo.reset()
    counters.clear()
    model = bmt.wrap(tiny_llama(), compile={"backend": "aot_eager"})
    losses, state = _train(model)
    assert not model.model.norm.forward.is_eager()
    assert counters["stats"]["unique_graphs"] == 2  # one for both blocks, one for the final norm
    eager_losses, eager_state = _train(bmt.wrap(tiny_llama(), compile=False))
    assert losses == pytest.approx(eager_losses, rel=1e-6) and _max_gap(state, eager_state) <= 1e-6


def test_a_hook_added_after_compilation_runs(world):
    """Dynamo guards on the blocks' hooks while compiling them: a forward hook registered after the first step makes
    the block compile again with it, instead of running the graph traced without it."""
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    losses = []
    for compile in ({"backend": "aot_eager"}, False):
        model = bmt.wrap(tiny_llama(), compile=compile)
        model(input_ids=ids, labels=ids).loss.backward()
        model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out * 0.5)
        losses.append(model(input_ids=ids, labels=ids).loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


class _Breaking(torch.nn.Module):
    """A layer dynamo cannot trace as one graph."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        x = torch.tanh(self.linear(x))
        torch._dynamo.graph_break()
        return x * 2


def test_a_block_with_a_graph_break_compiles_in_pieces(world):
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[_Breaking() for _ in range(3)])
    model = bmt.wrap(copy.deepcopy(ref), compile={"backend": "aot_eager"})
    x = torch.randn(4, 8)
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (model(x) ** 2).mean().backward()
    assert not [w for w in caught if "did not compile" in str(w.message)]
    assert counters["stats"]["unique_graphs"] >= 2  # two pieces per layer
    (ref(x) ** 2).mean().backward()
    grads = bmt.full_grad_dict(model)
    assert max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters()) <= 1e-6


def test_a_model_error_is_raised_as_eager_mode_raises_it(world):
    model = bmt.wrap(tiny_llama(), compile={"backend": "aot_eager"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(Exception, match="size|shape|dimension"):
            model(input_ids=torch.zeros(2, 10, 3, dtype=torch.long))
    assert not [w for w in caught if "did not compile" in str(w.message)]


def test_compile_options():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert compile_options("auto", cpu) is None and compile_options(False, cuda) is None
    assert compile_options(True, cpu) == {"fullgraph": True}
    assert compile_options({"mode": "max-autotune"}, cpu) == {"fullgraph": True, "mode": "max-autotune"}
    assert compile_options({"fullgraph": False}, cpu) == {"fullgraph": False}
    with pytest.raises(ValueError, match="compile must be True, False, 'auto' or a dict"):
        compile_options("fast", cpu)


def test_calls_in_evaluation_or_without_gradients_or_labels_return_logits(world):
    ref = tiny_llama()
    model = bmt.wrap(copy.deepcopy(ref))
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out, expect = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    assert out.logits is not None and torch.allclose(out.logits, expect.logits, atol=1e-5)
    assert out.loss.item() == pytest.approx(expect.loss.item(), rel=1e-6)
    assert model(input_ids=ids).logits.shape == (2, 10, 64)
    model.eval()  # evaluation mode, with gradients: transformers' loss and logits too
    assert model(input_ids=ids, labels=ids).logits.shape == (2, 10, 64)
    model.train()
    trained = model(input_ids=ids, labels=ids)
    assert trained.logits is None and list(trained.keys())[0] == "loss"
    assert trained.to_tuple()[0] is trained.loss


def test_labels_of_another_shape_are_named(world):
    model = bmt.wrap(tiny_llama())
    ids = torch.randint(0, 64, (2, 10))
    with pytest.raises(ValueError, match="labels hold 18 tokens but the model's last hidden state 20"):
        model(input_ids=ids, labels=ids[:, :9])


def test_a_subclass_with_its_own_forward_keeps_transformers_loss(world):
    class Scaled(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    torch.manual_seed(0)
    model = bmt.wrap(Scaled(tiny_llama().config))
    ids = torch.randint(0, 64, (2, 10))
    assert model(input_ids=ids, labels=ids).logits is not None
