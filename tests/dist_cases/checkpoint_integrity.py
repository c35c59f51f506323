"""Checkpoint integrity at world size 3: damaged bytes are found before any rank's model changes.

argv: the result path and a folder holding ``w1`` (a sharded checkpoint that the test saved at
world size 1: ``mlp`` of tests/test_checkpoint_integrity.py, 6 MB with its AdamW state) and
``w1-ref.pt`` (its model, gathered).
Each case damages a copy of a checkpoint (rank 0 writes the copy) and loads it on every rank:
every rank must raise, and every rank's model and optimizer state must be as before.

At world size 3 a rank's range of a 512 x 512 weight (1 MiB, four 256 KiB chunks) starts and
ends inside chunks, so loading ``w1`` checks partial chunks, and a bit flipped near the start of
``0.weight`` lies in a chunk only rank 0 reads: the others learn of it through the agreement.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch
from torch import nn

import bmtwrap as bmt
from bmtwrap.checkpoint.checksum import read_safetensors_layout
from bmtwrap.checkpoint.full_format import _storage_records
from bmtwrap.checkpoint.sharded import load_checkpoint, save_checkpoint
from common import run
from test_checkpoint_integrity import mlp

WORK = Path(sys.argv[2])


def all_ranks(value: Any) -> List[Any]:
    every: List[Any] = [None] * bmt.world_size()
    torch.distributed.all_gather_object(every, value)
    return every


def copy_of(source: Path, dest: str, change: Callable[[Path], None]) -> Path:
    """Rank 0 copies ``source`` (a folder or a file) and applies ``change`` to the copy."""
    target = WORK / dest
    if bmt.rank() == 0:
        shutil.rmtree(target, ignore_errors=True)
        (shutil.copytree if source.is_dir() else shutil.copyfile)(source, target)
        change(target)
    bmt.synchronize()
    return target


def flip_bit(path: Path, tensor: str, element: int) -> None:
    """Flip one bit inside ``tensor``'s data in a safetensors file (never in its header)."""
    layout = read_safetensors_layout(path)
    _, _, begin, end = layout.tensors[tensor]
    offset = layout.data_start + begin + element * 4 + 1
    assert offset < layout.data_start + end
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 0x04]))


def shard_holding(folder: Path, tensor: str, rank: int) -> Path:
    index = json.loads((folder / "index.json").read_text())
    return next(folder / file for file, *_ in index["tensors"][tensor]["pieces"]
                if index["files"][file]["rank"] == rank)


def attempt(model: nn.Module, opt: torch.optim.Optimizer, load: Callable[[], Any]) -> Dict[str, Any]:
    """Every rank's error text (or None), and whether every rank's model and optimizer state stayed as they were."""
    before = [t.detach().clone() for t in model.state_dict().values()]
    moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    try:
        load()
        message = None
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
    same = all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))
    same = same and all(torch.equal(v, opt.state[p][k]) for p in opt.state for k, v in moments[id(p)].items())
    return {"messages": all_ranks(message), "unchanged": all(all_ranks(same))}


def expect_sharded_error(folder: Path) -> Dict[str, Any]:
    model, opt = mlp(7)
    return attempt(model, opt, lambda: load_checkpoint(folder, model, opt))


def intact_resharded() -> Dict[str, Any]:
    """World 1's checkpoint at world 3: partial chunks check clean, values arrive."""
    model, opt = mlp(7)
    load_checkpoint(WORK / "w1", model, opt)
    ref = torch.load(WORK / "w1-ref.pt")
    got = bmt.full_state_dict(model)
    return {"equal": all(torch.equal(got[k], v) for k, v in ref.items())}


def flipped_bit_resharded() -> Dict[str, Any]:
    folder = copy_of(WORK / "w1", "w1-flipped", lambda f: flip_bit(shard_holding(f, "model/0.weight", 0),
                                                                    "model/0.weight", 1000))
    return {**expect_sharded_error(folder), "file": str(shard_holding(folder, "model/0.weight", 0))}


