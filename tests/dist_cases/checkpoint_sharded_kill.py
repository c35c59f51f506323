"""A save loop for the kill test, and the check of what a killed save leaves (one process, no launcher).

argv: mode ("loop" or "check"), the checkpoint folder, and (loop) a progress file.

Both modes first load the folder, if it holds a checkpoint, and print one JSON line: the step it
holds and whether every value in it belongs to that one save. "loop" then saves about 63 MB of
state over it again and again (save k sets every parameter and every optimizer state value to k),
writing k to the progress file after each save returns, until it is killed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict

import torch
from torch import nn

import bmtwrap as bmt
from bmtwrap.checkpoint.sharded import load_checkpoint, save_checkpoint

WIDTH, LAYERS = 1024, 5  # 5.2M fp32 parameters + AdamW's two moments: 63 MB


def build() -> tuple:
    model = bmt.wrap(nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates the state
    return model, opt


@torch.no_grad()
def fill(model: nn.Module, opt: torch.optim.Optimizer, k: int) -> None:
    for p in model.parameters():
        p.fill_(k)
        state = opt.state[p]
        state["exp_avg"].fill_(k)
        state["exp_avg_sq"].fill_(k)
        state["step"].fill_(k)


def held(model: nn.Module, opt: torch.optim.Optimizer, folder: Path) -> Dict[str, Any]:
    """What the folder holds: its step, and whether every value equals it (one complete save)."""
    if not (folder / "index.json").exists():
        return {"step": None}
    info = load_checkpoint(folder, model, opt)
    k = info.step
    values = [t for p in model.parameters() for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
    steps = [opt.state[p]["step"] for p in model.parameters()]
    consistent = all(bool((t == k).all()) for t in values) and all(float(s) == k for s in steps)
    return {"step": k, "consistent": consistent, "numel": sum(t.numel() for t in values)}


def main() -> None:
    mode, folder = sys.argv[1], Path(sys.argv[2])
    bmt.init_distributed(seed=0)
    model, opt = build()
    found = held(model, opt, folder)
    print(json.dumps(found), flush=True)
    if mode != "loop":
        return
    progress = Path(sys.argv[3])
    k = found["step"] or 0
    while True:
        k += 1
        fill(model, opt, k)
        save_checkpoint(folder, model, opt, step=k)
        progress.with_suffix(".new").write_text(str(k))
        os.replace(progress.with_suffix(".new"), progress)


if __name__ == "__main__":
    main()
