"""examples/finetune_hf.py, the README's main job, run as a user runs it: 2 CPU processes it starts itself.

Checked against references outside the example: the exported folder is loaded here by plain
transformers (and peft for an adapter) and must generate the same sample; a run stopped and resumed
must log the same losses, bit for bit, as an uninterrupted one (close ones on another number of
processes). A run that cannot learn must exit non-zero, naming why. Every mistake a user can make
in the arguments or inputs is one message and exit status 2; the ones found before torchrun starts
are tested in this process, through the example's own main().
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List

import pytest
import torch

from launch import ROOT

EXAMPLE = ROOT / "examples" / "finetune_hf.py"
SHORT = ["--processes", "2", "--steps", "8", "--warmup", "2", "--save-every", "4", "--eval-batches", "2",
         "--seq", "64", "--batch", "4", "--sample-tokens", "12"]
# A shorter run for the models made here: a few steps show whether it learns.
QUICK = ["--processes", "2", "--steps", "4", "--save-every", "0", "--eval-batches", "1", "--seq", "64", "--batch", "4",
         "--sample-tokens", "8"]


def run_example(*args: str, check: bool = True, cwd: Path = ROOT,
                wrapper: List[str] = ()) -> subprocess.CompletedProcess:
    """The example run to its end (under ``wrapper``, e.g. ``unshare ...``, where given)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([*wrapper, sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, env=env,
                          timeout=600, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"finetune_hf.py {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{(proc.stdout + proc.stderr)[-5000:]}")
    return proc


def log_lines(out: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def losses(out: Path) -> Dict[int, float]:
    return {r["step"]: r["loss"] for r in log_lines(out)}


def summary(out: Path) -> Dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def example() -> ModuleType:
    """The example as a module: its checks and judge() called here, without a process."""
    if str(EXAMPLE.parent) not in sys.path:  # the example imports finetune_hf_cli from beside it
        sys.path.insert(0, str(EXAMPLE.parent))
    spec = importlib.util.spec_from_file_location("finetune_hf", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["finetune_hf"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def refused(example: ModuleType, capsys: pytest.CaptureFixture, *argv: str) -> str:
    """The one message main() prints for a mistake found before any process starts (exit status 2)."""
    with pytest.raises(SystemExit) as leaving:
        example.main(list(argv))
    err = capsys.readouterr().err
    assert leaving.value.code == 2, err
    return err


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("full")
    run_example(*SHORT, "--out", str(out))
    return out


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SHORT stopped after step 4 (checkpoint of step 4); tests resume copies of it."""
    out = tmp_path_factory.mktemp("stopped")
    first = run_example(*SHORT, "--out", str(out), "--stop-at", "4")
    assert "continue with --resume" in first.stdout
    assert sorted(losses(out)) == [1, 2, 3, 4]
    return out


def test_the_default_learns_and_reports(full_run: Path) -> None:
    s = summary(full_run)
    log = losses(full_run)
    assert sorted(log) == list(range(1, 9)), f"steps logged: {sorted(log)}"
    assert s["world_size"] == 2
    assert log[8] < log[1] - 0.5, f"the loss did not fall: {log}"
    assert s["ppl_after"] < 0.7 * s["ppl_before"], f"held-out perplexity {s['ppl_before']} -> {s['ppl_after']}"
    assert (full_run / "checkpoint" / "index.json").is_file()
    assert s["sample"].startswith("And God said")
    assert s["failures"] == [] and s["grad_norm_max"] > 0


def test_plain_transformers_loads_the_export_and_generates_the_same_sample(full_run: Path) -> None:
    import transformers

    folder = full_run / "hf"
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer("And God said", return_tensors="pt")["input_ids"]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id)
    s = summary(full_run)
    assert tokenizer.decode(out[0], skip_special_tokens=True) == s["sample"]
    assert s["reloaded_check_loss"] == pytest.approx(s["check_loss"], rel=1e-5)


def _as_a_terminal_job() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.nice(10)


def interrupted(out: Path, after_step: int, *args: str) -> subprocess.CompletedProcess:
    """The example stopped by Ctrl-C once it has logged ``after_step``: SIGINT to its process group, as a
    terminal sends it. It starts with SIGINT's default action, as a terminal's foreground job does, whatever
    this process has (a shell without job control starts background jobs with SIGINT ignored, and Python
    keeps ignoring it), and at a lower priority than this process, so that on a busy machine the watch here
    still sees the step as it is logged, not after the last one (a short run's later steps take a second)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    begun = time.time()
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), *args, "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                            preexec_fn=_as_a_terminal_job)
    log = out / "log.jsonl"
    while proc.poll() is None and time.time() < begun + 300:
        if log.is_file() and log.stat().st_mtime >= begun and len(log_lines(out)) >= after_step:
            break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def the_one_message(proc: subprocess.CompletedProcess, status: int) -> str:
    """The one line a failed run leaves on stderr besides the progress bar: no traceback, the exit status."""
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("fine-tune:")]
    assert proc.returncode == status and len(lines) == 1, f"exit status {proc.returncode}:\n{proc.stderr[-5000:]}"
    assert "Traceback" not in proc.stdout + proc.stderr
    return lines[0]


def test_an_interrupt_ends_with_one_line_and_the_resume_is_exact(full_run: Path, stopped_run: Path,
                                                                  tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(stopped_run, out)
    stopped = interrupted(out, 5, *SHORT, "--resume")
    message = the_one_message(stopped, 130)
    logged, saved = log_lines(out)[-1]["step"], json.loads((out / "checkpoint" / "index.json").read_text())["step"]
    assert message == (f"finetune_hf.py: interrupted at step {logged}; the checkpoint of step {saved} in "
                       f"{out / 'checkpoint'} is intact; continue with --resume")
    assert logged >= 5 and not (out / "errors.log").exists()
    # As a run killed while logging leaves its log: the last line cut short.
    with (out / "log.jsonl").open("a") as log:
        log.write('{"st')
    run_example(*SHORT, "--out", str(out), "--resume")
    assert [r["step"] for r in log_lines(out)] == list(range(1, 9)), "the log repeats or lacks steps"
    resumed, uninterrupted = losses(out), losses(full_run)
    assert resumed == uninterrupted, f"resumed {resumed}\nuninterrupted {uninterrupted}"
    assert summary(out)["ppl_after"] == summary(full_run)["ppl_after"]
    assert summary(out)["start_step"] == saved


def test_resume_on_another_number_of_processes(full_run: Path, stopped_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(stopped_run, out)
    run_example(*SHORT, "--out", str(out), "--resume", "--processes", "1")
    s = summary(out)
    assert s["world_size"] == 1 and s["start_step"] == 4 and s["failures"] == []
    # One process takes the 8 sequences of a step that two took 4 by 4 (the per-process batch
    # follows): the same data and math, but each mean and the gradient average are summed in
    # another order, so float32 differs in the 7th digit, carried on by Adam over 4 steps.
    resumed, uninterrupted = losses(out), losses(full_run)
    assert sorted(resumed) == list(range(1, 9))
    for step in range(5, 9):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-4), f"step {step}"
    assert s["ppl_after"] == pytest.approx(summary(full_run)["ppl_after"], rel=1e-4)


def test_resume_on_processes_that_cannot_share_the_batch(example: ModuleType, capsys: pytest.CaptureFixture,
                                                          stopped_run: Path) -> None:
    err = refused(example, capsys, *SHORT, "--out", str(stopped_run), "--resume", "--processes", "3")
    assert ("--resume on 3 processes: the checkpoint's run took 8 sequences per step, which 3 processes cannot "
            "share evenly; resume on 1, 2, 4, 8 processes") in err


def test_lora_adapter_reloads_with_peft(tmp_path: Path) -> None:
    import peft

    run_example(*SHORT, "--out", str(tmp_path), "--lora", "--lora-rank", "4", "--steps", "4", "--save-every", "0")
    s = summary(tmp_path)
    adapter = tmp_path / "hf"
    assert (adapter / "adapter_config.json").is_file()
    model = peft.AutoPeftModelForCausalLM.from_pretrained(adapter, dtype=torch.float32)
    trained_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert trained_b and all(p.abs().max() > 0 for p in trained_b), "LoRA B matrices are still zero: nothing trained"
    assert s["reloaded_check_loss"] == pytest.approx(s["check_loss"], rel=1e-5)
    assert s["reloaded_sample"] == s["sample"]


# --- did it learn? ----------------------------------------------------------------------------------------


def learned(example: ModuleType) -> Any:
    return example.Summary(world_size=2, device="cpu", start_step=0, last_step=8, trainable_parameters=2_000_000,
                           ppl_before=2048.0, steps_run=8, grad_norm_max=1.7, ppl_after=600.0, sample="And God said,",
                           check_loss=6.4, reloaded_sample="And God said,", reloaded_check_loss=6.4)


def test_judge_passes_a_run_that_learned(example: ModuleType) -> None:
    assert example.judge(learned(example), torch.float32) == ([], [])


def test_judge_a_stopped_run_by_what_it_has(example: ModuleType) -> None:
    stopped = dataclasses.replace(learned(example), last_step=4, ppl_after=None, sample=None, check_loss=None,
                                  reloaded_sample=None, reloaded_check_loss=None)
    assert example.judge(stopped, torch.float32) == ([], [])
    failures, _ = example.judge(dataclasses.replace(stopped, grad_norm_max=0.0), torch.float32)
    assert len(failures) == 1 and "the gradient norm was 0" in failures[0]


FAILURES = [
    ({"trainable_parameters": 0}, "the model has no trainable parameter"),
    ({"grad_norm_max": 0.0}, "the gradient norm was 0 or not finite at every one of the 8 steps"),
    ({"grad_norm_max": None}, "the gradient norm was 0 or not finite at every one of the 8 steps"),
    ({"ppl_after": 2048.0}, "held-out perplexity did not fall: 2048.00 at step 0, 2048.00 at step 8"),
    ({"reloaded_check_loss": 6.402}, "the export reloaded by plain transformers gives another loss"),
    ({"reloaded_sample": "And God saw"}, "the export reloaded by plain transformers generates another sample"),
]


@pytest.mark.parametrize("change,reason", FAILURES, ids=[next(iter(c)) + "=" + str(next(iter(c.values())))
                                                         for c, _ in FAILURES])
def test_judge_names_each_reason(example: ModuleType, change: Dict[str, Any], reason: str) -> None:
    failures, _ = example.judge(dataclasses.replace(learned(example), **change), torch.float32)
    assert len(failures) == 1 and reason in failures[0], failures


def test_judge_in_bfloat16(example: ModuleType) -> None:
    # 1% apart: within bfloat16's tolerance; the sample then flips on a near-tie: a warning only.
    near = dataclasses.replace(learned(example), reloaded_check_loss=6.46, reloaded_sample="And God saw")
    failures, warnings = example.judge(near, torch.bfloat16)
    assert failures == [] and "near-tie" in warnings[0]
    far = dataclasses.replace(near, reloaded_check_loss=7.0)
    failures, _ = example.judge(far, torch.bfloat16)
    assert len(failures) == 2 and "another loss" in failures[0] and "another sample" in failures[1]


@pytest.fixture(scope="module")
def tiny_models(full_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of small models saved by save_pretrained, each with the default run's tokenizer."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(full_run / "tokenizer")
    folder = tmp_path_factory.mktemp("models")
    special = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    zero = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        **special))
    with torch.no_grad():
        for param in zero.parameters():
            param.zero_()  # every activation and every gradient is then exactly 0
    gemma2 = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, pad_token_id=tokenizer.eos_token_id, **special))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                                                **special))
    for name, model in [("zero", zero), ("gemma2", gemma2), ("gpt2", gpt2)]:
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    return folder


