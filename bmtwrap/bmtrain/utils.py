"""BMTrain's small helpers (``bmtrain.utils``): printing blocks and dicts, memory reports, rounding, a running mean.

None of them is part of training itself; they keep BMTrain programs' logging lines working.
"""

from __future__ import annotations

import resource
import sys
from typing import Any, Dict, Optional, TextIO

import torch

from ..engine import dist as _dist

__all__ = ["AverageRecorder", "print_block", "print_dict", "round_up", "see_memory"]

# Width of the banner print_block draws, and of the value column print_dict wraps at.
ROW_WIDTH = 60


def round_up(x: int, d: int) -> int:
    """The smallest multiple of ``d`` that is at least ``x``."""
    return (x + d - 1) // d * d


def print_block(title: str, content: Optional[str] = None, file: Optional[TextIO] = None) -> None:
    """Print ``title`` in a banner ``ROW_WIDTH`` characters wide, then ``content`` (on every rank).

    Example::

        bmt.print_block("config", "lr=1e-4")
    """
    file = file or sys.stdout  # looked up per call: sys.stdout may have been replaced since import
    side = max(0, ROW_WIDTH - len(title) - 2)
    print(f"{'=' * (side // 2)} {title} {'=' * (side - side // 2)}", file=file)
    if content is not None:
        print(content, file=file)


def print_dict(title: str, content: Dict[str, Any], file: Optional[TextIO] = None) -> None:
    """Print ``key : value`` lines under a :func:`print_block` banner, keys padded to one width and
    values wrapped at ``ROW_WIDTH`` characters.

    Example::

        bmt.print_dict("hyper-parameters", {"lr": 1e-4, "batch": 32})
    """
    width = round_up(max((len(str(key)) for key in content), default=0), 4)
    lines = []
    for key, value in content.items():
        text = str(value)
        pieces = [text[i : i + ROW_WIDTH] for i in range(0, len(text), ROW_WIDTH)] or [""]
        lines.append(f"{str(key):<{width}} : {pieces[0]}")
        lines.extend(f"{'':<{width}}   {piece}" for piece in pieces[1:])
    print_block(title, "\n".join(lines), file=file)


def see_memory(message: str, detail: bool = False) -> None:
    """Rank 0 prints ``message`` and this process's memory; the peak statistics then start again.

    On a GPU: the allocated and peak-allocated GiB of torch's allocator (``detail``: its whole
    ``memory_summary``), after which every rank resets its peak. On the CPU: the peak resident
    set of the process, which cannot be reset.

    Raises:
        RuntimeError: :func:`bmtwrap.init_distributed` was not called.
    """
    ctx = _dist.current()
    if ctx.device.type == "cuda":
        if ctx.rank == 0:
            if detail:
                text = torch.cuda.memory_summary(ctx.device)
            else:
                gib = 1 << 30
                text = (f"allocated {torch.cuda.memory_allocated(ctx.device) / gib:.2f} GiB, "
                        f"peak {torch.cuda.max_memory_allocated(ctx.device) / gib:.2f} GiB")
            print(f"{message}\n{text}")
        torch.cuda.reset_peak_memory_stats(ctx.device)
    elif ctx.rank == 0:
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        print(f"{message}\npeak resident memory {peak_kib / (1 << 20):.2f} GiB (CPU)")


class AverageRecorder:
    """An exponential moving average with bias correction, for smoothed logging (BMTrain's).

    After ``n`` records, :attr:`value` is ``acc / (1 - alpha ** n)`` where ``acc`` follows
    ``acc = alpha * acc + (1 - alpha) * v``, so early values are not pulled towards the start.

    Args:
        alpha: the decay of older values.
        start_value: the accumulator before any record.

    Example::

        loss_avg = bmt.utils.AverageRecorder()
        loss_avg.record(loss.item()); print(loss_avg.value)
    """

    def __init__(self, alpha: float = 0.9, start_value: float = 0) -> None:
        self.alpha = alpha
        self._acc = start_value
        self._steps = 0

    def record(self, value: float) -> None:
        """Add one value."""
        self._acc = self.alpha * self._acc + (1 - self.alpha) * value
        self._steps += 1

    @property
    def value(self) -> float:
        """The bias-corrected average (the accumulator itself before any record)."""
        if self._steps == 0:
            return self._acc
        return self._acc / (1 - self.alpha ** self._steps)
