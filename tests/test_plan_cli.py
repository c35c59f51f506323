"""``python -m bmtwrap plan``: which model class it builds from a folder, and the blocks it prints.

A folder saved by ``save_pretrained`` names its class in ``config.architectures``; the plan must be
of that class (a BART folder is an encoder-decoder, not ``BartForCausalLM``'s decoder alone), with
the Auto classes as the fallback and ``--model-class`` as the override. The command runs in this
process (``main([...])``); the models are tiny and random, and the plan builds them on the meta device.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List

import pytest
import transformers as T

from bmtwrap.__main__ import main

SMALL = dict(vocab_size=64, max_position_embeddings=32)

MODELS = {
    "bart": lambda: T.BartForConditionalGeneration(T.BartConfig(
        d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, **SMALL)),
    "bert": lambda: T.BertForMaskedLM(T.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                    intermediate_size=32, **SMALL)),
    "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                                          num_decoder_layers=2, num_heads=2)),
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                                      num_attention_heads=2, num_key_value_heads=1, **SMALL)),
}

EXPECTED = {  # the class the folder was saved from, and its blocks: every repeated layer, the encoder's too
    "bart": ("BartForConditionalGeneration", ["model.encoder.layers.0", "model.encoder.layers.1",
                                              "model.decoder.layers.0", "model.decoder.layers.1"]),
    "bert": ("BertForMaskedLM", ["bert.encoder.layer.0", "bert.encoder.layer.1"]),
    "t5": ("T5ForConditionalGeneration", ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]),
    "llama": ("LlamaForCausalLM", ["model.layers.0", "model.layers.1"]),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("saved")
    for name, make in MODELS.items():
        make().save_pretrained(root / name)  # records the class in config.json's architectures
    return {name: root / name for name in MODELS}


def _plan(capsys, folder: Path, *options: str) -> tuple:
    """The first line (the class built and why), the plan's class and its block names."""
    assert main(["plan", str(folder), *options]) == 0
    lines = capsys.readouterr().out.splitlines()
    planned = re.match(r"WrapPlan for (\w+) over", lines[1]).group(1)
    rows = [m.group(1) for line in lines[2:] if (m := re.match(r"  (\S+)\s+\w+\s+[\d,]+\s+[\d.]+ MiB", line))]
    assert rows[0] == "(root)"
    return lines[0], planned, rows[1:]


def _without_architectures(folder: Path, tmp_path: Path, architectures: List[str]) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = architectures
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path / "config.json"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_plan_builds_the_class_the_config_names(folders, capsys, name):
    chosen, planned, blocks = _plan(capsys, folders[name])
    cls, expected_blocks = EXPECTED[name]
    assert chosen == f"model class: {cls} (named by config.architectures)"
    assert planned == cls
    assert blocks == expected_blocks


def test_model_class_overrides_the_config(folders, capsys):
    chosen, planned, blocks = _plan(capsys, folders["bart"], "--model-class", "BartForCausalLM")
    assert chosen == "model class: BartForCausalLM (given by --model-class)"
    assert planned == "BartForCausalLM" and blocks == ["model.decoder.layers.0", "model.decoder.layers.1"]


@pytest.mark.parametrize("architectures, why", [
    ([], "config.architectures names no class"),
    (["BartForSomethingElse"], "config.architectures names BartForSomethingElse, which transformers does not have"),
])
def test_auto_classes_choose_when_the_config_names_no_usable_class(folders, capsys, tmp_path, architectures, why):
    chosen, planned, _ = _plan(capsys, _without_architectures(folders["bart"], tmp_path, architectures))
    assert chosen == f"model class: BartForCausalLM (AutoModelForCausalLM's choice: {why}; give --model-class to " \
                     "build another)"
    assert planned == "BartForCausalLM"


def test_model_class_that_transformers_lacks(folders):
    # The class the folder was saved from comes first.
    with pytest.raises(SystemExit, match=r"--model-class BartForEverything: transformers has no model class of that "
                                         r"name; give --model-class BartForConditionalGeneration; the others for a "
                                         r"BartConfig: BartForCausalLM, BartModel, "):
        main(["plan", str(folders["bart"]), "--model-class", "BartForEverything"])


def test_model_class_of_another_model(folders):
    with pytest.raises(SystemExit, match=r"--model-class BertForMaskedLM builds from a BertConfig, but the config is a "
                                         r"LlamaConfig; give --model-class LlamaForCausalLM; the others for a "
                                         r"LlamaConfig: LlamaModel, Llama") as refused:
        main(["plan", str(folders["llama"]), "--model-class", "BertForMaskedLM"])
    assert "Llama4" not in str(refused.value), "another family's class suggested"


def test_model_class_suggestion_without_architectures(folders, tmp_path):
    # Nothing recorded: the family's causal LM is the first suggestion.
    config = _without_architectures(folders["llama"], tmp_path, [])
    with pytest.raises(SystemExit, match=r"LlamaConfig; give --model-class LlamaForCausalLM; the others"):
        main(["plan", str(config), "--model-class", "BertForMaskedLM"])


