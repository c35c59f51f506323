"""bmtwrap.save / bmtwrap.load: full checkpoints written at world size 4, read back at 1, 2 and 3.

References are the unwrapped models and files read by plain ``torch.load``, ``safetensors`` and
``transformers``. The multi-process cases live in ``dist_cases/checkpoint_full.py``; errors that
need no second rank, and the killed save, run here in a world of one.
"""

import os
import signal
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import bmtwrap as bmt
from forked_ranks import ForkedScript, first_line
from launch import ROOT, TESTS, run_cases

FORMATS = [".pt", ".safetensors"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("full_checkpoints")


@pytest.fixture(scope="module")
def saved(folder):
    return run_cases("checkpoint_full.py", 4, "save", str(folder), timeout=300)


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"world{w}")
def loaded(request, saved, folder):
    return request.param, run_cases("checkpoint_full.py", request.param, "load", str(folder), timeout=300)


def _case(results, name):
    result = results[name]
    assert "error" not in result, result.get("error")
    return result


# --- saving at world size 4 -------------------------------------------------------------------


@pytest.mark.parametrize("suffix", FORMATS)
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_saved_file_is_the_unwrapped_state_dict(saved, model, suffix):
    r = _case(saved, f"save_{model}")
    reference_ok = r["wrapped_equals_reference"] if model == "llama" else r["sharded_equals_unwrapped"]
    assert reference_ok, f"the sharded {model} differs from the same model unwrapped; the files prove nothing"
    assert r[suffix]["keys"], f"{model}{suffix}: keys differ from the unwrapped model's state_dict keys"
    assert r[suffix]["equal"], f"{model}{suffix}: values read by plain torch/safetensors differ from the model's"


def test_pt_file_keeps_tied_weights_in_one_storage(saved, folder):
    assert _case(saved, "save_llama")[".pt"]["tied_shared"]
    with zipfile.ZipFile(folder / "llama.pt") as archive:
        assert archive.testzip() is None, "a record's CRC-32 does not match its bytes"


def test_save_gathers_one_flat_buffer_at_a_time(saved):
    r = _case(saved, "one_buffer_at_a_time")
    assert r["probe_sees_two"], "the probe cannot see two gathered buffers"
    for suffix in FORMATS:
        assert r[suffix]["events"] >= 2 * r["buffers"], r
        assert r[suffix]["max_gathered"] == 1, f"{suffix}: {r[suffix]['max_gathered']} buffers gathered at once"
        assert r[suffix]["gathers_per_buffer"] == [1], f"{suffix}: a buffer was gathered more than once: {r}"
        assert r[suffix]["all_released"]


def test_failed_save_raises_on_every_rank_and_keeps_the_previous_file(saved):
    r = _case(saved, "save_errors")
    rank0, *others = r["unwritable"]
    assert rank0.startswith("RuntimeError: cannot write") and "a_file" in rank0, rank0
    assert all(o.startswith("RuntimeError: saving") and "failed on another rank" in o for o in others), others
    rank0, *others = r["writer_fails_to_start"]
    assert rank0 == "AssertionError: torch.save laid out storage 0 unexpectedly", rank0
    assert all("failed on another rank" in o for o in others), others
    rank0, *others = r["disk_full"]
    assert rank0.startswith("RuntimeError: cannot write") and "No space left on device" in rank0, rank0
    assert all("failed on another rank" in o for o in others), others
    assert r["disk_full_file_kept"], "a failed save changed the previous file"
    assert r["temporary_files_left"] == [], r["temporary_files_left"]


def test_failed_load_raises_on_every_rank_and_changes_nothing(saved):
    r = _case(saved, "save_errors")
    assert all(o.startswith("FileNotFoundError") and "nothing_here.pt does not exist" in o for o in r["missing_file"])
    assert all(o.startswith("ValueError: cannot load") and "missing keys" in o and "model.embed_tokens.weight" in o
               and "unexpected keys" in o and "layers.0.ln1.weight" in o for o in r["wrong_model"]), r["wrong_model"]
    outcomes = r["one_rank_missing"]
    assert outcomes[1].startswith("FileNotFoundError"), outcomes
    assert all(o.startswith("RuntimeError: loading") and "failed on another rank" in o
               for i, o in enumerate(outcomes) if i != 1), outcomes
    assert r["unchanged"], "a failed load changed the model"


def test_save_without_gathering_writes_each_ranks_pieces(saved):
    assert _case(saved, "save_gpt")["pieces_is_a_folder"]  # loaded at every world size below


