"""``bmt.from_pretrained`` gives exactly what transformers' own ``from_pretrained`` gives, at world sizes 1 to 3.

tests/dist_cases/hf_import.py saves a seeded random model of every Hugging Face family of the zoo
(GPT-2, Llama tied and untied, BERT, T5, Qwen2, Mistral, OPT, ViT, Mixtral, Qwen2-MoE, Gemma 3,
Phi-3, BART) plus Gemma and Gemma 2 with ``save_pretrained``, and loads the folder both ways in
float32. Every parameter and every buffer (non-persistent ones included: rotary ``inv_freq``,
Gemma's ``embed_scale``, which no checkpoint holds and the model's own initialiser computes) must
be bitwise equal, and so must the loss of one batch: loading only moves bytes, and the forward of
the sharded model runs the same kernels on the same values. A model built on the meta device and
initialised by ``bmt.materialize`` must have the buffers of the model built on the CPU.
"""

import pytest

from launch import run_cases

WORLD_SIZES = [1, 2, 3]
FAMILIES = ["gpt2", "llama_tied", "llama_untied", "bert_mlm", "t5", "qwen2", "mistral", "opt", "vit", "mixtral",
            "qwen2_moe", "gemma3", "phi3", "bart", "gemma", "gemma2"]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def results(request, tmp_path_factory):
    return request.param, run_cases("hf_import.py", request.param, str(tmp_path_factory.mktemp("hf_import")))


def _result(results, key):
    world, all_results = results
    assert key in all_results, f"world {world}: hf_import.py reported no case {key!r}"
    result = all_results[key]
    assert "error" not in result, f"world {world}, {key}: {result['error']}"
    return world, result


def test_every_family_reported(results):
    world, all_results = results
    expected = sorted(f"{kind}/{name}" for kind in ("import", "materialize") for name in FAMILIES)
    assert sorted(all_results) == expected, f"world {world}: hf_import.py ran {sorted(all_results)}"


@pytest.mark.parametrize("family", FAMILIES)
def test_from_pretrained_equals_transformers(results, family):
    world, r = _result(results, f"import/{family}")
    assert r["params_unequal"] == [], f"world {world}: parameters differ from transformers': {r['params_unequal']}"
    assert r["buffers_unequal"] == [], (f"world {world}: buffers differ from transformers' {r['buffers_unequal']} "
                                        f"(buffers: {r['buffers']})")
    assert r["same_on_every_rank"], f"world {world}: another rank found a difference"
    assert r["loss_rel"] == 0.0, f"world {world}: loss {r['loss']} against transformers' {r['ref_loss']}"
    assert r["eval"], "from_pretrained returns the model in eval mode, as transformers does"


@pytest.mark.parametrize("family", FAMILIES)
def test_materialize_computes_every_buffer(results, family):
    world, r = _result(results, f"materialize/{family}")
    assert r["buffers_unequal"] == [], (f"world {world}: after materialize, buffers differ from the model built "
                                        f"on the CPU: {r['buffers_unequal']}")
    assert r["same_on_every_rank"], f"world {world}: another rank found a difference"


def test_gemma_buffers_are_covered(results):
    """The buffers that were left uninitialised are among those compared."""
    _, r = _result(results, "import/gemma2")
    assert "model.embed_tokens.embed_scale" in r["buffers"]
    assert "model.rotary_emb.inv_freq" in r["buffers"]
