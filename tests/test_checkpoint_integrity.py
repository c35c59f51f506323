"""Checkpoint integrity: damaged bytes are named (file, tensor, fix) before any rank's model changes.

Sharded checkpoints and ``bmt.save``'d files carry CRC-32s (see [Note: chunked checksums] in
``bmtwrap/checkpoint/checksum.py``); ``.pt`` archives their zip records' CRC-32s; Hugging Face
folders none, so a damaged one must at least fail with its path. The world-size-3 cases run in one
launch of tests/dist_cases/checkpoint_integrity.py, which also loads a checkpoint saved here at
world size 1 (resharding reads partial chunks). The rest runs here, in a world of one.
Performance is measured, not asserted: the figures are in the change's report and checksum.py.
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path
from typing import Dict, Tuple

import pytest
import torch
from torch import nn

import bmtwrap as bmt
from bmtwrap.checkpoint.checksum import ChunkVerifier, chunk_crcs, read_safetensors_layout
from bmtwrap.checkpoint.sharded import load_checkpoint, save_checkpoint
from launch import run_cases

SHARD = r"shard-[0-9a-f]{16}-r\d{5}-\d{3}\.safetensors"
SHARDED_FIX = "restore it from an intact copy of the checkpoint, or load an earlier checkpoint"
FULL_FIX = "restore the file from an intact copy, or save it again"


@pytest.fixture(scope="module")
def world():
    if not bmt.engine.dist.is_initialized():
        bmt.init_distributed(seed=0)


def mlp(seed: int) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """A two-layer MLP (a 1 MiB weight: four 256 KiB chunks) with AdamW state after one step (the case script's too)."""
    torch.manual_seed(seed)
    model = bmt.wrap(nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 512)).square().mean().backward()
    opt.step()
    return model, opt


def snapshot(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in bmt.full_state_dict(model).items()}


def unchanged(model: nn.Module, before: Dict[str, torch.Tensor]) -> bool:
    after = bmt.full_state_dict(model)
    return all(torch.equal(before[k], after[k]) for k in before)


# --- world size 3 ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(world, tmp_path_factory):
    folder = tmp_path_factory.mktemp("integrity")
    model, opt = mlp(1)
    save_checkpoint(folder / "w1", model, opt)
    torch.save(bmt.full_state_dict(model), folder / "w1-ref.pt")
    return run_cases("checkpoint_integrity.py", 3, str(folder), timeout=300)


def _ok(results: dict, name: str) -> dict:
    result = results[name]
    assert "error" not in result, result.get("error")
    return result


def test_resharded_load_checks_partial_chunks_and_passes(results):
    assert _ok(results, "intact_resharded")["equal"]


