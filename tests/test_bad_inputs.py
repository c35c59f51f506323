"""The table of bad inputs in docs/errors.md, one test per row (world size 1, one process).

Each row of ``ROWS`` makes the mistake and checks what the user sees: the exception type and the
words of its message that name the problem and the fix. Rows whose mistake needs several ranks or
a killed process point to the test that makes it (``covered_by``). ``test_table_matches_the_docs``
keeps docs/errors.md and this list the same, row by row.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import pytest
import torch
from torch import nn

import bmtwrap as bmt
import bmtwrap.engine.dist
from launch import run_python

ROOT = Path(__file__).resolve().parents[1]


class Row(NamedTuple):
    id: str
    error: type
    match: str  # a regular expression the message must contain
    make: Optional[Callable[[Path], Any]] = None  # makes the mistake (given a scratch folder)
    covered_by: Optional[str] = None  # "tests/<file>.py::<test>" when another test makes it


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    made_here = not bmtwrap.engine.dist.is_initialized()
    bmt.init_distributed(seed=0)
    yield
    if made_here:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        bmtwrap.engine.dist._CONTEXT = None


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))


def wrapped() -> nn.Module:
    return bmt.wrap(mlp())


def saved(folder: Path, name: str = "model.safetensors") -> Path:
    path = folder / name
    bmt.save(wrapped(), path)
    return path


def truncated(folder: Path) -> None:
    path = saved(folder)
    path.write_bytes(path.read_bytes()[:-40])
    bmt.load(wrapped(), path)


def wrong_keys(folder: Path) -> None:
    path = folder / "other.pt"
    torch.save({"weight": torch.zeros(3)}, path)
    bmt.load(wrapped(), path)


def wrong_shape(folder: Path) -> None:
    state = mlp().state_dict()
    state["0.weight"] = torch.zeros(3, 3)
    path = folder / "shape.pt"
    torch.save(state, path)
    bmt.load(wrapped(), path)


def optimizer_of_another_model(folder: Path) -> None:
    other = bmt.optim.AdamOptimizer(bmt.wrap(nn.Linear(3, 3)).parameters())
    optimizer = bmt.optim.AdamOptimizer(wrapped().parameters())
    optimizer.load_state_dict(other.state_dict())


def nan_step(folder: Path) -> None:
    model = wrapped()
    optimizer = bmt.optim.AdamOptimizer(model.parameters())
    (model(torch.ones(2, 4)).sum() * float("nan")).backward()
    optimizer.step()


def unwrapped_copy_optimizer(folder: Path) -> None:
    wrapped()
    bmt.optim.AdamOptimizer(mlp().parameters())


def mixed_devices(folder: Path) -> None:
    layer = nn.Linear(2, 2)
    layer.bias = nn.Parameter(torch.zeros(2, device="meta"))
    bmt.wrap(layer)


def meta_model_run(folder: Path) -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    bmt.wrap(model)(torch.ones(1, 4))


def cast_after_wrap(folder: Path) -> None:
    model = wrapped()
    model.double()
    model(torch.ones(1, 4, dtype=torch.float64))


def init_without_master_addr(folder: Path) -> None:
    """init_distributed in a process started with RANK and WORLD_SIZE but no MASTER_ADDR/MASTER_PORT."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    _, output = run_python("import bmtwrap; bmtwrap.init_distributed()", env=dict(env, RANK="0", WORLD_SIZE="2"),
                           timeout=120)
    raise RuntimeError(output)


def t5_without_model_class(folder: Path) -> None:
    import transformers

    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    transformers.T5ForConditionalGeneration(config).save_pretrained(folder / "t5")
    bmt.from_pretrained(folder / "t5")


def cli(*args: str) -> Callable[[Path], None]:
    """``python -m bmtwrap ARGS``, through its main() in this process (tests/test_wrap.py::test_plan_command starts
    the command itself): a mistake is a SystemExit with the message Python prints."""
    def run(folder: Path) -> None:
        from bmtwrap.__main__ import main

        main(list(args))
    return run


