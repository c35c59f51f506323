"""Saves that meet a full disk: a size-limited file system (tmpfs) mounted at FOLDER by the test.

    disk_full.py RESULT.json FOLDER

A sharded checkpoint and a full file are saved, the model trains on, the file system is filled up
to a few KiB, and both saves are tried again: every rank must raise an error naming the disk, and
the earlier checkpoint and file must load back exactly as they were saved.
"""

from __future__ import annotations

import errno
import hashlib
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict

import torch
from torch import nn

import bmtwrap as bmt
from common import run

FOLDER = Path(sys.argv[2])


def digest(model: nn.Module) -> str:
    state = model.state_dict()
    return hashlib.sha256(b"".join(state[k].contiguous().view(torch.uint8).numpy().tobytes() for k in sorted(state))
                          ).hexdigest()


def make() -> nn.Module:
    torch.manual_seed(0)
    return bmt.wrap(nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]))


def fill_disk(keep: int) -> None:
    """Rank 0 fills the file system until ``keep`` bytes are left (a ballast file)."""
    if bmt.rank() == 0:
        with open(FOLDER / "ballast", "wb") as f:
            block = bytes(1 << 16)
            try:
                while True:
                    f.write(block)
                    f.flush()
            except OSError as err:
                assert err.errno == errno.ENOSPC, err
        stat = os.statvfs(FOLDER)
        os.truncate(FOLDER / "ballast", os.path.getsize(FOLDER / "ballast") - max(0, keep - stat.f_bavail * stat.f_frsize))
    bmt.synchronize()


def error_of(action: Callable[[], Any]) -> str:
    try:
        action()
    except Exception as err:  # reported, and compared across ranks by the test
        return f"{type(err).__name__}: {err}"
    return "no error"


def disk_full() -> Dict[str, Any]:
    model = make()
    optimizer = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2)
    (model(torch.ones(2, 64)) ** 2).mean().backward()
    optimizer.step()
    bmt.save_checkpoint(FOLDER / "ckpt", model, optimizer, step=1)
    bmt.save(model, FOLDER / "model.safetensors")
    saved = digest(model)
    (model(torch.ones(2, 64)) ** 2).mean().backward()
    optimizer.step()
    fill_disk(keep=16 << 10)
    sharded_error = error_of(lambda: bmt.save_checkpoint(FOLDER / "ckpt", model, optimizer, step=2))
    full_error = error_of(lambda: bmt.save(model, FOLDER / "model.safetensors"))
    # The earlier checkpoint and file are intact and load back exactly.
    fresh = make()
    info = bmt.load_checkpoint(FOLDER / "ckpt", fresh, bmt.optim.AdamOptimizer(fresh.parameters(), lr=1e-2))
    from_checkpoint = digest(fresh)
    other = make()
    bmt.load(other, FOLDER / "model.safetensors")
    errors = [None] * bmt.world_size()
    torch.distributed.all_gather_object(errors, (sharded_error, full_error))
    return {"errors": errors, "step": info.step, "checkpoint_intact": from_checkpoint == saved,
            "file_intact": digest(other) == saved, "leftovers": sorted(p.name for p in FOLDER.iterdir())}


if __name__ == "__main__":
    run({"disk_full": disk_full})
