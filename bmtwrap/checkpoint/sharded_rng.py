"""RNG states in a sharded checkpoint: each rank saves its own, and a rank loads the state its rank saved.

Rank r restores the Python ``random``, NumPy, torch CPU and (if both runs use CUDA) CUDA states that
rank r saved. At a larger world size, a rank ``r >= saved world size`` is seeded afresh with a seed
derived from the checkpoint's tag and ``r``: deterministic for a given checkpoint, different on
every rank.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Dict, List, Optional

import torch

from ..engine.dist import DistContext
from .sharded_format import _encode, _RankPart, _ShardReader

__all__: List[str] = []  # private to the checkpoint package: sharded.py is the public side


def _collect_rng(part: _RankPart, ctx: DistContext) -> None:
    """This rank's RNG states (taken first, before anything could draw from them)."""
    names: Dict[str, Optional[str]] = {"torch_cpu": f"rng/{ctx.rank}/torch_cpu", "torch_cuda": None}
    cpu = torch.get_rng_state()
    part.add(names["torch_cpu"], cpu, 0, (cpu.numel(),))
    if ctx.device.type == "cuda":
        names["torch_cuda"] = f"rng/{ctx.rank}/torch_cuda"
        cuda = torch.cuda.get_rng_state(ctx.device)
        part.add(names["torch_cuda"], cuda, 0, (cuda.numel(),))
    part.rng = {"python": _encode(random.getstate(), "random state"), "numpy": _numpy_state(), **names}


def _numpy_state() -> Optional[List[Any]]:
    try:
        import numpy
    except ImportError:
        return None
    kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
    return [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]


def _plan_rng(index: Dict[str, Any], reader: _ShardReader, rank: int) -> None:
    if rank < len(index["rng"]):
        for key in ("torch_cpu", "torch_cuda"):
            name = index["rng"][rank][key]
            if name is not None:
                reader.require(name, 0, reader.shape(name)[0])


def _restore_rng(index: Dict[str, Any], reader: _ShardReader, ctx: DistContext) -> None:
    """Rank r takes saving rank r's states; a rank the saving run did not have gets fresh seeds."""
    if ctx.rank >= len(index["rng"]):
        digest = hashlib.sha256(f"{index['tag']}:{ctx.rank}".encode()).digest()
        seed = int.from_bytes(digest[:8], "little") >> 1
        random.seed(seed)
        torch.manual_seed(seed)  # every CUDA device too
        _set_numpy(None, seed)
        return
    saved = index["rng"][ctx.rank]
    random.setstate(saved["python"])
    _set_numpy(saved["numpy"], None)
    torch.set_rng_state(reader.read(saved["torch_cpu"], 0, reader.shape(saved["torch_cpu"])[0]))
    if saved["torch_cuda"] is not None and ctx.device.type == "cuda":
        torch.cuda.set_rng_state(reader.read(saved["torch_cuda"], 0, reader.shape(saved["torch_cuda"])[0]), ctx.device)


def _set_numpy(state: Optional[List[Any]], seed: Optional[int]) -> None:
    try:
        import numpy
    except ImportError:
        return
    if seed is not None:
        numpy.random.seed(seed % 2**32)
    elif state is not None:
        kind, keys, pos, has_gauss, gauss = state
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, gauss))