def test_a_model_that_cannot_learn_fails_the_run(tiny_models: Path) -> None:
    # Relative --model and --out, from the user's directory: they resolve there.
    proc = run_example(*QUICK, "--model", "zero", "--out", "out-zero", cwd=tiny_models, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert (tiny_models / "out-zero" / "summary.json").is_file() and (tiny_models / "out-zero" / "hf").is_dir()
    assert "the run failed its checks (its outputs are kept in out-zero)" in output
    assert "the gradient norm was 0 or not finite at every one of the 4 steps: nothing reached the weights" in output
    assert "held-out perplexity did not fall" in output
    assert "ChildFailedError" not in output and "Traceback" not in output


def test_gemma2_learns(tiny_models: Path, tmp_path: Path) -> None:
    # Gemma2 scales its embeddings by a non-persistent buffer, which from_pretrained must fill.
    run_example(*QUICK, "--model", str(tiny_models / "gemma2"), "--out", str(tmp_path))
    s = summary(tmp_path)
    assert s["failures"] == [] and s["ppl_after"] < 0.9 * s["ppl_before"], s


def test_lora_finds_gpt2s_linear_layers(tiny_models: Path, tmp_path: Path) -> None:
    # GPT-2's linear layers are Conv1D modules named c_attn, c_proj, c_fc: peft's all-linear finds them.
    run_example(*QUICK, "--model", str(tiny_models / "gpt2"), "--out", str(tmp_path), "--lora", "--lora-rank", "4",
                "--lr", "1e-2")
    s = summary(tmp_path)
    assert s["failures"] == [], s["failures"]
    targets = json.loads((tmp_path / "hf" / "adapter_config.json").read_text())["target_modules"]
    assert {name.rsplit(".", 1)[-1] for name in targets} == {"c_attn", "c_proj", "c_fc"}, targets


# --- mistakes: one message, exit status 2 -----------------------------------------------------------------


BAD_ARGUMENTS: List[tuple] = [
    (["--steps", "-5"], "--steps must be >= 1, got -5"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--seq", "1"], "--seq must be >= 2"),
    (["--grad-accum", "0"], "--grad-accum must be >= 1, got 0"),
    (["--lr", "0"], "--lr must be a positive number, got 0.0"),
    (["--holdout", "1.5"], "--holdout must be in (0, 1)"),
    (["--stop-at", "0"], "--stop-at must be in [1, --steps=8], got 0"),
    (["--warmup", "9"], "--warmup must be in [0, --steps=8], got 9"),
    (["--lora-targets", "q_proj"], "--lora-targets names the layers --lora adapts"),
    (["--fp8", "tensorwise"], "--fp8 tensorwise computes in float8, which needs GPUs with float8 tensor cores"),
]


@pytest.mark.parametrize("extra,message", BAD_ARGUMENTS, ids=[b[0][0] for b in BAD_ARGUMENTS])
def test_bad_arguments_are_named(example: ModuleType, capsys: pytest.CaptureFixture, tmp_path: Path, extra: List[str],
                                 message: str) -> None:
    assert message in refused(example, capsys, *SHORT, "--out", str(tmp_path), *extra)


def test_default_warmup_follows_steps(example: ModuleType) -> None:
    assert example.parse_args(["--steps", "5"]).warmup == 0
    assert example.parse_args(["--steps", "300"]).warmup == 30


LATIN1_BEFORE = "In the beginning God cr"


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folders holding only a config.json: what the checks before training read."""
    import transformers

    folder = tmp_path_factory.mktemp("configs")
    small = dict(vocab_size=300, d_model=32)
    for name, config, architecture in [
        ("bart", transformers.BartConfig(**small, encoder_layers=1, decoder_layers=1), "BartForConditionalGeneration"),
        ("t5", transformers.T5Config(**small, num_layers=1), "T5ForConditionalGeneration"),
        ("gpt2", transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=2, n_positions=64),
         "GPT2LMHeadModel"),
    ]:
        config.architectures = [architecture]
        config.save_pretrained(folder / name)
    (folder / "latin1.txt").write_bytes(f"{LATIN1_BEFORE}éated".encode("latin-1"))
    return folder


def test_bad_inputs_are_named_before_training(example: ModuleType, capsys: pytest.CaptureFixture, configs: Path,
                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(configs)  # relative paths are the user's: named as given
    bad = {
        ("--model", "no-such-folder"): "--model no-such-folder: no config.json there",
        ("--data", "no-such-file.txt"): "--data no-such-file.txt: no such file",
        ("--data", "latin1.txt"): f"--data latin1.txt is not UTF-8 text: byte 0xe9 at offset {len(LATIN1_BEFORE)} "
                                  "(invalid continuation byte); convert it first, e.g. `iconv -f LATIN1 -t UTF-8 "
                                  "latin1.txt > latin1.utf8.txt`",
        ("--model", "bart"): "--model bart holds a BartForConditionalGeneration (sequence-to-sequence): "
                             "finetune_hf.py fine-tunes causal language models",
        ("--model", "t5"): "--model t5 holds a T5ForConditionalGeneration (sequence-to-sequence)",
        ("--model", "gpt2", "--seq", "128"): "--seq 128 is longer than the 64 positions of --model gpt2",
        ("--model", "gpt2"): "--model gpt2: no tokenizer files there (none of tokenizer.json, tokenizer.model, ",
        ("--lora", "--lora-targets", "c_attn,q_proj"): "--lora-targets c_attn,q_proj: the model has no layer named "
                                                       "c_attn that LoRA can adapt; its layers are named down_proj, ",
    }
    for argv, message in bad.items():
        err = refused(example, capsys, *SHORT, "--out", str(tmp_path), *argv)
        assert message in err, f"{argv}: {err}"


def test_unwritable_out_is_found_before_training(example: ModuleType, capsys: pytest.CaptureFixture,
                                                 tmp_path: Path) -> None:
    # Tests run as root, which writes anywhere: a file where a folder must be is what stops them.
    (tmp_path / "a-file").write_text("")
    err = refused(example, capsys, *SHORT, "--out", str(tmp_path / "a-file" / "out"))
    assert f"cannot create the folder {tmp_path / 'a-file' / 'out'}: {tmp_path / 'a-file'} is a file" in err
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoint").write_text("")
    err = refused(example, capsys, *SHORT, "--out", str(tmp_path / "out"))
    assert f"{tmp_path / 'out' / 'checkpoint'} is a file; move it away or give another --out" in err


def test_resume_without_a_checkpoint(example: ModuleType, capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    err = refused(example, capsys, *SHORT, "--out", str(tmp_path), "--resume")
    assert f"--resume: no checkpoint in {tmp_path / 'checkpoint'}; train without --resume first" in err


def assert_one_clean_message(proc: subprocess.CompletedProcess, message: str) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    lines = [line for line in output.splitlines() if message in line]
    assert len(lines) == 1 and lines[0].startswith(f"finetune_hf.py: error: {message}"), output
    assert "ChildFailedError" not in output and "Traceback" not in output, output[-3000:]


def test_a_mistake_found_before_torchrun_is_one_message(tmp_path: Path) -> None:
    proc = run_example(*SHORT, "--out", str(tmp_path), "--data", str(tmp_path / "text.txt"), check=False)
    assert_one_clean_message(proc, f"--data {tmp_path / 'text.txt'}: no such file")
    assert "starting 2 processes" not in proc.stdout


def test_a_mistake_the_workers_find_is_one_message(tmp_path: Path) -> None:
    data = tmp_path / "short.txt"
    data.write_text("In the beginning God created the heaven and the earth.\n" * 8)
    proc = run_example(*SHORT, "--out", str(tmp_path / "out"), "--data", str(data), check=False)
    assert "starting 2 processes" in proc.stdout
    assert_one_clean_message(proc, f"--data {data}: its ")
    assert "tokens are too few for --seq 64 with --holdout 0.1 on 2 processes" in proc.stderr


def test_finetune_sh_keeps_the_users_directory(tmp_path: Path) -> None:
    # finetune.sh in a checkout whose install.sh and example are stand-ins: only its own paths are tested.
    checkout, user = tmp_path / "checkout", tmp_path / "user"
    (checkout / "scripts").mkdir(parents=True)
    (checkout / "examples").mkdir()
    user.mkdir()
    shutil.copy(ROOT / "scripts" / "finetune.sh", checkout / "scripts")
    (checkout / "scripts" / "install.sh").write_text('echo "install.sh $*"\n')
    (checkout / "examples" / "finetune_hf.py").write_text(
        "import json, os, sys\nprint(json.dumps({'cwd': os.getcwd(), 'argv': sys.argv[1:]}))\n")
    proc = subprocess.run(["bash", str(checkout / "scripts" / "finetune.sh"), "--model", "./Llama", "--out", "out"],
                          cwd=user, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stderr
    install, seen = proc.stdout.splitlines()
    assert install == "install.sh examples"
    assert json.loads(seen) == {"cwd": str(user), "argv": ["--model", "./Llama", "--out", "out"]}


# --- records: conversations, prompt/completion pairs ------------------------------------------------------


CHAT = ROOT / "examples" / "data" / "chat.jsonl"


CHAT_RUN = [*QUICK, "--steps", "8", "--data", str(CHAT), "--prompt", "Hello!"]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model and tokenizer (its built-in chat template) on the bundled conversations, packed (--pack auto)."""
    out = tmp_path_factory.mktemp("chat")
    proc = run_example(*CHAT_RUN, "--out", str(out))
    assert "packed into rows of 64 tokens" in proc.stdout
    return out


def test_the_bundled_conversations_train_end_to_end(chat_run: Path) -> None:
    s = summary(chat_run)
    assert s["failures"] == [] and s["ppl_after"] < 0.5 * s["ppl_before"], s
    assert s["sample"].startswith("<|user|>\nHello!<|assistant|>\n") and s["reloaded_sample"] == s["sample"]
    assert s["reloaded_check_loss"] == pytest.approx(s["check_loss"], rel=1e-5)
    # Packed rows pad far less than one example a row would (the packer's own figure).
    assert 0 < s["padding_share"] < s["padding_share_unpacked"] < 1, s
    for line in log_lines(chat_run):
        assert 0 <= line["padding_share"] < line["padding_share_unpacked"] < 1 and line["tokens_s"] > 0, line


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Data files with mistakes, and a model folder whose tokenizer has no chat template."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("records")
    pair = json.dumps({"question": "What is 1 plus 2?", "answer": " 3."})
    (folder / "qa.jsonl").write_text(pair + "\n" + pair + "\n")
    (folder / "bad.jsonl").write_text(pair + "\n" + pair + "\n{'question': 'single quotes'}\n")
    (folder / "empty.jsonl").write_text("")
    (folder / "text.txt").write_text("In the beginning.\n")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(["hello"], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                           show_progress=False,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(
        folder / "plain")
    gpt2 = transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    gpt2.architectures = ["GPT2LMHeadModel"]
    gpt2.save_pretrained(folder / "plain")
    return folder


def test_bad_records_are_named_before_training(example: ModuleType, capsys: pytest.CaptureFixture, records: Path,
                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(records)
    bad = {
        ("--data", "bad.jsonl"): "--data bad.jsonl, line 3: not JSON (Expecting property name enclosed in double "
                                 "quotes, column 2); each line of a JSON Lines file holds one JSON object",
        ("--data", "qa.jsonl"): "--data qa.jsonl: no column 'messages' or 'prompt'+'completion' or 'text' (the columns "
                                "found: 'question', 'answer'); name the columns that hold them with --fields, e.g. "
                                "--fields prompt=question,completion=answer",
        ("--data", "qa.jsonl", "--fields", "prompt=question,completion=reply"):
            "--data qa.jsonl: no column 'messages' or 'question'+'reply' or 'text'",
        ("--data", "empty.jsonl"): "--data empty.jsonl: no example in it (empty)",
        ("--data", "text.txt", "--fields", "text=body"): "--fields text=body names columns of records, but --data "
                                                         "text.txt is a text file",
        ("--data", str(CHAT), "--model", "plain", "--seq", "32"):
            f"--data {CHAT} holds conversations ('messages'), but the tokenizer of --model plain has no chat template "
            "to render them with; give one with --chat-template (a Jinja file or string",
        ("--data", str(CHAT), "--chat-template", "chat.jinja"): "--chat-template chat.jinja: no such file, nor a "
                                                                "Jinja template",
        ("--fields", "answer=reply"): "argument --fields: 'answer=reply': no field 'answer'; the fields are text, "
                                      "prompt, completion, messages",
    }
    for argv, message in bad.items():
        err = refused(example, capsys, *SHORT, "--out", str(tmp_path), *argv)
        assert message in err, f"{argv}: {err}"


def test_bad_records_the_workers_find(example: ModuleType, records: Path) -> None:
    """The mistakes found once the data is tokenized (in every process), checked here in one."""
    from bmtwrap.data import read_records
    data = sys.modules["finetune_hf_data"]
    tokenizer = chat_tokenizer(records)
    tool = records / "tool.jsonl"
    tool.write_text(CHAT.read_text() + json.dumps({"messages": [{"role": "tool", "content": "42"}]}) + "\n")
    cases = [
        (["--data", str(tool)], f"--data {tool}: example 42: the chat template refuses it: the chat template knows the "
                                "roles system, user and assistant, not 'tool'"),
        # Almost a token per byte: the system prompt and the first question pass 40 tokens.
        (["--data", str(CHAT), "--seq", "40"], f"--data {CHAT}: every example is cut: 41 of its 41 examples are "
                                               "longer than --seq 40 (the longest has "),
        (["--data", str(CHAT), "--seq", "40"], "would be dropped, nothing to learn left after the cut; give a longer "
                                               "--seq"),
        (["--data", str(CHAT), "--holdout", "0.01"], f"--data {CHAT}: its 41 examples are too few for --holdout 0.01 "
                                                     "on 2 processes"),
    ]
    for argv, message in cases:
        args = example.parse_args(argv)
        with pytest.raises(example.UsageError) as refusal:
            data.record_examples(args, tokenizer, read_records(args.data), world=2)
        assert message in str(refusal.value), f"{argv}: {refusal.value}"


def test_record_batches_pad_each_share(example: ModuleType, records: Path) -> None:
    """Each process's share is padded to its longest example (or --seq); the batch counts all shares' padding."""
    from bmtwrap.data import pad_examples, read_records
    data = sys.modules["finetune_hf_data"]
    tokenizer = chat_tokenizer(records)
    model = tiny_llama(len(tokenizer))
    for pad_to in ["longest", "seq"]:
        args = example.parse_args(["--data", str(CHAT), "--seq", "200", "--pad-to", pad_to])
        examples = data.record_examples(args, tokenizer, read_records(args.data), world=2)
        assert len(examples.train) + len(examples.held_out) == 41
        shares = [examples.batch(3, 8, rank, 2) for rank in range(2)]
        assert shares[0].tokens == shares[1].tokens and shares[0].padding == shares[1].padding  # the whole batch's
        assert shares[0].padding == sum(int((s.attention_mask == 0).sum()) for s in shares)
        assert shares[0].tokens == sum(int(s.attention_mask.sum()) for s in shares)
        for share in shares:
            lengths = share.attention_mask.sum(dim=1)
            assert share.input_ids.shape[1] == (200 if pad_to == "seq" else int(lengths.max()))
            assert (share.labels[share.attention_mask == 0] == -100).all()
        rows = [examples.train[int(i)] for i in examples._order[1][24:32]]  # batch 3, as drawn
        assert torch.equal(shares[0].input_ids, pad_examples(rows[:4], examples.pad_id,
                                                             length=200 if pad_to == "seq" else None).input_ids)
        # The step's loss: each share's mean weighed by its predicted tokens (as train() does) is the mean over
        # the whole batch's predicted tokens, computed here in one piece.
        assert shares[0].targets == sum(s.predicted() for s in shares)
        with torch.no_grad():
            cpu = torch.device("cpu")
            weighed = sum(model(**s.inputs(model, cpu)).loss * s.predicted() / s.targets for s in shares)
            whole = pad_examples(rows, examples.pad_id)
            reference = model(input_ids=whole.input_ids, labels=whole.labels, attention_mask=whole.attention_mask).loss
        assert weighed.item() == pytest.approx(reference.item(), rel=1e-5)


def chat_tokenizer(records: Path) -> Any:
    """The records' plain tokenizer, with bmtwrap.data's simple chat template (as the default's)."""
    import transformers

    from bmtwrap.data import SIMPLE_CHAT_TEMPLATE
    tokenizer = transformers.AutoTokenizer.from_pretrained(records / "plain")
    tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    return tokenizer


def tiny_llama(vocab_size: int) -> Any:
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, attn_implementation="sdpa")).eval()


def packed_examples(example: ModuleType, tokenizer: Any, model: Any, *argv: str) -> Any:
    """The chat set's examples as the workers hold them, packed or padded as --pack decides for ``model``."""
    from bmtwrap.data import read_records
    data = sys.modules["finetune_hf_data"]
    args = example.parse_args(["--data", str(CHAT), "--seq", "200", *argv])
    examples = data.record_examples(args, tokenizer, read_records(args.data), world=2)
    data.pack_or_pad(args, examples, model)
    return examples


def test_packed_batches_are_shared_by_rank_replayed_on_resume_and_weigh_the_loss(example: ModuleType,
                                                                                  records: Path) -> None:
    tokenizer = chat_tokenizer(records)
    model = tiny_llama(len(tokenizer))
    run = packed_examples(example, tokenizer, model)
    assert run.packing is not None
    shares = [[run.batch(index, 4, rank, 2) for rank in range(2)] for index in range(6)][5]  # 2 ranks, 2 rows each
    # A fresh stream, as a resumed run starts, straight at batch 5, on one process: the same 4 rows.
    whole = packed_examples(example, tokenizer, model).batch(5, 4, 0, 1)
    assert whole.input_ids.shape == (4, 200) and whole.attention_mask is None
    for name in ["input_ids", "labels", "position_ids"]:
        assert torch.equal(getattr(whole, name), torch.cat([getattr(s, name) for s in shares])), name
    assert whole.tokens + whole.padding == 4 * 200 and 0 < whole.padding < whole.tokens
    assert whole.tokens == shares[0].tokens and whole.padding == shares[1].padding
    assert whole.targets == shares[0].targets == sum(s.predicted() for s in shares) == whole.predicted()
    # The step's loss as train() weighs the shares: the mean over the whole packed batch's predicted tokens.
    with torch.no_grad():
        weighed = sum(model(**s.inputs(model, torch.device("cpu"))).loss * s.predicted() / s.targets for s in shares)
        reference = model(**whole.inputs(model, torch.device("cpu"))).loss
    assert weighed.item() == pytest.approx(reference.item(), rel=1e-5)
    share = run.packing._packer.padding_share()  # of the 6 batches packed so far
    assert run.unpacked_padding_share() == share.unpacked and 0 < share.packed < share.unpacked < 1


def test_pack_off_pads_and_a_family_packing_cannot_keep_apart(example: ModuleType, records: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    import transformers

    tokenizer = chat_tokenizer(records)
    padded = packed_examples(example, tokenizer, tiny_llama(len(tokenizer)), "--pack", "off")
    assert padded.packing is None and padded.unpacked_padding_share() is None
    assert padded.batch(0, 4, 0, 2).attention_mask is not None and padded.batch(0, 4, 0, 2).position_ids is None
    config = transformers.Gemma2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                       head_dim=16)
    with torch.device("meta"):
        gemma2 = transformers.Gemma2ForCausalLM(config)
    capsys.readouterr()
    assert packed_examples(example, tokenizer, gemma2).packing is None  # auto: padded, saying why in one line
    note = [line for line in capsys.readouterr().out.splitlines() if "--pack" in line]
    assert len(note) == 1 and "--pack auto: one example a row, padded, not packed: packing is not supported for " \
        "model type 'gemma2'" in note[0], note
    refusal = "--pack on: packing is not supported for model type 'gemma2' (Gemma2ForCausalLM)"
    with pytest.raises(example.UsageError, match=r"^--pack on: packing is not supported for model type 'gemma2'"):
        packed_examples(example, tokenizer, gemma2, "--pack", "on")
    # Found before any process starts, from --model's config: one message, exit status 2.
    config.architectures = ["Gemma2ForCausalLM"]
    config.save_pretrained(tmp_path / "gemma2")
    tokenizer.save_pretrained(tmp_path / "gemma2")
    err = refused(example, capsys, *SHORT, "--out", str(tmp_path / "out"), "--data", str(CHAT), "--model",
                  str(tmp_path / "gemma2"), "--pack", "on")
    assert f"finetune_hf.py: error: {refusal}" in err and "give --pack off" in err, err


# --- failures after the start: one message, the exit status, the checkpoint to go on from -----------------


def in_a_mount_namespace(script: str) -> List[str]:
    """A wrapper that runs the example after ``script`` (shell, in the test's directory), in a mount
    namespace of its own: mounts made there (a small tmpfs, a read-only bind) are seen by this run only."""
    from test_disk_full import _namespace_works

    if shutil.which("unshare") is None or not _namespace_works():
        pytest.fail("this test needs `unshare --mount --map-root-user` (util-linux, user namespaces); the machine "
                    "refuses it")
    return ["unshare", "--mount", "--map-root-user", "sh", "-c", f'{script} && exec "$@"', "sh"]


def damaged(stopped_run: Path, out: Path) -> Path:
    """A copy of the stopped run whose first shard file has one byte changed."""
    shutil.copytree(stopped_run, out)
    shard = sorted((out / "checkpoint").glob("shard-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


def test_a_damaged_checkpoint_is_one_message_on_resume(stopped_run: Path, tmp_path: Path) -> None:
    shard = damaged(stopped_run, tmp_path / "out")
    message = the_one_message(run_example(*SHORT, "--out", str(tmp_path / "out"), "--resume", check=False), 1)
    assert re.fullmatch(rf"finetune_hf.py: --resume: the checkpoint in {re.escape(str(shard.parent))} cannot be "
                        rf"loaded: {re.escape(str(shard))} is corrupt: .* have CRC-32 .*; or run again from the "
                        "start, without --resume", message), message


def test_a_full_disk_while_logging_is_one_message(example: ModuleType, stopped_run: Path, tmp_path: Path) -> None:
    """Rank 0's log.jsonl, opened as a resumed run opens it, refuses step 5's line: what that rank reports, and the
    message the launching process makes of it. In this process: the way a rank's failure to write reaches that
    message (rank 0 stops, rank 1 loses its collective and is not taken for the cause, the empty export folder
    goes) is the one a 2-process run checks below, for an --out made read-only."""
    launch = sys.modules["finetune_hf_launch"]  # imported by the example, from beside it
    out = tmp_path / "out"
    shutil.copytree(stopped_run, out)
    (out / "log.jsonl").unlink()
    (out / "log.jsonl").symlink_to("/dev/full")  # every write fails: No space left on device
    args = example.parse_args([*SHORT, "--out", str(out), "--resume"])
    started = time.time()
    log = example.open_log(out / "log.jsonl", 4)
    with pytest.raises(example.RunFailed) as failure:
        example.log_step(log, {"step": 5, "loss": 6.5})
    with contextlib.suppress(OSError):  # the line it still holds cannot be written on closing either
        log.close()
    report = launch.stopped(failure.value, args, True, started)  # True: a worker, as under our torchrun
    assert launch.settle([report], args, started).message == (
        f"finetune_hf.py: step 5: cannot write {out / 'log.jsonl'} (No space left on device); free space on its disk; "
        f"the checkpoint of step 4 in {out / 'checkpoint'} is intact; continue with --resume")


def test_an_out_made_read_only_after_the_start_is_one_message(stopped_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(stopped_run, out)
    (tmp_path / "ro").mkdir()
    (out / "log.jsonl").rename(tmp_path / "ro" / "log.jsonl")
    (out / "log.jsonl").symlink_to(tmp_path / "ro" / "log.jsonl")  # the start's check writes into folders only
    read_only = in_a_mount_namespace(f"mount --bind {tmp_path / 'ro'} {tmp_path / 'ro'} && "
                                     f"mount -o remount,bind,ro {tmp_path / 'ro'}")
    proc = run_example(*SHORT, "--out", str(out), "--resume", check=False, wrapper=read_only)
    assert the_one_message(proc, 1) == (
        f"finetune_hf.py: cannot write {out / 'log.jsonl'} (Read-only file system); its file system is read-only: "
        f"make it writable or give another --out; the checkpoint of step 4 in {out / 'checkpoint'} is intact; "
        "continue with --resume")
    assert not (out / "hf").exists(), "the failed run left the empty folder it was to export to"
    assert not (out / "errors.log").exists(), "rank 1's lost collective was kept as if it were the cause"


def test_a_full_disk_at_a_checkpoint_is_one_message(stopped_run: Path, tmp_path: Path) -> None:
    # Room for the stopped run's checkpoint, not for a second one beside it (the first goes once the second is whole).
    small, out = tmp_path / "small", tmp_path / "small" / "out"
    small.mkdir()
    size = sum(f.stat().st_size for f in stopped_run.rglob("*") if f.is_file())
    full = in_a_mount_namespace(f"mount -t tmpfs -o size={size * 3 // 2} tmpfs {small} && cp -r {stopped_run} {out}")
    proc = run_example(*SHORT, "--out", str(out), "--resume", check=False, wrapper=full)
    message = the_one_message(proc, 1)
    assert message.startswith(f"finetune_hf.py: step 8: cannot write the checkpoint in {out / 'checkpoint'} ("), message
    assert "No space left on device" in message
    assert message.endswith(f"; the checkpoint of step 4 in {out / 'checkpoint'} is intact; continue with --resume")


def report(example: ModuleType, **fields: Any) -> Any:
    return example.Outcome(**{"status": 1, "stopped": True, **fields})


def test_the_first_cause_is_told_once(example: ModuleType, tmp_path: Path) -> None:
    """How the launching process makes one message of its workers' reports (in rank order)."""
    launch = sys.modules["finetune_hf_launch"]  # imported by the example, from beside it
    args = example.parse_args(["--out", str(tmp_path)])
    started = time.time() - 1
    lost = report(example, message="rank 0 crashed: DistBackendError: Connection closed by peer", consequence=True,
                  traceback="--- rank 0\nlost\n")
    cause = report(example, message="finetune_hf.py: step 3: cannot write log.jsonl (No space left on device)")
    assert launch.settle([lost, cause], args, started).message == (
        f"{cause.message}; no checkpoint of this run was saved: run it again from the start, without --resume")
    assert not (tmp_path / "errors.log").exists(), "a known cause keeps no traceback"
    # A checkpoint of an earlier run in --out is not this run's to continue, unless it resumed from it.
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "index.json").write_text(json.dumps({"step": 4}))
    os.utime(tmp_path / "checkpoint" / "index.json", (started - 60, started - 60))
    assert "no checkpoint of this run was saved" in launch.settle([cause], args, started).message
    resumed = example.parse_args(["--out", str(tmp_path), "--resume"])
    assert "the checkpoint of step 4 in" in launch.settle([cause], resumed, started).message
    # A crash: its message, and every rank's traceback in errors.log.
    try:
        raise KeyError("oops")
    except KeyError as error:
        crash = launch.ended_by(error)
    ending = launch.settle([lost, crash], args, started)
    assert ending.status == 1 and ending.message.startswith("finetune_hf.py: rank 0 crashed: KeyError: 'oops' (the "
                                                            f"traceback of every rank is in {tmp_path / 'errors.log'})")
    kept = (tmp_path / "errors.log").read_text()
    assert "lost" in kept and "raise KeyError" in kept


def test_help_states_each_default_once(example: ModuleType, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        example.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default: 10% of --steps)" in text and "(default: 300)" in text
