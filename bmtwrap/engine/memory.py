"""GPU memory as the engine sees it: sizes a user writes ("24GiB"), and a gauge of what a step uses.

[Note: what a GPU budget counts]
``max_gpu_memory`` bounds what this process takes from the card, as ``nvidia-smi`` shows it: the
caching allocator's reserve (tensors, plus the cached blocks and fragments the allocator holds) and
the memory outside it (the CUDA context, NCCL's buffers, cuBLAS workspaces). The allocator's
counters see only the first part, so the gauge measures the second as what the driver reports used
on the card less the allocator's reserve. Other processes on the same card count there too, which
is what a shared card needs: the memory they hold is not ours to plan with. Under a budget the
allocator itself is capped (``cap_allocator``), so that its cache cannot carry the process over.
"""

from __future__ import annotations

import re
from typing import Optional, Protocol, Union

import torch

__all__ = ["CARDS", "MARGIN", "CudaGauge", "cap_allocator", "ceiling_bytes", "Gauge", "format_bytes", "gauge_for",
           "margin_bytes", "out_of_memory_advice", "outside_allocator_estimate", "parse_bytes"]

# Share of the card checkpoint="auto" leaves unplanned (at least MIN_MARGIN): what varies between steps
# (another sequence length, the allocator's rounding) and what its prediction cannot see.
MARGIN = 0.04
MIN_MARGIN = 512 * 2**20
# What a process took outside the allocator beyond outside_allocator_estimate, at most, on the cards measured
# (1.45 GiB against 1.3 for one process): kept out of the allocator's cap under a budget (cap_allocator).
CAP_SLACK = 256 * 2**20