def test_clean_removes_what_save_wrote_and_nothing_else(saved):
    r = _case(saved, "clean")
    assert r["clean_me.pt"] == [True, False] and r["clean_me_pieces"] == [True, False]
    assert r["unrelated"][0].startswith("ValueError: ") and "is a folder without index.json" in r["unrelated"][0]
    assert all(other.startswith("ValueError: ") and other.endswith("(on rank 0)") for other in r["unrelated"][1:]), \
        r["unrelated"]  # every rank raises rank 0's error
    assert r["unrelated_kept"]
    assert r["missing"][0].startswith("FileNotFoundError: bmt.clean: nothing at ")
    assert r["missing"][0].endswith("never_written.pt to remove")
    assert all(other.startswith("FileNotFoundError: ") for other in r["missing"][1:]), r["missing"]


# --- loading at world sizes 1, 2, 3 -----------------------------------------------------------


@pytest.mark.parametrize("suffix", FORMATS + ["_pieces.pt"])
def test_gpt_loads_at_any_world_size(loaded, suffix):
    world, results = loaded
    r = _case(results, f"load_gpt{suffix}")
    assert r["differs_before"], "the fresh model already held the saved values; the test would prove nothing"
    assert r["equal"], f"world {world}: loaded parameters differ from the saved ones"


@pytest.mark.parametrize("name", ["load_llama.pt", "load_llama.safetensors", "load_llama_plain_torch_save"])
def test_llama_built_on_meta_loads_at_any_world_size(loaded, name):
    world, results = loaded
    r = _case(results, name)
    assert r["equal"], f"world {world}: loaded parameters differ from the saved ones"
    assert r["inv_freq_equal"], "rotary inv_freq was not restored"
    assert r["loss_rel"] <= 1e-5, r


def test_transformers_reads_the_saved_safetensors(saved, folder):
    """The Llama saved into a folder with its config.json: plain transformers loads it."""
    import transformers

    _case(saved, "save_llama")
    model = transformers.LlamaForCausalLM.from_pretrained(folder / "hf")
    expected = torch.load(folder / "llama_plain.pt", weights_only=True)
    got = model.state_dict()
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


# --- one process: errors that need no second rank ------------------------------------------------


@pytest.fixture(scope="module")
def world():
    if not bmt.engine.dist.is_initialized():
        bmt.init_distributed(seed=0)


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return bmt.wrap(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)))


def params(model: nn.Module):
    return {k: v.clone() for k, v in bmt.full_state_dict(model).items()}


