"""Offload in one place: what a flat buffer keeps on the host, the host memory it lives in, and the sizes of
the optimizer's staging.

[Note: what is offloaded, and who reads it]
Two things can move to the host, independently:
- the parameter shards of the blocks, and their gradients (``wrap(offload_params=True)``,
  ``Block(offload_params=True)``). The choice is an :class:`OffloadPolicy`, held by every flat buffer
  (``group.FlatBuffer.offload``), which allocates its shard through :meth:`OffloadPolicy.new_shard`; how
  gathers and gradient copies cross to and from the host is [Note: offloaded shards] in ``group.py``.
  ``AdamOffloadOptimizer`` reads the policy from the buffer of each parameter rather than guessing from
  devices: a shard kept on the host is always updated there.
- Adam's fp32 master and moments (``AdamOffloadOptimizer``), in :func:`host_zeros` memory. The pipeline
  that updates them (gradients to the host, Adam there, parameters back, all on a C++ worker thread) is
  ``ops.OffloadQueue``, with ``DEFAULT_SLOTS`` pinned staging chunks of ``DEFAULT_CHUNK_NUMEL`` elements;
  see [Note: offload queue] in ``csrc/cpu/offload.cpp``.

This module depends on torch alone: the engine (``group.py``) and the optimizers import it, never the
other way.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

__all__ = ["DEFAULT_CHUNK_NUMEL", "DEFAULT_SLOTS", "PINNED", "OffloadPolicy", "PinnedPool", "adam_state_bytes",
           "advise_huge_pages", "expandable_segments", "host_available_bytes", "host_empty", "host_zeros"]

# Chunks of 16 Mi elements: 32 MiB of bf16 gradient, a few milliseconds of CPU Adam; large enough
# that per-chunk overheads vanish, small enough that the first chunk of a step starts early.
DEFAULT_CHUNK_NUMEL = 16 * 1024 * 1024
DEFAULT_SLOTS = 4

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


def adam_state_bytes(dtype: torch.dtype, offloaded: bool = False) -> int:
    """Bytes per element of Adam's state for a parameter of ``dtype``: two fp32 moments, plus an fp32
    master for a 16-bit parameter (an fp32 one is its own master). Beside a bf16 parameter (state on its
    own device, not ``offloaded``) the master takes 2 bytes: the parameter holds its other half (see
    [Note: mixed precision] in ``optim/adam_state.py``)."""
    if dtype == torch.float32:
        return 8
    return 10 if dtype == torch.bfloat16 and not offloaded else 12


@dataclass(frozen=True)
class OffloadPolicy:
    """What one flat buffer (a block's or the root's parameters of one dtype) keeps in host memory.

    Example::

        policy = OffloadPolicy(params=True)
        shard = policy.new_shard(1024, torch.bfloat16, torch.device("cuda", 0), zeroed=True)  # pinned, on the host
    """

    params: bool = False
    """Keep the parameter shard, and the reduced gradient shards, in pinned host memory while the model
    computes on the GPU (the GPU holds the parameters only while they are gathered). Default False: the
    shard lives on the device the model computes on."""

    def new_shard(self, numel: int, dtype: torch.dtype, compute: torch.device, *, zeroed: bool) -> torch.Tensor:
        """A flat shard of ``numel`` elements where this policy keeps it.

        Args:
            numel: elements of the shard.
            dtype: its dtype.
            compute: the device the model computes on; the shard goes there, or to the host, pinned for
                asynchronous copies when ``compute`` is a CUDA device.
            zeroed: zeros; False leaves it uninitialised (a model built on the meta device, to be filled by
                materialisation or loading).
        """
        if not self.params:
            return (torch.zeros if zeroed else torch.empty)(numel, dtype=dtype, device=compute)
        shard = host_empty(numel, dtype, pinned=compute.type == "cuda")
        return shard.zero_() if zeroed else shard


def host_empty(numel: int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor, ``pinned`` (page-locked) where copies between it and a GPU must run
    asynchronously: from pageable memory they would block the host. Pinned memory comes from
    :data:`PINNED`, in exactly the bytes asked for."""
    if not pinned:
        return torch.empty(numel, dtype=dtype)
    return torch.frombuffer(PINNED.take(numel * dtype.itemsize), dtype=dtype, count=numel) if numel else \
        torch.empty(0, dtype=dtype, pin_memory=True)


