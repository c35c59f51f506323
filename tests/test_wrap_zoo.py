"""``bmt.wrap`` on many architectures equals the same model unwrapped, at world sizes 1 to 3 (gloo, CPU).

tests/dist_cases/zoo.py runs every case in float64 and in float32, all in one process group per
world size (Transformers is imported once per process): Hugging Face models built from tiny configs
(GPT-2, Llama with tied and untied embeddings, BERT, T5, Qwen2, Mistral, OPT, ViT, Mixtral,
Qwen2-MoE, Gemma 3, Phi-3, BART) and plain torch models (a ModuleList transformer, an nn.Sequential
stack, a residual CNN, an MLP cut by size, a layer reused at two depths, tied weights (a matmul with
the embedding, a Linear sharing it, one Linear weight shared by two blocks), a LoRA adapter over a
frozen base, steps that run fewer blocks or another order, training on after a failed backward).

Each case and dtype: the detected blocks; three AdamW steps (lr 1e-3, eps 1e-6), each rank of the
wrapped model on its share of a batch of 6, the reference holding the wrapped model's parameters at
every step (zoo.py's [Note: one trajectory]): at every step the loss averaged over ranks and every
gradient against the reference's, then the reference's AdamW step on the wrapped model's gradients
against the wrapped model's parameters after its own step; then the state-dict keys. The references
(zoo.py's docstring has the measurements; its [Note: gradients that are zero in exact arithmetic]
says how gradients are compared):

- float64: the unwrapped model on the whole batch. Shows that the wrapped model trains as the
  unwrapped one does on the whole batch: rounding is ~1e-15 for plain models, up to ~1e-6 for
  Hugging Face models that compute parts in float32 even in a float64 model, far below the limits.
- float32: what data-parallel training computes on the same split, in one process: the unwrapped
  model on each rank's share alone, the shares' gradients summed and divided by the world size, the
  loss the mean of the shares' losses. (In float32 the whole batch and a split of it differ by
  rounding near the limits, which has nothing to do with bmtwrap.) Shows that bmtwrap computes what
  DDP computes, at the spec's precision: what is left is the order of sums (bitwise equal mostly at
  world sizes 1 and 2; a few ulp at 3), up to 9e-7 relative in gradients.

Limits, both dtypes: loss relative 1e-5. Gradients: 1e-5 of the tensor's largest value (floored at
1e-4 of the model's largest gradient; the raw per-tensor ratio is reported too). Parameters after
each step: bit for bit AdamW's on the same gradients. A missed, doubled or stale gradient is off by
O(1) relative.
"""

import pytest

from launch import run_cases

WORLD_SIZES = [1, 2, 3]
HF_CASES = ["gpt2", "llama_tied", "llama_untied", "bert_mlm", "t5", "qwen2", "mistral", "opt", "vit", "mixtral",
            "qwen2_moe", "gemma3", "phi3", "bart"]
PLAIN_CASES = ["plain_transformer", "sequential_stack", "cnn_residual", "mlp_by_size", "layer_reuse_0101",
               "tied_embedding_matmul", "tied_head_linear", "shared_linear_across_blocks", "varying_order",
               "lora_llama", "recover_after_failed_backward"]
CASES = HF_CASES + PLAIN_CASES
DTYPES = ["float64", "float32"]  # float64 against the whole batch, float32 against the split (see above)

LOSS_REL = 1e-5
GRAD_REL = 1e-5


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def results(request):
    return request.param, run_cases("zoo.py", request.param)


def _key(name, dtype):
    return f"{name}/{dtype}"  # zoo.py's result_key


def _case(results, name, dtype, *, need_training=True):
    world, all_results = results
    key = _key(name, dtype)
    assert key in all_results, f"world {world}: zoo.py reported no case {key!r}"
    result = all_results[key]
    if "skipped" in result:
        pytest.skip(result["skipped"])
    if need_training:
        assert "error" not in result, f"world {world}, {key}: {result['error']}"
    return world, result


def test_every_case_reported(results):
    world, all_results = results
    expected = sorted(_key(name, dtype) for name in CASES for dtype in DTYPES)
    assert sorted(all_results) == expected, f"world {world}: zoo.py ran {sorted(all_results)}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_detected_blocks(results, name, dtype):
    world, r = _case(results, name, dtype, need_training=False)
    where = f"world {world}, {name} ({dtype})"
    assert "blocks" in r, f"{where}: failed before planning: {r.get('error')}"
    if r["expected"] is None:
        detail = f"rule {r['rule']!r}, blocks {r['blocks']}"
        assert r["blocks_ok"], f"{where}: expected more than one block cut by size, got {detail}"
    else:
        assert r["blocks_ok"], f"{where}: detected blocks {r['blocks']}, expected one of {r['expected']}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_training_matches_unwrapped(results, name, dtype):
    world, r = _case(results, name, dtype)
    where = f"world {world}, {name} ({dtype}, reference: {r['reference']})"
    assert r["keys_match"], f"{where}: full_state_dict keys differ from the unwrapped model's state_dict keys"
    assert r["grad_keys_match"], f"{where}: full_grad_dict keys differ from the unwrapped model's parameter names"
    assert r["loss_rel"] <= LOSS_REL, (
        f"{where}: loss differs by {r['loss_rel']:.3g} (relative); per step {r['loss_rel_per_step']}")
    assert r["grad_rel"] <= GRAD_REL, (
        f"{where}: gradient of {r['grad_worst']} at step {r['grad_worst_step']} differs by {r['grad_worst_abs']:.3g} "
        f"({r['grad_rel']:.3g} relative to max(its largest reference value {r['grad_worst_scale']:.3g}, "
        f"floor {r['grad_floor']:.3g}); {r['grad_worst_raw_rel']:.3g} relative to its own largest value); "
        f"per step {r['grad_rel_per_step']}; largest raw per-tensor ratio {r['grad_raw_rel']:.3g} "
        f"({r['grad_raw_worst']}, step {r['grad_raw_worst_step']})")
    assert r["param_abs"] == 0, (
        f"{where}: after AdamW step {r['param_worst_step']}, {r['param_worst']} differs from AdamW's on the same "
        f"gradients by {r['param_abs']:.3g}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_trains_only_the_adapters(results, dtype):
    world, r = _case(results, "lora_llama", dtype)
    where = f"world {world} ({dtype})"
    assert r["n_trainable"] > 0 and not r["trainable_not_lora"], f"{where}: trainable: {r['trainable_not_lora']}"
    assert not r["lora_without_grad"], f"{where}: LoRA parameters without a gradient: {r['lora_without_grad']}"
    assert not r["frozen_with_grad"], f"{where}: frozen parameters with a gradient: {r['frozen_with_grad']}"
    assert not r["frozen_changed"], f"{where}: frozen parameters changed by AdamW: {r['frozen_changed']}"
