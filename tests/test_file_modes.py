"""Files bmtwrap writes get the mode any file the user creates gets: 0666 less the umask.

safetensors creates its files readable by their owner alone; a checkpoint or an exported folder
must be readable by whoever may read the user's other files (an inference service, a colleague).
Checked under two umasks, against a file made by plain ``open()`` in the same folder.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterator, List

import pytest
import torch
from torch import nn

import bmtwrap as bmt
from bmtwrap.checkpoint.io import atomic_file, default_file_mode


@pytest.fixture(scope="module")
def world():
    if not bmt.engine.dist.is_initialized():
        bmt.init_distributed(seed=0)


@pytest.fixture(params=[0o022, 0o027])
def umask(request) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _files(folder: Path) -> List[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _assert_modes_like_open(folder: Path, umask: int) -> None:
    plain = folder / "written-by-open.txt"
    plain.write_text("x")
    expected = stat.S_IMODE(plain.stat().st_mode)
    assert expected == 0o666 & ~umask
    wrong = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in _files(folder)
             if stat.S_IMODE(p.stat().st_mode) != expected}
    assert not wrong, f"files whose mode is not {oct(expected)} (what open() gives under umask {oct(umask)}): {wrong}"


def test_default_file_mode_follows_the_umask(umask):
    assert default_file_mode() == 0o666 & ~umask


def test_atomic_file_of_a_writer_that_creates_private_files(umask, tmp_path):
    def private_writer(path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"data")
        os.close(fd)

    with atomic_file(tmp_path / "out.bin") as tmp:
        private_writer(tmp)
    _assert_modes_like_open(tmp_path, umask)


def test_sharded_and_full_checkpoints(world, umask, tmp_path):
    torch.manual_seed(0)
    model = bmt.wrap(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    bmt.save_checkpoint(tmp_path / "sharded", model, optimizer, step=1)
    bmt.save(model, tmp_path / "full" / "model.safetensors")
    bmt.save(model, tmp_path / "full" / "model.pt")
    assert len(_files(tmp_path)) >= 4
    _assert_modes_like_open(tmp_path / "sharded", umask)
    _assert_modes_like_open(tmp_path / "full", umask)


def test_exported_hugging_face_folder(world, umask, tmp_path):
    import transformers

    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=32)
    model = bmt.wrap(transformers.LlamaForCausalLM(config))
    bmt.save_pretrained(model, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    _assert_modes_like_open(tmp_path / "hf", umask)


def test_saving_over_a_folder_carries_its_other_files_without_copying(world, tmp_path):
    """A Trainer's output folder holds checkpoint-N folders of many GB: they are linked, not copied."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=32)
    model = bmt.wrap(transformers.LlamaForCausalLM(config))
    folder = tmp_path / "out"
    bmt.save_pretrained(model, folder)
    (folder / "checkpoint-1").mkdir()
    (folder / "checkpoint-1" / "state.bin").write_bytes(b"x" * 4096)
    (folder / "README.md").write_text("notes")
    inodes = {p: (folder / p).stat().st_ino for p in ("checkpoint-1/state.bin", "README.md")}
    bmt.save_pretrained(model, folder)
    assert (folder / "checkpoint-1" / "state.bin").read_bytes() == b"x" * 4096
    assert (folder / "README.md").read_text() == "notes"
    assert {p: (folder / p).stat().st_ino for p in inodes} == inodes, "carried-over files were copied, not linked"