# Cards by name, with the memory torch reports for them (torch.cuda.get_device_properties(...).total_memory):
# plans for a card (python -m bmtwrap plan --max-gpu-memory H100) and budgets the size of one.
CARDS = {
    "h100": 85_017_493_504,  # H100 80GB HBM3 (SXM): 79.18 GiB
    "h200": 150_110_011_392,  # H200 141GB HBM3e: 139.8 GiB
    "a100-80gb": 84_987_740_160,  # A100 80GB: 79.15 GiB
    "a100-40gb": 42_298_834_944,  # A100 40GB: 39.39 GiB
}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Union[int, float, str], *, name: str = "max_gpu_memory") -> int:
    """``"24GiB"``, ``"80GB"``, ``"512MiB"``, a number of bytes, or the name of a card in ``CARDS`` (``"H100"``:
    its memory as torch reports it) → bytes (``name`` for the error).

    Raises:
        ValueError: not a positive size, a unit other than B, kB/MB/GB/TB, KiB/MiB/GiB/TiB, or an unknown card.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a size such as '24GiB' or a number of bytes, got {value!r}")
    if isinstance(value, str) and value.strip().lower() in CARDS:
        return CARDS[value.strip().lower()]
    if isinstance(value, (int, float)):
        nbytes = value
    elif isinstance(value, str):
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(f"{name} must be a size such as '24GiB', '80GB' or '512MiB' (units B, kB, MB, GB, TB, "
                             f"KiB, MiB, GiB, TiB) or a card ({', '.join(sorted(CARDS))}), got {value!r}")
        nbytes = float(match.group(1)) * _UNITS[unit]
    else:
        raise ValueError(f"{name} must be a size such as '24GiB' or a number of bytes, got {type(value).__name__}")
    if not nbytes > 0:
        raise ValueError(f"{name} must be a positive size, got {value!r}")
    return int(nbytes)


def outside_allocator_estimate(world_size: int) -> int:
    """The GPU memory a training process takes outside torch's allocator, for plans made before it runs.

    Measured with torch 2.11 on H100 and H200 cards, as what the driver reports used less the allocator's
    reserve during training: 1.3 GiB for one process (the CUDA context, cuBLAS's workspaces), 1.6 GiB per
    process in a job of two (NCCL's buffers). Jobs with more peers take somewhat more.
    """
    return int((1.3 if world_size == 1 else 1.6) * 2**30)


def cap_allocator(device: torch.device, budget: int, world_size: int) -> int:
    """Hold torch's caching allocator on ``device`` to ``budget`` less the memory a process takes outside it
    (``outside_allocator_estimate``, and ``CAP_SLACK`` more); returns the cap in bytes.

    Past the cap the allocator hands its cached blocks back to the driver and retries before it fails
    (``torch.cuda.set_per_process_memory_fraction``), so what it holds beyond its tensors (cached blocks
    of other sizes, fragments) cannot carry the process over the budget. Only tensors that do not fit
    raise out of memory. The estimate is used rather than a reading, because a reading counts other
    processes on the card too, and a cap that excluded them could leave this one nothing. Like the
    budget, the cap holds for the rest of the process.
    """
    card = torch.cuda.get_device_properties(device).total_memory
    cap = max(0, min(budget, card) - outside_allocator_estimate(world_size) - CAP_SLACK)
    torch.cuda.set_per_process_memory_fraction(cap / card, device)
    return cap


def ceiling_bytes(gauge: "Gauge", budget: Optional[int], cap: Optional[int]) -> int:
    """Bytes the process may take from the card, as ``nvidia-smi`` counts: the card, or ``budget`` (at most the
    card); under a capped allocator (``cap_allocator``), at most the cap plus the memory outside the allocator now."""
    card = gauge.card_bytes()
    if budget is None:
        return card
    ceiling = min(budget, card)
    return ceiling if cap is None else min(ceiling, cap + gauge.outside_allocator())


def margin_bytes(card: int) -> int:
    """The bytes of a card of ``card`` bytes that ``checkpoint="auto"`` leaves unplanned."""
    return max(MIN_MARGIN, int(MARGIN * card))


def format_bytes(nbytes: float) -> str:
    """``12.3 GiB``, ``512 MiB``: for messages."""
    if abs(nbytes) >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    return f"{nbytes / 2**20:.0f} MiB"


class Gauge(Protocol):
    """What the automatic choices read of a device's memory (see [Note: what a GPU budget counts])."""

    def card_bytes(self) -> int:
        """The device's whole memory."""
        ...

    def allocated(self) -> int:
        """Bytes in live tensors now."""
        ...

    def peak(self) -> int:
        """The most bytes in live tensors since :meth:`reset_peak`."""
        ...

    def reserved_peak(self) -> int:
        """The most bytes the allocator held (tensors and cache) since :meth:`reset_peak`."""
        ...

    def reset_peak(self) -> None:
        ...

    def outside_allocator(self) -> int:
        """Bytes this process (and any other on the card) uses outside the allocator now."""
        ...


class CudaGauge:
    """:class:`Gauge` of one CUDA device, from the caching allocator's counters and the driver's."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def card_bytes(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reserved_peak(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def outside_allocator(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return max(0, total - free - torch.cuda.memory_reserved(self.device))


def gauge_for(device: torch.device) -> Optional[Gauge]:
    """The gauge of ``device``; ``None`` where memory is not measured (the CPU)."""
    return CudaGauge(device) if device.type == "cuda" else None


def out_of_memory_advice(device: torch.device, all_recompute: bool) -> str:
    """What a step that ran out of memory on ``device`` measured, and the options that change it (for messages);
    ``all_recompute``: every block already recomputes in backward."""
    if device.type != "cuda":
        return "The host ran out of memory: a smaller per-process batch, or fewer processes per host."
    gauge = CudaGauge(device)
    recompute = ("every block already recomputes in backward" if all_recompute else
                 "wrap(model, checkpoint=True) recomputes every block")
    return (f"GPU memory: a peak of {format_bytes(gauge.peak())} in tensors ({format_bytes(gauge.reserved_peak())} "
            f"held by the allocator, {format_bytes(gauge.outside_allocator())} outside it) on a card of "
            f"{format_bytes(gauge.card_bytes())}. To fit: {recompute}; wrap(model, max_gpu_memory='...') plans for "
            "less of the card; AdamOffloadOptimizer(offload_fraction=1.0) or wrap(model, offload_params=True) moves "
            "optimizer state or parameters to the host; or a smaller per-GPU batch. `python -m bmtwrap plan` "
            "estimates each.")
