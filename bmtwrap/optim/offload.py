"""Host memory for AdamOffloadOptimizer: the chunk and staging sizes, and state on huge pages.

The pipeline itself (gradients to the CPU, Adam there, parameters back, all on a C++ worker thread)
is ``ops.OffloadQueue``; see [Note: offload queue] in ``csrc/cpu/offload.cpp``.
"""

from __future__ import annotations

import ctypes
import sys

import torch

__all__ = ["DEFAULT_CHUNK_NUMEL", "DEFAULT_SLOTS", "advise_huge_pages", "host_zeros"]

# Chunks of 16 Mi elements: 32 MiB of bf16 gradient, a few milliseconds of CPU Adam; large enough
# that per-chunk overheads vanish, small enough that the first chunk of a step starts early.
DEFAULT_CHUNK_NUMEL = 16 * 1024 * 1024
DEFAULT_SLOTS = 4

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def host_zeros(numel: int) -> torch.Tensor:
    """An fp32 CPU tensor of zeros, backed by transparent huge pages where the kernel allows.

    The Adam update streams through gigabytes of state; on 4 KiB pages the hardware prefetcher
    stops at every page boundary and the TLB misses often. The advice is given before the first
    touch, so the pages are huge from the start (where THP is "madvise" or "always").
    """
    tensor = torch.empty(numel, dtype=torch.float32)
    advise_huge_pages(tensor)
    return tensor.zero_()


def advise_huge_pages(tensor: torch.Tensor) -> None:
    """Ask Linux to back ``tensor``'s whole 2 MiB pages with huge pages (effective before first touch)."""
    if not sys.platform.startswith("linux") or tensor.nbytes < 2 * _HUGE_PAGE:
        return
    start = -(-tensor.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (tensor.data_ptr() + tensor.nbytes) // _HUGE_PAGE * _HUGE_PAGE
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass  # advice only: without it the memory works the same, a little slower