@pytest.mark.parametrize("suffix", FORMATS)
def test_truncated_file_is_named_as_such(world, tmp_path, suffix):
    model = small_model()
    path = tmp_path / f"model{suffix}"
    bmt.save(model, path)
    before = params(model)
    data = path.read_bytes()
    for cut in (len(data) // 2, len(data) - 7, 5):
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=f"{path.name} is truncated or corrupt"):
            bmt.load(model, path)
    after = params(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("suffix", FORMATS)
def test_corrupt_header_is_named_as_such(world, tmp_path, suffix):
    model = small_model()
    path = tmp_path / f"model{suffix}"
    bmt.save(model, path)
    data = bytearray(path.read_bytes())
    if suffix == ".safetensors":
        data[8:12] = b"\xff\xfe\xfd\xfc"  # the JSON header's first bytes
    else:
        data[0:4] = b"\x00\x00\x00\x00"  # the zip's first local header signature
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{path.name} is truncated or corrupt"):
        bmt.load(model, path)


def test_missing_file_and_folder(world, tmp_path):
    model = small_model()
    with pytest.raises(FileNotFoundError, match="nope.safetensors does not exist; check the path"):
        bmt.load(model, tmp_path / "nope.safetensors")
    with pytest.raises(ValueError, match="is a folder"):
        bmt.load(model, tmp_path)


def test_unwritable_folder(world, tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(RuntimeError, match="cannot write .*a_file.*give a path in a folder it can create and write"):
        bmt.save(small_model(), tmp_path / "a_file" / "model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_file_that_is_not_a_state_dict(world, tmp_path):
    model = small_model()
    torch.save({"model": model.state_dict(), "step": 3}, tmp_path / "train.pt")
    with pytest.raises(ValueError, match=r"train.pt is not a state dict of tensors: 'model' \(OrderedDict\), "
                                         r"'step' \(int\)"):
        bmt.load(model, tmp_path / "train.pt")
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="list.pt holds a list, not a state dict"):
        bmt.load(model, tmp_path / "list.pt")
    torch.save({"weight": nn.Linear(2, 2)}, tmp_path / "module.pt")
    with pytest.raises(ValueError, match=r"module.pt holds objects other than tensors \(or its pickled index is "
                                         r"damaged\), and bmtwrap.load reads weights only"):
        bmt.load(model, tmp_path / "module.pt")


@pytest.mark.parametrize("suffix", FORMATS)
def test_key_and_shape_problems_are_listed_and_strict_false_loads_the_rest(world, tmp_path, suffix):
    import safetensors.torch

    model = small_model()
    before = params(model)
    state = {k: v + 1 for k, v in before.items()}
    state["extra.weight"] = torch.zeros(3)
    del state["2.bias"]
    path = tmp_path / f"odd{suffix}"
    (safetensors.torch.save_file if suffix == ".safetensors" else torch.save)(state, str(path))
    with pytest.raises(ValueError) as info:
        bmt.load(model, path)
    message = str(info.value)
    assert f"cannot load {path} into the model, nothing was changed" in message
    assert "missing keys (1): 2.bias" in message and "unexpected keys (1): extra.weight" in message
    assert "pass strict=False" in message
    assert all(torch.equal(v, params(model)[k]) for k, v in before.items())
    bmt.load(model, path, strict=False)
    after = params(model)
    assert torch.equal(after["2.bias"], before["2.bias"])
    assert all(torch.equal(after[k], state[k]) for k in state if k in after)
    state["0.weight"] = torch.zeros(4, 4)
    (safetensors.torch.save_file if suffix == ".safetensors" else torch.save)(state, str(path))
    with pytest.raises(ValueError, match=r"shape mismatches \(1\): 0.weight: checkpoint \(4, 4\), model \(16, 16\)"):
        bmt.load(model, path, strict=False)


def test_a_tied_key_may_be_left_out(world, tmp_path):
    """As Hugging Face files leave out lm_head.weight: the alias is loaded through the key that is there."""
    import safetensors.torch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    model = bmt.wrap(model)
    state = {"0.weight": torch.randn(8, 4)}
    safetensors.torch.save_file(state, str(tmp_path / "tied.safetensors"))
    bmt.load(model, tmp_path / "tied.safetensors")
    after = params(model)
    assert torch.equal(after["0.weight"], state["0.weight"]) and torch.equal(after["1.weight"], state["0.weight"])


def test_dtype_safetensors_cannot_hold(world, tmp_path):
    model = small_model()
    model.register_buffer("phase", torch.ones(3, dtype=torch.complex64))
    with pytest.raises(NotImplementedError, match="'phase' has dtype torch.complex64.*save to a .pt file instead"):
        bmt.save(model, tmp_path / "model.safetensors")
    assert list(tmp_path.iterdir()) == []
    bmt.save(model, tmp_path / "model.pt")
    assert torch.equal(torch.load(tmp_path / "model.pt", weights_only=True)["phase"], model.phase)


def test_extra_state_that_is_not_a_tensor(world, tmp_path):
    class WithExtraState(nn.Linear):
        def get_extra_state(self):
            return {"note": "not a tensor"}

        def set_extra_state(self, state):
            pass

    model = bmt.wrap(nn.Sequential(WithExtraState(4, 4)))
    with pytest.raises(NotImplementedError, match="'0._extra_state' holds a dict .*bmtwrap.save writes tensors only"):
        bmt.save(model, tmp_path / "model.pt")
    assert list(tmp_path.iterdir()) == []


# --- a save killed mid-write -----------------------------------------------------------------------


@pytest.mark.parametrize("suffix", FORMATS)
def test_killed_save_leaves_the_previous_complete_file(tmp_path, suffix):
    """SIGKILL a process halfway through writing ~64 MB over a good file: the file is the previous save."""
    path = tmp_path / f"model{suffix}"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    logs = tmp_path / "logs"
    logs.mkdir()
    out, err = logs / "stdout", logs / "stderr"
    out.write_text(""), err.write_text("")
    # `python checkpoint_full.py - save_loop PATH`, forked from a server that has imported torch and bmtwrap.
    proc = ForkedScript(str(TESTS / "dist_cases" / "checkpoint_full.py"), ["-", "save_loop", str(path)], env,
                        str(out), str(err))
    try:
        line = first_line(proc, str(out)).split()  # "mid-write <i>": save i has written 2 of its 4 tensors
        assert line[:1] == ["mid-write"], err.read_text()
        temporary = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert len(temporary) == 1 and temporary[0].exists(), "the save in progress wrote no hidden temporary file"
    state = read_plain(path)
    assert sorted(state) == [f"{i}.weight" for i in range(4)]
    assert all(v.shape == (2048, 2048) for v in state.values())
    values = torch.cat([v.reshape(-1) for v in state.values()]).unique().tolist()
    assert values == [int(line[1]) - 1], f"the file is not the previous complete save: values {values[:10]}"


def read_plain(path: Path):
    """The file as plain torch / safetensors read it."""
    import safetensors.torch

    if path.suffix == ".safetensors":
        return safetensors.torch.load_file(path)
    return torch.load(path, weights_only=True)
