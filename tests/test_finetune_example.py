"""examples/finetune_hf.py, the README's main job, run as a user runs it: 2 CPU processes it starts itself.

Checked against references outside the example: the exported folder is loaded here by plain
transformers (and peft for an adapter) and must generate the same sample; a run stopped and resumed
must log the same losses, bit for bit, as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from launch import ROOT

EXAMPLE = ROOT / "examples" / "finetune_hf.py"
SHORT = ["--processes", "2", "--steps", "8", "--warmup", "2", "--save-every", "4", "--eval-batches", "2",
         "--seq", "64", "--batch", "4", "--sample-tokens", "12"]


def run_example(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, env=env, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"finetune_hf.py {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{(proc.stdout + proc.stderr)[-5000:]}")
    return proc


def losses(out: Path) -> Dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())}


def summary(out: Path) -> Dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("full")
    run_example(*SHORT, "--out", str(out))
    return out


def test_the_default_learns_and_reports(full_run):
    s = summary(full_run)
    log = losses(full_run)
    assert sorted(log) == list(range(1, 9)), f"steps logged: {sorted(log)}"
    assert s["world_size"] == 2
    assert log[8] < log[1] - 0.5, f"the loss did not fall: {log}"
    assert s["ppl_after"] < 0.7 * s["ppl_before"], f"held-out perplexity {s['ppl_before']} -> {s['ppl_after']}"
    assert (full_run / "checkpoint" / "index.json").is_file()
    assert s["sample"].startswith("And God said")


def test_plain_transformers_loads_the_export_and_generates_the_same_sample(full_run):
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


def test_resume_continues_with_the_same_losses(full_run, tmp_path):
    first = run_example(*SHORT, "--out", str(tmp_path), "--stop-at", "4")
    assert "continue with --resume" in first.stdout
    assert sorted(losses(tmp_path)) == [1, 2, 3, 4]
    run_example(*SHORT, "--out", str(tmp_path), "--resume")
    resumed, uninterrupted = losses(tmp_path), losses(full_run)
    assert resumed == uninterrupted, f"resumed {resumed}\nuninterrupted {uninterrupted}"
    assert summary(tmp_path)["ppl_after"] == summary(full_run)["ppl_after"]
    assert summary(tmp_path)["start_step"] == 4


def test_lora_adapter_reloads_with_peft(tmp_path):
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


BAD: List[tuple] = [
    (["--stop-at", "0"], "--stop-at must be in [1, --steps=8], got 0"),
    (["--warmup", "9"], "--warmup must be in [0, --steps=8], got 9"),
    (["--model", "no-such-folder"], "--model no-such-folder: no config.json there"),
    (["--data", "no-such-file.txt"], "--data no-such-file.txt: no such file"),
]


@pytest.mark.parametrize("extra,message", BAD, ids=[b[0][0] for b in BAD])
def test_bad_arguments_are_named(tmp_path, extra, message):
    proc = run_example(*SHORT, "--out", str(tmp_path), *extra, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


def test_resume_without_a_checkpoint(tmp_path):
    proc = run_example(*SHORT, "--out", str(tmp_path), "--resume", check=False)
    assert proc.returncode != 0
    assert f"--resume: no checkpoint in {tmp_path / 'checkpoint'}; train without --resume first" in proc.stdout + proc.stderr
