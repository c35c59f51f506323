"""Hugging Face import/export (bmtwrap.checkpoint.hf) at world size 2 over gloo.

Every reference is plain transformers: source checkpoints are written by transformers'
``save_pretrained`` from seeded random models, and exported folders are read back by
``AutoModel*.from_pretrained`` without bmtwrap. Comparisons are exact (``torch.equal``): loading
and saving only move bytes.

Memory bound. ``load_pretrained`` of a ~195 MB fp32 Llama in four ~50 MB shards may grow each
rank's peak RSS by at most its shards + 2 x one decoder layer (28 MB) + 16 MB (imports and the
plan). Its shards must be written, one parameter's rows are read at a time (at most the 12.6 MB
embedding, less than a layer), and the second layer's worth covers the allocator holding a freed
read while the next is made. Loading the whole state dict instead would add the model's 195 MB to
the shards; the test checks that this would exceed the bound, so the test can fail.
"""

import re

import pytest

from launch import run_cases

ARCHS = ["llama_tied", "llama_untied", "gpt2", "t5", "mixtral", "vit"]
SHARDED = {"llama_untied", "mixtral"}  # saved with a small max_shard_size: several files and an index
MiB = 2**20


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases("checkpoint_hf.py", 2, str(tmp_path_factory.mktemp("hf")))


def _case(results, name):
    result = results[name]
    assert "error" not in result, result.get("error")
    return result


@pytest.mark.parametrize("arch", ARCHS)
def test_roundtrip_through_plain_transformers(results, arch):
    r = _case(results, f"roundtrip_{arch}")
    assert r["imported_equal"], "a gathered parameter or buffer differs from the checkpoint's model"
    assert r["eval_after_import"], "from_pretrained should return the model in eval mode, as transformers does"
    assert r["trained_changed"], "the training step changed nothing: the export check would be vacuous"
    assert r["exported_equal"], "plain transformers loads other values than the wrapped model holds"
    assert r["file_keys_as_transformers"], "the exported file names differ from what transformers itself writes"
    assert r["logits_max_abs"] <= 1e-6, f"logits differ by {r['logits_max_abs']:.3g}"
    assert r["sharded"] == (arch in SHARDED)


def test_base_model_checkpoint_into_causal_lm(results):
    r = _case(results, "base_into_causal")
    assert r["equal"] and r["inv_freq"], r


def test_causal_lm_checkpoint_into_base_model(results):
    assert _case(results, "causal_into_base")["equal"]


def test_missing_weight_is_initialised_when_not_strict(results):
    r = _case(results, "missing_initialised")
    assert r["rest_equal"] and r["warned"], r
    assert abs(r["head_std"] - 0.02) < 0.004, r["head_std"]  # LlamaConfig.initializer_range


def test_legacy_gamma_beta_names_are_renamed(results):
    r = _case(results, "legacy_names")
    assert r["file_had_gamma"], "the test file should hold the legacy names"
    assert r["equal"] and r["buffers"], r


def test_strict_mismatch_lists_every_name_and_writes_nothing(results):
    r = _case(results, "strict_mismatch")
    message = r["message"]
    assert message.startswith("ValueError: cannot load"), message
    assert "missing from the checkpoint (1): model.layers.1.mlp.up_proj.weight" in message
    assert "in the checkpoint but not in the model (1): model.layers.0.extra.weight" in message
    assert "shape mismatches (1): model.norm.weight: checkpoint (7,), model (32,)" in message
    assert r["unchanged"], "a failed load changed the model"


def test_checkpoint_of_another_architecture(results):
    message = _case(results, "other_architecture")["message"]
    assert re.search(r"ValueError: the checkpoint in .* is of another architecture \(gpt2: GPT2LMHeadModel\) "
                     r"than the model \(llama: LlamaForCausalLM\)", message), message


def test_missing_shard_file_is_named(results):
    r = _case(results, "missing_shard")
    assert r["message"].startswith(f"FileNotFoundError: model.safetensors.index.json lists shard file '{r['removed']}'")


def test_folder_without_safetensors(results):
    message = _case(results, "no_weights")["message"]
    assert "holds neither model.safetensors nor model.safetensors.index.json" in message
    assert "pytorch_model.bin" in message


def test_not_a_transformers_model(results):
    assert _case(results, "not_hf_model")["message"].startswith(
        "TypeError: load_pretrained expects a Hugging Face transformers model")


def test_from_pretrained_needs_init_distributed(results):
    assert _case(results, "not_initialised")["message"] == (
        "RuntimeError: from_pretrained shards the model over all ranks: call bmtwrap.init_distributed() first")


def test_unwrapped_meta_model_is_refused(results):
    message = _case(results, "unwrapped_meta_model")["message"]
    assert message.startswith(
        "ValueError: 'model.embed_tokens.weight' of this LlamaForCausalLM is on the meta device"), message
    assert "bmtwrap.wrap(model) first" in message


def test_save_onto_a_file_is_refused(results):
    assert re.fullmatch(r"ValueError: save_pretrained writes a folder, but .*a_file is a file",
                        _case(results, "save_onto_a_file")["message"])


def test_bad_torch_dtype(results):
    assert _case(results, "bad_dtype")["message"] == (
        "ValueError: torch_dtype must be a torch.dtype, its name or 'auto', got 'float99'")


def test_torch_dtype_casts_on_import(results):
    r = _case(results, "bf16_import")
    assert r["dtype"] == "torch.bfloat16" and r["equal"], r


def test_save_over_existing_folder(results):
    r = _case(results, "overwrite_keeps_other_files")
    assert r["names"] == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"], r
    assert r["siblings"] == [], f"temporary folders left behind: {r['siblings']}"


def test_failed_save_leaves_the_folder_as_it_was(results):
    r = _case(results, "failed_save_leaves_folder")
    assert r["message"] == "OSError: [Errno 28] No space left on device (simulated)", r["message"]
    assert r["every_rank_raised"] and r["unchanged"], r
    assert r["siblings"] == [], f"temporary folders left behind: {r['siblings']}"


def test_import_memory_is_bounded(results):
    r = _case(results, "memory")
    assert r["spot_equal"], "the loaded pieces differ from the file"
    assert r["files"] >= 3, "the memory checkpoint should span several shard files"
    bound = r["shard_bytes"] + 2 * r["layer_bytes"] + 16 * MiB
    assert bound < r["shard_bytes"] + r["model_bytes"], "the bound would not catch a load of the whole model"
    for rank, growth in enumerate(r["growth"]):
        assert growth < bound, (f"rank {rank}: peak RSS grew {growth / MiB:.0f} MiB during load_pretrained; bound "
                                f"{bound / MiB:.0f} MiB (shards {r['shard_bytes'] / MiB:.0f} MiB, model "
                                f"{r['model_bytes'] / MiB:.0f} MiB)")