def flipped_bit_optimizer_state() -> Dict[str, Any]:
    """A checkpoint saved at world 3, a bit flipped in rank 1's piece of an Adam moment."""
    model, opt = mlp(3)
    save_checkpoint(WORK / "w3", model, opt)
    tensor = "optim/0/2.weight/exp_avg_sq"
    folder = copy_of(WORK / "w3", "w3-flipped", lambda f: flip_bit(shard_holding(f, tensor, 1), tensor, 5))
    return {**expect_sharded_error(folder), "file": str(shard_holding(folder, tensor, 1))}


def checksums_of_another_save() -> Dict[str, Any]:
    """An index whose recorded checksums are another save's (same model, same world size, other values)."""
    model, opt = mlp(4)
    save_checkpoint(WORK / "w3-other", model, opt)
    other = json.loads((WORK / "w3-other" / "index.json").read_text())

    def swap_checksums(folder: Path) -> None:
        index = json.loads((folder / "index.json").read_text())
        for name, meta in index["tensors"].items():
            for piece, theirs in zip(meta["pieces"], other["tensors"][name]["pieces"]):
                piece[3] = theirs[3]
        (folder / "index.json").write_text(json.dumps(index))

    return expect_sharded_error(copy_of(WORK / "w3", "w3-swapped", swap_checksums))


def version_one() -> Dict[str, Any]:
    """World 1's checkpoint with its index rewritten as version 1 (no checksums) loads at world 3, unchecked."""
    def downgrade(folder: Path) -> None:
        index = json.loads((folder / "index.json").read_text())
        index["version"] = 1
        del index["checksums"]
        for record in index["files"].values():
            del record["header_crc32"]
        for meta in index["tensors"].values():
            meta["pieces"] = [piece[:3] for piece in meta["pieces"]]
        (folder / "index.json").write_text(json.dumps(index))
        flip_bit(shard_holding(folder, "model/2.bias", 0), "model/2.bias", 3)  # unchecked: loads as it is

    folder = copy_of(WORK / "w1", "w1-version1", downgrade)
    model, opt = mlp(7)
    load_checkpoint(folder, model, opt)
    ref = torch.load(WORK / "w1-ref.pt")
    got = bmt.full_state_dict(model)
    return {"equal_but_flipped": [k for k, v in ref.items() if not torch.equal(got[k], v)]}


def full_file(suffix: str, offset_of: Callable[[Path], int]) -> Dict[str, Any]:
    """bmt.save at world 3, one bit flipped at the file offset ``offset_of`` gives, bmt.load on every rank."""
    model, opt = mlp(5)
    path = WORK / f"full{suffix}"
    bmt.save(model, path)

    def flip(target: Path) -> None:
        data = bytearray(target.read_bytes())
        data[offset_of(target)] ^= 0x20
        target.write_bytes(bytes(data))

    damaged = copy_of(path, f"full-flipped{suffix}", flip)
    fresh, fresh_opt = mlp(6)
    return {**attempt(fresh, fresh_opt, lambda: bmt.load(fresh, damaged)), "file": str(damaged)}


def in_safetensors(path: Path) -> int:
    """A byte near the end of '2.weight' (in a chunk that only the last rank reads)."""
    layout = read_safetensors_layout(path)
    return layout.data_start + layout.tensors["2.weight"][3] - 100


def in_zip(path: Path) -> int:
    """A byte inside the largest storage record (a weight)."""
    record = max(_storage_records(path).values(), key=lambda r: r.size)
    return record.data_offset + record.size // 2


if __name__ == "__main__":
    run({"intact_resharded": intact_resharded, "flipped_bit_resharded": flipped_bit_resharded,
         "flipped_bit_optimizer_state": flipped_bit_optimizer_state,
         "checksums_of_another_save": checksums_of_another_save, "version_one": version_one,
         "full_safetensors": lambda: full_file(".safetensors", in_safetensors),
         "full_pt": lambda: full_file(".pt", in_zip)})