class PinnedPool:
    """Page-locked host memory in blocks of exactly the size asked for, reused once their tensors die.

    [Note: exact-size pinned memory]
    torch's pinned allocator rounds every block up to a power of two: an offloaded block's
    436 MiB shard takes 512 MiB, a 1 GiB one 2 GiB, and an 8B model's offloaded shards and
    gradients need a fifth more host memory than they hold. Here a block is plain host memory of
    the exact size (advised onto huge pages), page-locked with ``cudaHostRegister`` so that copies
    to and from a GPU run asynchronously. A tensor made from a block (``torch.frombuffer``) holds
    it through a small handle; when the tensor's memory is freed, the handle's finaliser returns the
    block to the pool for the next request of the same size (a block's gradients, step after step).
    Blocks are never unregistered: the pool only grows to the most memory held at once.

    Reuse needs no stream bookkeeping because of who frees: a gradient copied to the host is read
    only after its copy's event, and the engine waits for every such copy when backward ends
    ([Note: offloaded shards] in ``group.py``), so a freed block has no copy in flight.
    """

    def __init__(self) -> None:
        self._free: Dict[int, List[int]] = {}  # bytes -> addresses of free blocks of that size
        self._backing: List[torch.Tensor] = []  # the host memory of every block, kept for good
        self._handles: Dict[int, type] = {}  # bytes -> the handle class of that size
        self._lock = threading.Lock()
        self.registered_bytes = 0

    def take(self, nbytes: int) -> "ctypes.Array":
        """A handle of ``nbytes`` pinned bytes (a writable buffer for ``torch.frombuffer``)."""
        with self._lock:
            free = self._free.get(nbytes)
            address = free.pop() if free else None
            handle = self._handles.get(nbytes)
            if handle is None:
                give_back = lambda block: self.put(ctypes.addressof(block), nbytes)  # noqa: E731
                handle = self._handles[nbytes] = type("PinnedBlock", (ctypes.c_ubyte * nbytes,),
                                                      {"__del__": give_back, "__slots__": ()})
        if address is None:
            address = self._register(nbytes)
        return handle.from_address(address)

    def bytes_in_use(self) -> int:
        """Registered bytes held by live tensors (the rest wait in the pool)."""
        with self._lock:
            return self.registered_bytes - sum(size * len(free) for size, free in self._free.items())

    def put(self, address: int, nbytes: int) -> None:
        with self._lock:
            self._free.setdefault(nbytes, []).append(address)

    def _register(self, nbytes: int) -> int:
        backing = torch.empty(nbytes, dtype=torch.uint8)
        advise_huge_pages(backing)
        error = torch.cuda.cudart().cudaHostRegister(backing.data_ptr(), nbytes, _CUDA_HOST_REGISTER_PORTABLE)
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes / 2**20:.1f} MiB of host memory failed ({error}): "
                               "the host may be short of lockable memory (ulimit -l) or of memory")
        with self._lock:
            self._backing.append(backing)
            self.registered_bytes += nbytes
        return backing.data_ptr()


PINNED = PinnedPool()
"""The process's pool of exact-size pinned host memory ([Note: exact-size pinned memory])."""


def expandable_segments() -> bool:
    """Turn on the CUDA caching allocator's expandable segments, unless the allocator's configuration is the
    user's (``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF`` set); whether they are on.

    An optimizer that fills the card with state (``offload_fraction="auto"``) leaves a few GiB free. With
    fixed-size segments, blocks freed at one size and asked for at another strand several GiB as reserved
    but unusable memory; expandable segments map memory in pages as needed, so what is free can be used.
    Segments made before the call keep their kind.
    """
    conf = os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    if conf is not None:
        return "expandable_segments:true" in conf.replace(" ", "").lower()
    # torch 2.10 moved the setting to the accelerator-generic call; the CUDA one warns since.
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    try:
        setter("expandable_segments:True")
    except (AttributeError, RuntimeError):
        return False  # a torch without the setting, or a backend that refuses it
    return True


def host_available_bytes(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """The host memory the kernel can still give without swapping (Linux ``MemAvailable``); None where
    that is not known."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


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