# case: (the tensor named, the fix, what the checksums were compared with)
DAMAGE = {
    "flipped_bit_resharded": ("'model/0.weight'", SHARDED_FIX, "index.json records"),
    "flipped_bit_optimizer_state": ("'optim/0/2.weight/exp_avg_sq'", SHARDED_FIX, "index.json records"),
    "full_safetensors": ("'2.weight'", FULL_FIX, "its header records"),
    "full_pt": (r"record '\w+/data/\d+' \(tensor [02]\.weight\)", FULL_FIX, "the zip archive records"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_flipped_bit_is_named_on_every_rank_and_changes_nothing(results, case):
    r = _ok(results, case)
    tensor, fix, recorded = DAMAGE[case]
    file = re.escape(r["file"])
    pattern = rf"{file} is corrupt: bytes \[\d+, \d+\) of {tensor} have CRC-32 [0-9a-f]{{8}}, but .*{recorded} " \
              rf"[0-9a-f]{{8}}; .*{re.escape(fix)}"
    assert all(m is not None for m in r["messages"]), f"some ranks did not raise: {r['messages']}"
    assert sum(bool(re.match(f"ValueError: {pattern}", m)) for m in r["messages"]) >= 1, r["messages"]
    assert all(re.search(pattern, m) for m in r["messages"]), "\n".join(["a rank's error does not name the damage:",
                                                                           *r["messages"]])
    assert r["unchanged"], "a model or optimizer changed although loading failed"


def test_checksums_of_another_save_are_named(results):
    r = _ok(results, "checksums_of_another_save")
    pattern = rf"ValueError: .*{SHARD} is corrupt: bytes \[\d+, \d+\) of '(model|optim|rng)/[\w./]+' have CRC-32 .*" \
              r"index\.json records [0-9a-f]{8}(; \d+ more chunk\(s\) fail too)?; the file .* is not the one this " \
              r"index was written with"
    assert all(m is not None and re.match(pattern, m) for m in r["messages"]), "\n".join(map(str, r["messages"]))
    assert r["unchanged"]


def test_version_one_index_loads_without_checks(results):
    """Written as bmtwrap before checksums wrote it; a flipped bit then goes unseen, as documented."""
    assert _ok(results, "version_one")["equal_but_flipped"] == ["2.bias"]


# --- a world of one -----------------------------------------------------------------------------------


def test_chunk_checks_cover_exactly_the_chunks_a_range_touches(tmp_path):
    data = bytes(range(160))  # 10 chunks of 16 bytes, at offset 8 of the file
    crcs = chunk_crcs([memoryview(data)], 16)[0]
    assert crcs == "".join(f"{zlib.crc32(data[i : i + 16]):08x}" for i in range(0, 160, 16))
    damaged = bytearray(data)
    damaged[7 * 16 + 3] ^= 1  # chunk 7
    path = tmp_path / "file"
    path.write_bytes(b"\0" * 8 + bytes(damaged))

    def check(start: int, end: int) -> None:
        verifier = ChunkVerifier(fix="the fix", recorded="the test")
        verifier.add_chunks(path, "t", 8, 160, crcs, 16, start, end)
        verifier.run()

    check(0, 112)  # chunks 0-6
    check(128, 160)  # chunks 8-9
    for start, end in [(111, 113), (112, 113), (100, 160), (127, 128)]:
        with pytest.raises(ValueError, match=rf"{re.escape(str(path))} is corrupt: bytes \[112, 128\) of 't' have "
                                             r"CRC-32 [0-9a-f]{8}, but the test records [0-9a-f]{8}; the fix"):
            check(start, end)
    path.write_bytes(b"\0" * 8 + data[:150])
    with pytest.raises(ValueError, match=r"ends before bytes \[144, 160\) of 't': the file is truncated; the fix"):
        check(150, 151)


def test_a_damaged_shard_header_is_named(world, tmp_path):
    """A header that still parses (a metadata digit changed) but differs from the one saved."""
    model, opt = mlp(1)
    save_checkpoint(tmp_path, model, opt)
    shard = next(tmp_path.glob("shard-*.safetensors"))
    data = shard.read_bytes()
    assert data.count(b'"rank":"0"') == 1
    shard.write_bytes(data.replace(b'"rank":"0"', b'"rank":"7"'))
    other, other_opt = mlp(2)
    before = snapshot(other)
    with pytest.raises(ValueError, match=rf"{SHARD} is corrupt: its header \(tensor names, dtypes, shapes, offsets\) "
                                         rf"has CRC-32 [0-9a-f]{{8}}, but .*index\.json records [0-9a-f]{{8}}; .*"
                                         rf"{re.escape(SHARDED_FIX)}"):
        load_checkpoint(tmp_path, other, other_opt)
    assert unchanged(other, before)


def test_damaged_checksums_in_the_index(world, tmp_path):
    model, opt = mlp(1)
    save_checkpoint(tmp_path, model, opt)
    index = json.loads((tmp_path / "index.json").read_text())
    index["tensors"]["model/0.weight"]["pieces"][0][3] = "0123"
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index\.json is damaged: a field has the wrong form \(TypeError: "
                                         r"tensors\['model/0\.weight'\] has checksums '0123' that do not fit"):
        load_checkpoint(tmp_path, model, opt)


def test_plain_torch_save_file_has_its_zip_records_checked(world, tmp_path):
    """Any zip-format .pt (here plain torch.save) carries a CRC-32 per record, which bmt.load checks."""
    model, _ = mlp(1)
    path = tmp_path / "plain.pt"
    state = {k: v.clone() for k, v in bmt.full_state_dict(model).items()}
    torch.save(state, path)
    bmt.load(model, path)
    data = bytearray(path.read_bytes())
    offset = data.index(state["0.bias"][:4].numpy().tobytes())  # the first bytes of the record of '0.bias'
    data[offset + 2] ^= 0x80
    path.write_bytes(bytes(data))
    fresh, _ = mlp(2)
    before = snapshot(fresh)
    with pytest.raises(ValueError, match=r"plain\.pt is corrupt: bytes \[0, 2048\) of record 'plain/data/\d+' "
                                         r"\(tensor 0\.bias\) have CRC-32 .* the zip archive records"):
        bmt.load(fresh, path)
    assert unchanged(fresh, before)


def test_damaged_checksums_in_a_safetensors_header(world, tmp_path):
    model, _ = mlp(1)
    path = tmp_path / "model.safetensors"
    bmt.save(model, path)
    recorded = read_safetensors_layout(path).metadata["bmtwrap.crc32.0.bias"]
    data = path.read_bytes()
    path.write_bytes(data.replace(recorded.encode(), b"zz" + recorded[2:].encode(), 1))  # same length: still parses
    with pytest.raises(ValueError, match=r"model\.safetensors: the checksums of '0\.bias' in its header "
                                         r"\(bmtwrap\.crc32_chunk_bytes, bmtwrap\.crc32\.0\.bias\) are damaged; "
                                         + re.escape(FULL_FIX)):
        bmt.load(model, path)


def test_safetensors_without_checksums_still_load(world, tmp_path):
    """A file written by plain safetensors (no bmtwrap metadata) loads, unchecked."""
    import safetensors.torch

    model, _ = mlp(1)
    state = {k: v.clone() + 1 for k, v in bmt.full_state_dict(model).items()}
    safetensors.torch.save_file(state, str(tmp_path / "plain.safetensors"))
    bmt.load(model, tmp_path / "plain.safetensors")
    assert unchanged(model, state)
    bmt.save(model, tmp_path / "ours.safetensors")
    metadata = read_safetensors_layout(tmp_path / "ours.safetensors").metadata
    assert metadata["bmtwrap.crc32_chunk_bytes"] == str(256 << 10) and len(metadata["bmtwrap.crc32.0.weight"]) == 32


# --- Hugging Face folders --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """A tiny Llama saved by plain transformers: in one file, and in shards with an index."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    root = tmp_path_factory.mktemp("hf")
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    return root


def _hf_error(folder: Path) -> str:
    """The message of the error from_pretrained raises; the library's own error is kept as its cause."""
    with pytest.raises(ValueError) as info:
        bmt.from_pretrained(folder)
    assert info.value.__cause__ is not None
    return str(info.value)


def test_truncated_hf_weights_are_named(world, hf_folders, tmp_path):
    import shutil

    folder = shutil.copytree(hf_folders / "single", tmp_path / "single")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    for cut in (len(data) - 100, 20):
        weights.write_bytes(data[:cut])
        message = _hf_error(folder)
        assert message.startswith(f"{weights} is not a readable safetensors file (SafetensorError: "), message
        assert "truncated or corrupt (an interrupted download or copy?); download or copy the checkpoint folder " \
               "again" in message


def test_corrupt_hf_shard_and_index_are_named(world, hf_folders, tmp_path):
    import shutil

    folder = shutil.copytree(hf_folders / "sharded", tmp_path / "sharded")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].write_bytes(b"\xff" * 16 + shards[1].read_bytes()[16:])
    assert _hf_error(folder).startswith(f"{shards[1]} is not a readable safetensors file")
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ')
    message = _hf_error(folder)
    assert message.startswith(f"{folder / 'model.safetensors.index.json'} cannot be read as a JSON object with "
                              "'weight_map' (JSONDecodeError: "), message