ROWS = [
    # init_distributed
    Row("init-zero-level", ValueError, r"zero_level must be 2 or 3, got 1", covered_by="tests/test_errors.py::test_init_distributed_rejects_zero_level_1"),
    Row("init-pipeline", ValueError, r"pipe_size \* tp_size = 2 \* 1 must divide the world size 1; start a multiple "
        r"of 2 processes", lambda f: bmt.init_distributed(pipe_size=2)),
    Row("init-tensor-parallel", NotImplementedError, r"init_distributed\(shard_size=2\) with tp_size=2: .* leave "
        r"shard_size out", lambda f: bmt.init_distributed(tp_size=2, shard_size=2)),
    Row("init-sequence-parallel", NotImplementedError, r"sequence parallelism is not supported \(sp_size=2\)",
        lambda f: bmt.init_distributed(sp_size=2)),
    Row("init-timeout", ValueError, r"timeout must be a positive, finite time, got -5",
        lambda f: bmt.init_distributed(timeout=-5)),
    Row("init-without-rendezvous", RuntimeError, r"RANK and WORLD_SIZE are set \(rank 0 of 2\) but MASTER_ADDR and "
        r"MASTER_PORT are not: .* Start the program with torchrun", init_without_master_addr),
    Row("collective-rank-killed", bmt.CollectiveError, r"rank 1 is dead: no heartbeat for 3 s",
        covered_by="tests/test_faults.py::test_a_killed_rank_is_named_by_the_survivors"),
    Row("collective-rank-hung", bmt.CollectiveError, r"timed out after .* rank 1 is alive but has not reached collective",
        covered_by="tests/test_faults.py::test_a_hung_rank_is_named_when_the_timeout_fires"),
    Row("collective-ranks-diverge", bmt.CollectiveError, r"the ranks issue different collectives \(found by check_collectives=True\)",
        covered_by="tests/test_faults.py::test_check_collectives_names_both_blocks_and_their_ranks"),
    # wrap and plan
    Row("wrap-not-a-module", TypeError, r"wrap expects an nn.Module, got int", lambda f: bmt.wrap(3)),
    Row("wrap-checkpoint-sometimes", ValueError, r"checkpoint must be True, False or 'auto', got 'sometimes'",
        lambda f: bmt.wrap(mlp(), checkpoint="sometimes")),
    Row("wrap-zero-level", ValueError, r"zero_level must be 2 or 3, got 4", lambda f: bmt.wrap(mlp(), zero_level=4)),
    Row("wrap-max-gpu-memory", ValueError, r"max_gpu_memory must be a size such as '24GiB', '80GB' or '512MiB'",
        lambda f: bmt.wrap(mlp(), max_gpu_memory="24 gigs")),
    Row("wrap-unknown-layer-class", ValueError, r"layer class 'Conv9d' is not in this model",
        lambda f: bmt.wrap(mlp(), layers=["Conv9d"])),
    Row("wrap-container-as-layer", ValueError, r"has no forward of its own: a block must be a module that is called",
        lambda f: bmt.wrap(nn.Sequential(nn.ModuleList([nn.Linear(2, 2)])), layers=[nn.ModuleList])),
    Row("wrap-mixed-devices", ValueError, r"mixes devices .* move the module to one device", mixed_devices),
    Row("wrap-again-other-options", ValueError, r"already wrapped with .* wrap it once",
        lambda f: bmt.wrap(wrapped(), checkpoint=False)),
    Row("wrap-model-with-blocks", ValueError, r"already contains bmtwrap Blocks",
        lambda f: bmt.wrap(nn.Sequential(bmt.Block(nn.Linear(2, 2))))),
    Row("wrap-tp-size-world", ValueError, r"wrap\(tp_size=2\): tp_size must divide the world size 1; give one of 1",
        lambda f: bmt.wrap(mlp(), tp_size=2)),
    Row("wrap-tp-heads", ValueError, r"tp_size must divide both; valid tp sizes here",
        covered_by="tests/test_hf_tensor_parallel.py::test_bad_sizes_and_models_name_the_fix"),
    Row("wrap-tp-no-plan", ValueError, r"this Sequential has none: give a transformers model",
        covered_by="tests/test_hf_tensor_parallel.py::test_bad_sizes_and_models_name_the_fix"),
    Row("wrap-fp8-without-float8", RuntimeError, r"wrap\(fp8='tensorwise'\) needs a CUDA GPU with float8 tensor cores",
        covered_by="tests/test_wrap.py::test_fp8_is_refused_without_float8_tensor_cores_and_leaves_the_model_as_it_was"),
    Row("wrap-fp8-keep-ends", ValueError, r"Float8\(keep_ends=2\): the model has 4 blocks, .* leaves none in float8",
        covered_by="tests/test_wrap.py::test_fp8_refuses_ends_that_leave_no_block_in_float8_and_leaves_the_model_as_it_was"),
    Row("run-meta-model-unloaded", RuntimeError, r"built on the meta device .* bmtwrap.materialize\(model\) or load",
        meta_model_run),
    Row("meta-buffer-not-computed", ValueError, r"was built on the meta device and has no value",
        covered_by="tests/test_wrap.py::test_a_buffer_nothing_computes_is_named"),
    Row("cast-after-wrap", RuntimeError, r"was replaced after sharding .* cast or move the model before sharding",
        cast_after_wrap),
    Row("plan-world-size", ValueError, r"world_size must be >= 1, got 0", lambda f: bmt.plan(mlp(), world_size=0)),
    # Block and TransformerBlockList
    Row("block-not-a-module", TypeError, r"Block expects an nn.Module, got str", lambda f: bmt.Block("layer")),
    Row("block-of-a-block", TypeError, r"Block got a Block", lambda f: bmt.Block(bmt.Block(nn.Linear(2, 2)))),
    Row("block-mode", ValueError, r"mode must be 'BLOCK' or 'PIPE', got 'pipe'",
        lambda f: bmt.Block(nn.Linear(2, 2), mode="pipe")),
    Row("block-module-twice", ValueError, r"already belongs to another block",
        lambda f: [bmt.Block(m) for m in [nn.Linear(2, 2)] * 2]),
    Row("block-list-same-block-twice", bmt.BlockSharingError, r"is given twice .* list the plain module twice",
        lambda f: bmt.TransformerBlockList([bmt.Block(nn.Linear(2, 2))] * 2)),
    Row("block-list-num-hidden", ValueError, r"num_hidden must be >= 1, got 0",
        lambda f: bmt.TransformerBlockList([nn.Linear(2, 2)], num_hidden=0)),
    Row("pipeline-few-layers", ValueError, r"1 layer\(s\) cannot be cut into pipe_size=2 stages",
        covered_by="tests/test_pipeline.py::test_bad_input_names_the_fix"),
    Row("pipeline-micro-batches", ValueError, r"do not split into num_micro_batches=4 micro-batches",
        covered_by="tests/test_pipeline.py::test_bad_input_names_the_fix"),
    # optimizers
    Row("adam-negative-lr", ValueError, r"lr, eps and weight_decay must be >= 0",
        lambda f: bmt.optim.AdamOptimizer(wrapped().parameters(), lr=-1.0)),
    Row("adam-betas", ValueError, r"betas must be in \[0, 1\), got \(0.9, 1.5\)",
        lambda f: bmt.optim.AdamOptimizer(wrapped().parameters(), betas=(0.9, 1.5))),
    Row("adam-master-dtype", TypeError, r"the master copy must be fp32",
        lambda f: bmt.optim.AdamOptimizer(wrapped().parameters(), master_dtype=torch.float16)),
    Row("adam-unwrapped-copy", UserWarning, r"none of the 4 parameters is sharded by bmtwrap, .* after bmtwrap.wrap",
        unwrapped_copy_optimizer),
    Row("adam-state-of-another-model", ValueError, r"the state is for 2 parameters, this optimizer has 4",
        optimizer_of_another_model),
    Row("adam-nan-gradient", bmt.optim.NonFiniteGradientError, r"gradients hold inf or NaN .* nothing was updated",
        nan_step),
    Row("adam-nonfinite-option", ValueError, r"nonfinite must be one of 'raise', 'skip', 'unchecked'",
        lambda f: bmt.optim.AdamOptimizer(wrapped().parameters(), nonfinite="warn")),
    Row("manager-grad-scale", ValueError, r"grad_scale must be > 0 or None", lambda f: bmt.optim.OptimManager(grad_scale=-1)),
    Row("manager-loss-scale-in-backward", ValueError, r"steps in backward .* use OptimManager\(loss_scale=None\)",
        lambda f: bmt.optim.OptimManager(loss_scale=1024).add_optimizer(
            bmt.optim.AdamOffloadOptimizer(wrapped().parameters(), step_in_backward=True))),
    # kernels
    Row("kernel-wrong-dtype", TypeError, r"must be a floating-point tensor|dtype",
        lambda f: bmt.ops.has_inf_nan(torch.zeros(3, dtype=torch.int32))),
    # save / load
    Row("load-missing-file", FileNotFoundError, r"missing.pt does not exist; check the path",
        lambda f: bmt.load(wrapped(), f / "missing.pt")),
    Row("load-a-folder", ValueError, r"is a folder", lambda f: bmt.load(wrapped(), f)),
    Row("load-truncated-file", ValueError, r"truncated", truncated),
    Row("load-unexpected-keys", ValueError, r"nothing was changed \(pass strict=False .*\n  missing keys \(4\)",
        wrong_keys),
    Row("load-shape-mismatch", ValueError, r"shape", wrong_shape),
    Row("load-bit-flipped-file", ValueError, r"is corrupt: bytes \[\d+, \d+\) of .* have CRC-32",
        covered_by="tests/test_checkpoint_integrity.py::test_a_flipped_bit_is_named_on_every_rank_and_changes_nothing"),
    Row("save-unwritable-folder", RuntimeError, r"cannot write .* give a path in a folder it can create and write",
        covered_by="tests/test_checkpoint_full.py::test_unwritable_folder"),
    Row("save-disk-full", RuntimeError, r"cannot write .* No space left on device",
        covered_by="tests/test_checkpoint_full.py::test_failed_save_raises_on_every_rank_and_keeps_the_previous_file"),
    # sharded checkpoints
    Row("checkpoint-unwritable-folder", RuntimeError, r"cannot write the checkpoint in .* give a folder every rank",
        covered_by="tests/test_checkpoint_sharded.py::test_an_unwritable_folder_is_named"),
    Row("checkpoint-rank-file-missing", FileNotFoundError, r"is incomplete: .* \(rank 2's shard file, named by its index\) is missing",
        covered_by="tests/test_checkpoint_sharded.py::test_load_errors_name_the_problem_and_change_nothing"),
    Row("checkpoint-damaged-index", ValueError, r"belongs to another save|the index records",
        covered_by="tests/test_checkpoint_sharded.py::test_damaged_index"),
    Row("checkpoint-bit-flipped-shard", ValueError, r"is corrupt: bytes .* index.json records",
        covered_by="tests/test_checkpoint_integrity.py::test_a_flipped_bit_is_named_on_every_rank_and_changes_nothing"),
    Row("checkpoint-checksums-of-another-save", ValueError, r"index.json records",
        covered_by="tests/test_checkpoint_integrity.py::test_checksums_of_another_save_are_named"),
    Row("checkpoint-optimizer-of-another-model", ValueError, r"the checkpoint holds the state of an optimizer of type",
        covered_by="tests/test_checkpoint_sharded.py::test_load_errors_name_the_problem_and_change_nothing"),
    # Hugging Face import and export
    Row("hf-folder-without-safetensors", FileNotFoundError, r"holds neither model.safetensors nor",
        covered_by="tests/test_checkpoint_hf.py::test_folder_without_safetensors"),
    Row("hf-truncated-weights", ValueError, r"is not a readable safetensors file .* download or copy the checkpoint",
        covered_by="tests/test_checkpoint_integrity.py::test_truncated_hf_weights_are_named"),
    Row("hf-save-onto-a-file", ValueError, r"save_pretrained writes a folder, but .* is a file",
        covered_by="tests/test_checkpoint_hf.py::test_save_onto_a_file_is_refused"),
    Row("hf-needs-model-class", ValueError, r"holds a T5ForConditionalGeneration \(T5Config\), which "
        r"AutoModelForCausalLM cannot build; pass the class to build as model_class=, e\.g\. "
        r".*model_class=transformers\.T5ForConditionalGeneration", t5_without_model_class),
    # the plan command line
    Row("cli-missing-model", SystemExit, r"no such file or folder|does not exist|not found",
        cli("plan", "no/such/folder")),
    Row("cli-bad-world-size", SystemExit, r"world-size", cli("plan", "no/such/folder", "--world-size", "0")),
    Row("cli-unknown-model-class", SystemExit, r"--model-class \w+: transformers has no model class of that name",
        covered_by="tests/test_plan_cli.py::test_model_class_that_transformers_lacks"),
    Row("cli-model-class-of-another-model", SystemExit, r"--model-class \w+ builds from a \w+, but the config is a",
        covered_by="tests/test_plan_cli.py::test_model_class_of_another_model"),
    # bmtwrap.hf.Trainer
    Row("trainer-fsdp", NotImplementedError, r"does not support fsdp='full_shard': .* remove fsdp= and fsdp_config=",
        covered_by="tests/test_trainer.py::test_fsdp_refusal_names_the_value_given"),
    # bmtwrap.hf.SFTTrainer, DPOTrainer and ShardedTrainerMixin
    Row("trl-activation-offloading", NotImplementedError, r"does not support activation_offloading=True: .* leave "
        r"gradient_checkpointing=True", covered_by="tests/test_trl.py::test_activation_offloading_is_refused"),
    Row("trl-mixin-first", TypeError, r"lists ShardedTrainerMixin before \w+: .* goes last",
        covered_by="tests/test_trl.py::test_mixin_listed_first_is_refused"),
    # examples/finetune_hf.py: one message, exit status 2 (1: a run that did not learn)
    Row("finetune-bad-number", SystemExit, r"--steps must be >= 1, got -5",
        covered_by="tests/test_finetune_example.py::test_bad_arguments_are_named"),
    Row("finetune-missing-path", SystemExit, r"--model no-such-folder: no config.json there",
        covered_by="tests/test_finetune_example.py::test_bad_inputs_are_named_before_training"),
    Row("finetune-data-not-utf8", SystemExit, r"is not UTF-8 text: byte 0xe9 at offset \d+ .* iconv",
        covered_by="tests/test_finetune_example.py::test_bad_inputs_are_named_before_training"),
    Row("finetune-not-a-causal-lm", SystemExit, r"holds a BartForConditionalGeneration \(sequence-to-sequence\)",
        covered_by="tests/test_finetune_example.py::test_bad_inputs_are_named_before_training"),
    Row("finetune-seq-past-positions", SystemExit, r"--seq 128 is longer than the 64 positions of --model",
        covered_by="tests/test_finetune_example.py::test_bad_inputs_are_named_before_training"),
    Row("finetune-model-without-tokenizer", SystemExit, r"--model gpt2: no tokenizer files there \(none of tokenizer",
        covered_by="tests/test_finetune_example.py::test_bad_inputs_are_named_before_training"),
    Row("finetune-lora-targets", SystemExit, r"--lora-targets .*: the model has no layer named c_attn",
        covered_by="tests/test_finetune_example.py::test_bad_inputs_are_named_before_training"),
    Row("finetune-unwritable-out", SystemExit, r"cannot create the folder .* is a file; move it away or give another",
        covered_by="tests/test_finetune_example.py::test_unwritable_out_is_found_before_training"),
    Row("finetune-resume-without-checkpoint", SystemExit, r"--resume: no checkpoint in .*; train without --resume",
        covered_by="tests/test_finetune_example.py::test_resume_without_a_checkpoint"),
    Row("finetune-resume-uneven-processes", SystemExit, r"--resume on 3 processes: .* cannot share evenly",
        covered_by="tests/test_finetune_example.py::test_resume_on_processes_that_cannot_share_the_batch"),
    Row("finetune-data-not-json", SystemExit, r"--data bad.jsonl, line 3: not JSON",
        covered_by="tests/test_finetune_example.py::test_bad_records_are_named_before_training"),
    Row("finetune-data-missing-fields", SystemExit, r"no column 'messages' or .* name the columns .* with --fields",
        covered_by="tests/test_finetune_example.py::test_bad_records_are_named_before_training"),
    Row("finetune-data-empty", SystemExit, r"--data empty.jsonl: no example in it",
        covered_by="tests/test_finetune_example.py::test_bad_records_are_named_before_training"),
    Row("finetune-no-chat-template", SystemExit, r"has no chat template to render them with; give one with --chat",
        covered_by="tests/test_finetune_example.py::test_bad_records_are_named_before_training"),
    Row("finetune-pack-refused", SystemExit, r"--pack on: packing is not supported for model type 'gemma2'",
        covered_by="tests/test_finetune_example.py::test_pack_off_pads_and_a_family_packing_cannot_keep_apart"),
    Row("finetune-chat-role-refused", SystemExit, r"the chat template refuses it: .* not 'tool'",
        covered_by="tests/test_finetune_example.py::test_bad_records_the_workers_find"),
    Row("finetune-data-all-cut", SystemExit, r"every example is cut: .* give a longer --seq",
        covered_by="tests/test_finetune_example.py::test_bad_records_the_workers_find"),
    Row("finetune-too-little-data", SystemExit, r"tokens are too few for --seq 64",
        covered_by="tests/test_finetune_example.py::test_a_mistake_the_workers_find_is_one_message"),
    Row("finetune-did-not-learn", SystemExit, r"the run failed its checks .* the gradient norm was 0",
        covered_by="tests/test_finetune_example.py::test_a_model_that_cannot_learn_fails_the_run"),
    # examples/finetune_hf.py after the start: one message, exit status 1 (130: interrupted)
    Row("finetune-interrupted", SystemExit, r"interrupted at step \d+; the checkpoint of step \d+ in .* is intact",
        covered_by="tests/test_finetune_example.py::test_an_interrupt_ends_with_one_line_and_the_resume_is_exact"),
    Row("finetune-disk-full", SystemExit, r"cannot write .* \(No space left on device\)",
        covered_by="tests/test_finetune_example.py::test_a_full_disk_while_logging_is_one_message"),
    Row("finetune-out-read-only", SystemExit, r"cannot write .*log.jsonl \(Read-only file system\)",
        covered_by="tests/test_finetune_example.py::test_an_out_made_read_only_after_the_start_is_one_message"),
    Row("finetune-damaged-checkpoint", SystemExit, r"--resume: the checkpoint in .* cannot be loaded: .* is corrupt",
        covered_by="tests/test_finetune_example.py::test_a_damaged_checkpoint_is_one_message_on_resume"),
]


