"""Shared by the case scripts: run named cases in one process group, report from rank 0."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from typing import Any, Callable, Dict, List

import torch

import bmtwrap as bmt
from bmtwrap.engine.dist import current


def run(cases: Dict[str, Callable[[], Dict[str, Any]]], **init: Any) -> None:
    """Run every case on every rank; rank 0 writes {name: result or {"error": text}} to argv[1].
    ``init``: more arguments of ``init_distributed`` (``tp_size=2``)."""
    bmt.init_distributed(seed=0, **init)
    results: Dict[str, Any] = {}
    for name, case in cases.items():
        try:
            results[name] = case()
        except Exception:  # reported per case; the pytest side fails that case with this text
            results[name] = {"error": f"rank {bmt.rank()}: {traceback.format_exc()}"}
        bmt.synchronize()
    if bmt.rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    # Leaving gloo's threads to interpreter shutdown can abort a process on exit.
    torch.distributed.destroy_process_group()


def on_device(case: Callable[[], Dict[str, Any]]) -> Callable[[], Dict[str, Any]]:
    """``case`` making its tensors on this process's device: CUDA tensors over NCCL on GPUs, CPU tensors over gloo."""
    def run_there() -> Dict[str, Any]:
        with torch.device(current().device):
            return case()
    return run_there


def raised(call: Callable[[], Any]) -> List[str]:
    """[exception type, message] of what ``call`` raised, for a test to match; ["none", ""] when it returned."""
    try:
        call()
    except Exception as error:  # reported, not handled: the test matches the type and the message
        return [type(error).__name__, str(error)]
    return ["none", ""]


def shared_path(name: str) -> str:
    """A file name every rank agrees on (in rank 0's new temporary folder)."""
    folder: List[Any] = [tempfile.mkdtemp() if bmt.rank() == 0 else None]
    torch.distributed.broadcast_object_list(folder, src=0)
    return os.path.join(folder[0], name)


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference of two tensors; infinite when their shapes differ."""
    return float((a.detach().float() - b.detach().float()).abs().max()) if a.shape == b.shape else float("inf")


def max_rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def max_abs_diff(full: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """Largest parameter difference (absolute, and relative to the tensor's largest value)."""
    worst, where, worst_rel = 0.0, "", 0.0
    for key, value in ref.items():
        if not value.numel():
            continue
        diff = (full[key].double() - value.double()).abs().max().item()
        scale = value.double().abs().max().item()
        worst_rel = max(worst_rel, diff / max(scale, 1e-30))
        if diff > worst:
            worst, where = diff, key
    return {"keys_match": sorted(full) == sorted(ref), "param_max_abs": worst, "param_worst": where,
            "param_max_rel_scale": worst_rel}


def flat_buffers(model: torch.nn.Module) -> list:
    """The distinct flat buffers holding the model's sharded parameters, in parameter order (plain parameters
    outside blocks are replicated, in no buffer)."""
    from bmtwrap.engine.schedule import engine

    eng = engine()
    buffers: list = []
    for param in model.parameters():
        if not eng.registry.is_sharded(param):
            continue
        buffer, _ = eng.registry.buffer_of(eng.ctx, param)
        if all(buffer is not b for b in buffers):
            buffers.append(buffer)
    return buffers
