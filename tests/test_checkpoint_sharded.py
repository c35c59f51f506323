"""Sharded checkpoints: resharding at any world size, exact resume, errors, and killed saves.

Three setups: the test GPT with AdamOptimizer under an OptimManager (loss scale) with a Cosine
schedule; the test GPT with torch's AdamW and LinearLR; a tiny Llama through ``bmt.wrap`` with
AdamOptimizer and NoDecay. Five launches of tests/dist_cases/checkpoint_sharded.py share one work
folder, in this order: world 4 saves (after 5 steps, with a full ``torch.save`` reference, and 10
uninterrupted steps); worlds 1, 2 and 3 load (the Llama at 3 only; every parameter, optimizer
state, hyper-parameter, scheduler, loss scale and RNG state must equal the reference bit for bit)
and train 5 more steps; world 3 saves again; world 4 resumes exactly (losses and parameters
bit-equal to the uninterrupted run), loads world 3's checkpoint, and runs the error cases.

Resuming at another world size splits each batch differently, so it differs by fp32 rounding:
limits loss relative 1e-5 and parameters absolute 1e-5, as in test_parity.py (measured: about
1e-7 for both). A resharding bug moves values by O(1) and fails the bit-equal checks first.

In this process (a world of one): argument errors, damaged indexes, a bf16 model's fp32 master.
The kill test runs a save loop (63 MB of state) in a process of its own (forked with torch and bmtwrap
loaded, tests/forked_ranks.py) and SIGKILLs it at three moments of a save; the folder must then load,
with every value from one complete save.
"""

from __future__ import annotations

import json
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List

import pytest
import torch
from torch import nn

import bmtwrap as bmt
from bmtwrap.checkpoint.sharded import load_checkpoint, save_checkpoint
from forked_ranks import ForkedScript, first_line
from gpt_model import ShardedGPT
from launch import ROOT, TESTS, run_cases

SCRIPT = "checkpoint_sharded.py"
SETUPS = ["gpt_manager", "gpt_adamw", "llama_adam"]
EXACT = ["params_equal", "optim_equal", "groups_equal", "schedulers_equal", "manager_equal", "draws_equal"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sharded")


@pytest.fixture(scope="module")
def saved(work):
    return run_cases(SCRIPT, 4, "save", str(work))


@pytest.fixture(scope="module")
def loaded(work, saved) -> Dict[int, dict]:
    return {world: run_cases(SCRIPT, world, "load", str(work), *(["with-llama"] if world == 3 else []))
            for world in (1, 2, 3)}


@pytest.fixture(scope="module")
def resumed(work, loaded):
    return run_cases(SCRIPT, 4, "resume", str(work))


def _ok(result: dict) -> dict:
    assert "error" not in result, result.get("error")
    return result


@pytest.mark.parametrize("setup", SETUPS)
def test_save_does_not_perturb_training(saved, setup):
    r = _ok(saved[f"{setup}/save"])
    assert r["unperturbed"], "training on after a save differs from training without one"
    assert r["world_size"] == 4 and r["files"] == 4
    assert r["sharded_pieces"] >= 2, "no tensor was split between ranks: the test would not test resharding"


def _loaded_setups(world: int) -> List[str]:
    return SETUPS if world == 3 else SETUPS[:2]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_load_at_another_world_size_is_exact(loaded, world):
    for setup in _loaded_setups(world):
        r = _ok(loaded[world][f"{setup}/load"])
        failed = [key for key in EXACT if not r[key]]
        assert not failed, f"world {world}, {setup}: not equal to what world 4 saved: {failed} {r['bad_params']} " \
                           f"{r['bad_state']}"
        assert r["optim_entries"] > 0 and r["step"] == 5 and r["extra"] and r["saved_world"] == 4


@pytest.mark.parametrize("world", [1, 2, 3])
def test_resume_at_another_world_size_matches(loaded, world):
    for setup in _loaded_setups(world):
        r = _ok(loaded[world][f"{setup}/load"])
        worst = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], r["expected_losses"]))
        assert worst <= 1e-5, f"world {world}, {setup}: loss differs by {worst:.3g} (relative)"
        assert r["final_max_abs"] <= 1e-5, f"world {world}, {setup}: parameters differ by {r['final_max_abs']:.3g}"


@pytest.mark.parametrize("setup", SETUPS)
def test_resume_at_the_same_world_size_is_bit_exact(resumed, setup):
    r = _ok(resumed[f"{setup}/resume"])
    assert not [key for key in EXACT if not r[key]], r
    assert r["losses"] == r["expected_losses"], "the resumed run's losses differ from 10 uninterrupted steps"
    assert r["final_equal"], f"final parameters differ by up to {r['final_max_abs']:.3g}"