@pytest.mark.parametrize("row", [r for r in ROWS if r.make is not None], ids=lambda r: r.id)
def test_row(row: Row, tmp_path: Path) -> None:
    if issubclass(row.error, Warning):  # the program goes on, told what is likely wrong
        with pytest.warns(row.error, match=row.match):
            row.make(tmp_path)
    else:
        with pytest.raises(row.error, match=row.match):
            row.make(tmp_path)


@pytest.mark.parametrize("row", [r for r in ROWS if r.covered_by is not None], ids=lambda r: r.id)
def test_row_covered_elsewhere(row: Row) -> None:
    path, name = row.covered_by.split("::")
    module = importlib.import_module(Path(path).stem)
    assert callable(getattr(module, name, None)), f"{row.id}: {row.covered_by} does not exist"


def test_table_matches_the_docs() -> None:
    text = (ROOT / "docs" / "errors.md").read_text()
    documented = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and re.fullmatch(r"`[a-z0-9-]+`", cells[0]):
            documented[cells[0].strip("`")] = cells[3]
    assert list(documented) == [r.id for r in ROWS], "docs/errors.md and ROWS list different rows"
    for row in ROWS:
        assert row.error.__name__ in documented[row.id], f"{row.id}: the docs name another error than {row.error.__name__}"
    assert len(ROWS) >= 30