def test_a_gpu_budget_plans_the_blocks_that_fit(folders, capsys):
    """With --max-gpu-memory, --checkpoint auto keeps blocks first to last while the estimate fits, and says so."""
    import bmtwrap as bmt

    import torch
    with torch.device("meta"):
        model = MODELS["llama"]()
    shape = dict(batch_size=2, seq_len=4096)  # activations that outweigh the gradients, as in a real model
    fixed = bmt.plan(model, **shape)
    assert fixed.fits is None and all(b.checkpoint for b in fixed.blocks)
    roomy = bmt.plan(model, **shape, max_gpu_memory="4GiB")
    assert roomy.fits and [b.checkpoint for b in roomy.blocks] == [False, False]
    assert roomy.memory.total > fixed.memory.total  # kept activations cost more than the checkpointed inputs
    # At least 512 MiB of margin, and 1.3 GiB a process takes outside torch's allocator (one rank).
    reserved = 512 * 2**20 + int(1.3 * 2**30)
    tight = bmt.plan(model, **shape, max_gpu_memory=fixed.memory.total + reserved)
    assert [b.checkpoint for b in tight.blocks] == [True, True] and tight.fits  # no room beyond them
    one = roomy.memory.total - fixed.memory.total  # two blocks' activations, less their checkpointed inputs
    between = bmt.plan(model, **shape, max_gpu_memory=fixed.memory.total + reserved + one // 2)
    assert [b.checkpoint for b in between.blocks] == [False, True]
    assert not bmt.plan(model, **shape, max_gpu_memory=reserved + 100).fits
    two = bmt.plan(model, world_size=2, **shape, max_gpu_memory=fixed.memory.total + reserved)
    assert not two.fits  # NCCL's buffers: 0.3 GiB more outside the allocator in a job of two

    main(["plan", str(folders["llama"]), "--batch-size", "2", "--seq-len", "16", "--max-gpu-memory", "4GiB"])
    out = capsys.readouterr().out
    assert "max_gpu_memory 4.00 GiB, less a margin and the memory outside torch's allocator: 2.20 GiB; fits" in out
    with pytest.raises(SystemExit, match="--max-gpu-memory must be a size such as '24GiB'"):
        main(["plan", str(folders["llama"]), "--max-gpu-memory", "lots"])


def test_no_compile_plans_eager_blocks(folders, capsys):
    """--no-compile plans the eager blocks' larger recomputation, as plan(compile=False)."""
    shape = ["--batch-size", "64", "--seq-len", "4096"]  # GiBs of activations, even at a width of 16

    def activations(*options: str) -> float:
        assert main(["plan", str(folders["llama"]), *shape, *options]) == 0
        line = next(line for line in capsys.readouterr().out.splitlines() if "activations" in line)
        return float(re.search(r"activations\s+([\d.]+) GiB", line).group(1))

    assert activations("--no-compile") > activations() > 0


def test_tp_size_counts_one_ranks_slices(folders, tmp_path, capsys):
    """--tp-size 2 (wrap(tp_size=2)): a block holds the norms whole and half of every projection; heads that do
    not divide are refused with the sizes that do."""
    config = json.loads((folders["llama"] / "config.json").read_text())
    config["num_key_value_heads"] = 2  # the test Llama's one key/value head divides among no group
    (tmp_path / "config.json").write_text(json.dumps(config))

    def block_params(*options: str) -> int:
        assert main(["plan", str(tmp_path / "config.json"), "--world-size", "4", *options]) == 0
        out = capsys.readouterr().out
        return int(re.search(r"model\.layers\.0\s+\w+\s+([\d,]+)", out).group(1).replace(",", ""))

    hidden = config["hidden_size"]
    norms = 2 * hidden
    assert (block_params() - norms) // 2 + norms == block_params("--tp-size", "2")
    with pytest.raises(SystemExit, match="--tp-size 2: wrap\\(tp_size=2\\): this LlamaForCausalLM has 2 attention "
                                         "heads and 1 key/value heads.*valid tp sizes here \\(world size 4\\): 1"):
        main(["plan", str(folders["llama"]), "--world-size", "4", "--tp-size", "2"])
    with pytest.raises(SystemExit, match="--tp-size 3 must divide --world-size 4"):
        main(["plan", str(folders["llama"]), "--world-size", "4", "--tp-size", "3"])


def test_fp8_names_the_recipe_and_the_linears_it_converts(folders, capsys):
    """--fp8 rowwise (wrap(fp8="rowwise")): the plan counts the blocks' linear layers computed in float8: of each
    layer's 7, all but k_proj and v_proj, whose 8 outputs (one key/value head of 8) are no multiple of 16."""
    assert main(["plan", str(folders["llama"]), "--fp8", "rowwise"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"float8 compute: rowwise: (\d+) of the blocks' (\d+) linear layers in float8", out)
    assert found and (found.group(1), found.group(2)) == (str(2 * 5), str(2 * 7)), out
    assert main(["plan", str(folders["llama"])]) == 0
    assert "float8" not in capsys.readouterr().out