def test_load_at_a_larger_world_size(resumed):
    r = _ok(resumed["upsize_from_three"])
    assert not [key for key in EXACT if not r[key]], r
    assert r["new_rank_distinct"], "rank 3 (absent when saving) got another rank's RNG stream"
    assert r["new_rank_deterministic"], "rank 3's fresh RNG seed differs between two loads of one checkpoint"


ERRORS = {
    "missing_index": r"FileNotFoundError: no sharded checkpoint in .*nothing-here: .*index\.json does not exist",
    "missing_rank_file": r"FileNotFoundError: the checkpoint in .*no-rank2 is incomplete: .*shard-[0-9a-f]{16}-r00002-"
                         r"000\.safetensors \(rank 2's shard file, named by its index\) is missing.*\(on rank 2\)",
    "truncated_file": r"ValueError: .*truncated/shard-[0-9a-f]{16}-r00001-000\.safetensors is \d+ bytes but the index "
                      r"records \d+: the file is truncated",
    "corrupt_file": r"ValueError: .*corrupt/shard-[0-9a-f]{16}-r00003-000\.safetensors is corrupt: it is not a "
                    r"readable safetensors file",
    "foreign_file": r"ValueError: .*foreign/shard-[0-9a-f]{16}-r00001-000\.safetensors belongs to another save "
                    r"\(tag '[0-9a-f]{16}', the index's is '[0-9a-f]{16}'\)",
    "missing_keys": r"ValueError: cannot load this checkpoint into the model.*nothing was changed:\n  missing keys "
                    r"\(11\): layers\.3\.ln1\.weight, .*\n  \(strict=False loads the keys both have\)",
    "unexpected_keys": r"ValueError: cannot load this checkpoint.*\n  unexpected keys \(11\): layers\.2\.ln1\.weight",
    "shape_mismatch": r"ValueError: cannot load this checkpoint.*\n  shape mismatches \(37\): embed: checkpoint "
                      r"\(64, 32\), model \(64, 48\)",
    "other_architecture": r"ValueError: cannot load this checkpoint into the model \(a checkpoint of another model\?\)"
                          r".*missing keys \(38\): embed, .*unexpected keys \(21\): model\.embed_tokens\.weight",
    "optimizer_count": r"ValueError: the checkpoint holds 1 optimizer\(s\) but 2 were given",
    "parameter_count": r"ValueError: optimizer 0 \(AdamW\) has 1 parameter group\(s\) of sizes \[27\], the "
                       r"checkpoint's 1 of sizes \[38\]",
    "optimizer_kind": r"ValueError: optimizer 0 \(AdamOptimizer\): the checkpoint holds the state of an optimizer of "
                      r"type AdamW",
    "scheduler_count": r"ValueError: the checkpoint holds 1 lr scheduler\(s\) but 2 were given",
    "manager_without_state": r"ValueError: an OptimManager was given but the checkpoint was saved without one",
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_load_errors_name_the_problem_and_change_nothing(resumed, case):
    r = _ok(resumed[case])
    assert r["message"] is not None, "no error was raised"
    assert re.search(ERRORS[case], r["message"], re.S), r["message"]
    assert r["all_raised"], "some ranks did not raise: they would go on alone"
    assert r["unchanged"], "the model or the optimizer changed although loading failed"


def test_save_errors_leave_the_earlier_checkpoint(resumed):
    r = _ok(resumed["save_errors"])
    assert re.search(r"TypeError: extra\.f is a builtin_function_or_method, which a sharded checkpoint cannot "
                     r"store", r["extra"]["message"]), r["extra"]
    assert re.search(r"ValueError: optimizer 0 \(AdamW\), group 0: 1 parameters \(shapes \[\(3,\)\]\) are not "
                     r"parameters of the model", r["foreign_param"]["message"]), r["foreign_param"]
    assert re.search(r"NotImplementedError: optimizer 0 \(AdamW\) state 'odd' of '\w+' has shape \(\d+,\), neither "
                     r"a scalar nor the shape of the parameter's local shard .* \(on rank 1\)",
                     r["odd_state"]["message"]), r["odd_state"]
    assert all(r[k]["all_raised"] for k in ("extra", "foreign_param", "odd_state"))
    assert r["still_loads"], "the earlier checkpoint no longer loads the same values"
    assert r["no_strays"], "a failed save left files behind"


def test_non_strict_loads_the_common_keys(resumed):
    r = _ok(resumed["non_strict"])
    assert r["common_loaded"] and r["extra_untouched"], r


def test_several_files_per_rank(resumed):
    r = _ok(resumed["small_files"])
    assert r["files_per_rank"] > 2 and r["step"] == 1
    assert r["only_new_files"], "the earlier save's files were not removed"
    assert not [key for key in EXACT if not r[key]], r


# --- in this process, a world of one: arguments, damaged indexes, bf16 -------------------------------


@pytest.fixture(scope="module")
def world():
    if not bmt.engine.dist.is_initialized():
        bmt.init_distributed(seed=0)


def _small(seed: int = 0):
    """A wrapped two-layer MLP and AdamW with state after one step."""
    torch.manual_seed(seed)
    model = bmt.wrap(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def test_argument_errors(world, tmp_path):
    model, opt = _small()
    with pytest.raises(TypeError, match="optimizer must be an OptimManager, a torch.optim.Optimizer, a list of them "
                                        "or None, got str"):
        save_checkpoint(tmp_path, model, "adam")
    with pytest.raises(TypeError, match=r"lr_scheduler must have state_dict\(\) and load_state_dict\(\) .*got object"):
        save_checkpoint(tmp_path, model, opt, object())
    with pytest.raises(TypeError, match="step must be an int or None, got str"):
        save_checkpoint(tmp_path, model, opt, step="5")
    with pytest.raises(ValueError, match="max_file_bytes must be > 0, got 0"):
        save_checkpoint(tmp_path, model, opt, max_file_bytes=0)
    with pytest.raises(TypeError, match="optimizer must be an OptimManager"):
        load_checkpoint(tmp_path, model, [opt, "adam"])
    assert not any(tmp_path.iterdir()), "a refused save wrote files"


# Each case: a change to the index (a function of it, or the whole text to write), and the message.
DAMAGE = {
    "not json": ("{", r"index\.json cannot be read as JSON .*: the index is damaged"),
    "not ours": ('{"format": "other"}',
                 r"index\.json is not the index of a bmtwrap sharded checkpoint \(format 'other'"),
    "other version": (lambda index: index.update(version=99),
                      r"index\.json has format version 99; this bmtwrap reads versions 1, 2: load it with the bmtwrap"),
    "missing field": (lambda index: index.pop("rng"), r"index\.json lacks the fields \['rng'\]: the index is damaged"),
    "unknown tag": (lambda index: index.update(extra={"__bmtwrap__": "set"}),
                    r"the checkpoint index holds a value tagged 'set', which this bmtwrap does not know"),
    "file not listed": (lambda index: index["files"].clear(),
                        r"the checkpoint index names shard-[\w-]+\.safetensors for a piece but does not list it"),
    "piece missing": (lambda index: index["tensors"]["model/0.weight"]["pieces"].clear(),
                      r"the checkpoint holds no values for elements \[0, 64\) of 'model/0\.weight' .*incomplete"),
    "piece too long": (lambda index: index["tensors"]["model/1.bias"]["pieces"][0].__setitem__(2, 9),
                       (r"shard-[\w-]+\.safetensors does not hold the 9 elements of 'model/1\.bias' that the "
                        r"index records")),
    "tensor not described": (lambda index: index["model"].__setitem__("0.bias", "model/none"),
                             r"the checkpoint index names tensor 'model/none' but does not describe it"),
    "state shape": (lambda index: index["tensors"]["optim/0/0.weight/exp_avg"].__setitem__("shape", [3]),
                    (r"optimizer 0 \(AdamW\) state 'exp_avg' of '0\.weight' was saved with shape \(3,\), but "
                     r"the parameter's is \(8, 8\)")),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_index(world, tmp_path, case):
    model, opt = _small()
    save_checkpoint(tmp_path, model, opt, step=1)
    change, message = DAMAGE[case]
    if isinstance(change, str):
        (tmp_path / "index.json").write_text(change)
    else:
        index = json.loads((tmp_path / "index.json").read_text())
        change(index)
        (tmp_path / "index.json").write_text(json.dumps(index))
    other, other_opt = _small(seed=1)
    before = bmt.full_state_dict(other)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(tmp_path, other, other_opt)
    after = bmt.full_state_dict(other)
    assert all(torch.equal(before[k], after[k]) for k in before), "the model changed although loading failed"


def test_an_unwritable_folder_is_named(world, tmp_path):
    """A file where the folder must be, or above it: the error names the folder and the fix (root, which
    these tests may run as, ignores permission bits, so a file is what makes a folder unwritable here)."""
    model, opt = _small()
    (tmp_path / "a_file").write_text("")
    for folder in (tmp_path / "a_file", tmp_path / "a_file" / "ckpt"):
        with pytest.raises(RuntimeError, match=rf"cannot write the checkpoint in {re.escape(str(folder))} "
                                               r"\((FileExistsError|NotADirectoryError): .*give a folder every rank can "
                                               r"create and write"):
            save_checkpoint(folder, model, opt, step=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


@pytest.mark.parametrize("kind", ["AdamOptimizer", "AdamOffloadOptimizer"])
def test_bf16_model_keeps_its_fp32_master(world, tmp_path, kind):
    """The fp32 master of a bf16 model is saved and loaded as fp32, bit for bit."""
    torch.manual_seed(0)
    model = ShardedGPT(dtype=torch.bfloat16)
    opt = getattr(bmt.optim, kind)(model.parameters(), lr=1e-2)
    model.loss(torch.randint(0, 64, (2, 9))).backward()
    opt.step()
    save_checkpoint(tmp_path, model, opt)
    torch.manual_seed(1)
    fresh = ShardedGPT(dtype=torch.bfloat16)
    fresh_opt = getattr(bmt.optim, kind)(fresh.parameters(), lr=1e-2)
    load_checkpoint(tmp_path, fresh, fresh_opt)
    saved, loaded = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert saved.keys() == loaded.keys() and all("master" in entry for entry in saved.values())
    for pos, entry in saved.items():
        for key, value in entry.items():
            got = loaded[pos][key]
            assert (torch.equal(value, got) and value.dtype == got.dtype) if torch.is_tensor(value) else value == got
    a, b = bmt.full_state_dict(model), bmt.full_state_dict(fresh)
    assert all(torch.equal(a[k], b[k]) and b[k].dtype == torch.bfloat16 for k in a)


# --- a save killed part-way ---------------------------------------------------------------------

KILL_SCRIPT = TESTS / "dist_cases" / "checkpoint_sharded_kill.py"
# Moments to kill the save loop at: a shard file being written; new shard files in place but no
# new index; the new index being written.
STAGES: Dict[str, Callable[[List[str]], bool]] = {
    "shard being written": lambda names: any(re.match(r"^\.shard-.*\.tmp-", n) for n in names),
    "shards written, no index": lambda names: sum(bool(re.match(r"^shard-.*\.safetensors$", n)) for n in names) > 1,
    "index being written": lambda names: any(n.startswith(".index.json.tmp-") for n in names),
}


@contextmanager
def _kill_script(mode: str, *args: Path, log: Path) -> Iterator[ForkedScript]:
    """The kill script running in ``mode`` as ``python KILL_SCRIPT mode args...``, forked from a server that has
    imported torch and bmtwrap (a fresh interpreter spent seconds importing them), its stderr to ``log`` and its
    stdout beside it; killed (if still running) when the block ends."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    out = _stdout(log)
    out.write_text("")
    log.write_text("")
    proc = ForkedScript(str(KILL_SCRIPT), [mode, *map(str, args)], env, str(out), str(log))
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        proc.wait()


def _stdout(log: Path) -> Path:
    return log.with_name(log.name + ".stdout")


def _found(proc: ForkedScript, log: Path) -> dict:
    """The first line the script prints: what the folder held when it started."""
    line = first_line(proc, str(_stdout(log)))
    if not line:
        proc.wait()
        raise AssertionError(f"the kill script failed before reporting:\n{log.read_text()[-4000:]}")
    return json.loads(line)


def _progress(path: Path) -> int:
    return int(path.read_text()) if path.exists() else 0


def _kill_during(proc: ForkedScript, folder: Path, progress: Path, start: int,
                 appears: Callable[[List[str]], bool], log: Path) -> None:
    """Let one save complete (it removes the previous kill's strays), then SIGKILL at the moment ``appears``."""
    deadline = time.monotonic() + 120
    while _progress(progress) <= start:
        assert proc.returncode is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.01)
    names: List[str] = []
    while not appears(names):  # no sleep: the moments last milliseconds
        assert proc.returncode is None and time.monotonic() < deadline, log.read_text()[-4000:]
        names = os.listdir(folder)
    proc.kill()
    proc.wait()


def test_a_killed_save_leaves_a_loadable_checkpoint(tmp_path):
    folder, progress, log = tmp_path / "ckpt", tmp_path / "progress", tmp_path / "log"
    last = None
    for stage, appears in STAGES.items():
        with _kill_script("loop", folder, progress, log=log) as proc:
            found = _found(proc, log)
            if last is not None:
                assert found["consistent"], f"after a kill while the {stage}: values of several saves"
                assert found["step"] in (last, last + 1), f"holds save {found['step']}, the last complete was {last}"
                assert found["numel"] * 4 >= 50 * 2**20, "the test state is smaller than intended"
            _kill_during(proc, folder, progress, found["step"] or 0, appears, log)
        last = _progress(progress)
        if stage == "shard being written":
            left = os.listdir(folder)
            assert any(n.startswith(".shard-") for n in left) or len(left) > 2, f"the save was not interrupted: {left}"
    with _kill_script("check", folder, log=log) as check:
        found = _found(check, log)
        check.wait(60)
    assert found["consistent"] and found["step"] in (last, last + 1), found
