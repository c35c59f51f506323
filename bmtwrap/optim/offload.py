"""The offload pipeline behind AdamOffloadOptimizer: gradients to the CPU, Adam there, parameters back.

[Note: offload pipeline]
Work comes as one task per parameter shard and is cut into chunks of at most ``chunk_numel``
elements. On a GPU each chunk passes three stages, each on its own engine, so that they overlap
across chunks:

  D2H  the gradient chunk is copied into a pinned staging slot (a side CUDA stream), once the
       gradient is final on the compute stream (an event recorded when the task was queued);
  CPU  the vectorised CPU Adam updates the fp32 master and moments (plain CPU memory) and writes
       the rounded new parameter into the slot's output half (one worker thread; the kernel is
       itself multithreaded and releases the GIL);
  H2D  the output is copied into the parameter shard on the GPU (another side stream).

A fixed ring of ``slots`` staging slots bounds pinned memory to ``slots * chunk_numel * (gradient +
parameter bytes)`` whatever the model's size. D2H copies run up to ``slots - 1`` chunks ahead of
the update, so transfers hide behind CPU work; a slot is reused once its H2D copy is done.

Order: chunks are taken in the order their tasks arrived (during backward, when the optimizer
steps in backward, that is the order gradients become final) until :meth:`OffloadPipeline.
prioritise` is called (the user's ``step()``); from then on the lowest ``priority`` goes first,
which is the order the next forward gathers parameters in.

Readers: every task's parameter buffer gets a gate (a ``threading.Event``, set once the last H2D
copy of the parameter is queued) and a CUDA event recorded after that copy; a gather waits for
both, nothing else does. On a CPU-only machine there is no staging: the worker updates the
parameter in place and sets the gate.
"""

from __future__ import annotations

import collections
import ctypes
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional

import torch
from torch.autograd.graph import increment_version

from .. import ops

__all__ = ["OffloadPipeline", "OffloadTask", "advise_huge_pages", "host_zeros"]

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


@dataclass(eq=False)
class OffloadTask:
    """One parameter shard's update."""

    param: torch.Tensor  # the shard (GPU or CPU), 1-D or any shape, contiguous
    state: Dict[str, Any]  # exp_avg, exp_avg_sq (fp32, CPU) and "master" where the shard is not its own
    hyper: Dict[str, Any]  # keyword arguments of ops.adam_step_cpu
    grad: Optional[torch.Tensor]  # the gradient, on the shard's device; dropped once copied
    priority: int  # forward order: lower goes first once prioritised
    gate: threading.Event = field(default_factory=threading.Event)
    written: Optional[Any] = None  # CUDA event after the last H2D copy (GPU shards)
    ready: Optional[Any] = None  # CUDA event: the gradient is final on the compute stream
    chunks_left: int = 0


@dataclass(eq=False)
class _Chunk:
    task: OffloadTask
    start: int
    end: int


class _Slot:
    """Pinned staging for one chunk: the gradient in, the new parameter out."""

    def __init__(self, numel: int, grad_dtype: torch.dtype, param_dtype: torch.dtype) -> None:
        self.grad = torch.empty(numel, dtype=grad_dtype, pin_memory=True)
        self.out = torch.empty(numel, dtype=param_dtype, pin_memory=True)
        self.copied_back: Optional[Any] = None  # CUDA event of the last H2D copy from ``out``


class OffloadPipeline:
    """Runs :class:`OffloadTask` s on a worker thread (see [Note: offload pipeline]).

    Args:
        device: the parameters' device (``cpu`` or a CUDA device).
        chunk_numel: elements per chunk.
        slots: staging slots (GPU only), at least 2.
        threads: CPU threads of the Adam kernel (None: ``torch.get_num_threads()``).
    """

    def __init__(self, device: torch.device, *, chunk_numel: int = DEFAULT_CHUNK_NUMEL,
                 slots: int = DEFAULT_SLOTS, threads: Optional[int] = None) -> None:
        if chunk_numel < 1 or slots < 2:
            raise ValueError(f"need chunk_numel >= 1 and slots >= 2, got {chunk_numel} and {slots}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        self.device = device
        self.threads = threads
        self.chunk_numel = chunk_numel
        self.num_slots = slots
        self._slots: Dict[tuple, List[_Slot]] = {}  # (grad dtype, param dtype) -> ring
        self._queue: List[_Chunk] = []
        self._prioritised = False
        self._busy = 0  # tasks queued and not yet written back
        self._cond = threading.Condition()
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        if device.type == "cuda":
            self._d2h = torch.cuda.Stream(device)
            self._h2d = torch.cuda.Stream(device)

    # --- the caller's side -------------------------------------------------------------------------
    def submit(self, tasks: List[OffloadTask]) -> None:
        """Queue ``tasks``; on a GPU each gradient is read once the current stream reaches this point."""
        if not tasks:
            return
        self.raise_error()
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        chunks = []
        for task in tasks:
            if self.device.type == "cuda":
                task.ready = ready
                task.written = torch.cuda.Event()
            numel = task.param.numel()
            starts = range(0, numel, self.chunk_numel)
            task.chunks_left = len(starts)
            chunks.extend(_Chunk(task, s, min(s + self.chunk_numel, numel)) for s in starts)
        with self._cond:
            self._queue.extend(chunks)
            self._busy += len(tasks)
            self._cond.notify_all()
        self._ensure_thread()

    def prioritise(self) -> None:
        """From now until the queue empties, take chunks by priority instead of arrival."""
        with self._cond:
            self._prioritised = True
            self._cond.notify_all()

    def wait(self) -> None:
        """Block until every queued task is written back; raise the worker's error, if any."""
        with self._cond:
            while self._busy and self._error is None:
                self._cond.wait()
        self.raise_error()

    def raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("the offloaded optimizer step failed on its worker thread") from error

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="bmtwrap-offload-adam", daemon=True)
            self._thread.start()

    # --- the worker ------------------------------------------------------------------------------
    def _take(self, block: bool) -> Optional[_Chunk]:
        with self._cond:
            while not self._queue:
                if not block:
                    return None
                self._cond.wait()
            if self._prioritised:
                index = min(range(len(self._queue)), key=lambda i: self._queue[i].task.priority)
            else:
                index = 0
            chunk = self._queue.pop(index)
            if not self._queue:
                self._prioritised = False
            return chunk

    def _done(self, task: OffloadTask) -> None:
        increment_version(task.param)  # gathered copies of the old value are stale
        task.gate.set()
        with self._cond:
            self._busy -= 1
            self._cond.notify_all()

    def _fail(self, error: BaseException, pending: List[_Chunk]) -> None:
        # Release every waiter (gathers, wait()) so the error surfaces instead of a hang.
        with self._cond:
            self._error = error
            pending = pending + self._queue
            self._queue = []
            self._busy = 0
            self._cond.notify_all()
        for chunk in pending:
            chunk.task.gate.set()

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            loop: Callable[[Deque[_Chunk]], None] = self._run_cuda
        else:
            loop = self._run_cpu
        inflight: Deque[_Chunk] = collections.deque()
        try:
            loop(inflight)
        except BaseException as error:  # surfaced by wait() / the next submit()
            self._fail(error, list(inflight))

    def _run_cpu(self, inflight: Deque[_Chunk]) -> None:
        while True:
            chunk = self._take(block=True)
            inflight.append(chunk)
            task = chunk.task
            grad = task.grad.reshape(-1)[chunk.start : chunk.end]
            out = None if task.param.dtype == torch.float32 else task.param.view(-1)[chunk.start : chunk.end]
            _adam(task, chunk, grad, out, self.threads)
            inflight.popleft()
            task.chunks_left -= 1
            if task.chunks_left == 0:
                task.grad = None
                self._done(task)

    def _run_cuda(self, inflight: Deque[_Chunk]) -> None:
        staged: Deque[tuple] = collections.deque()  # (chunk, slot, D2H event)
        turn = 0
        while True:
            while len(staged) < self.num_slots:
                chunk = self._take(block=not staged)
                if chunk is None:
                    break
                inflight.append(chunk)
                slot = self._ring(chunk.task)[turn % self.num_slots]
                turn += 1
                if slot.copied_back is not None:
                    slot.copied_back.synchronize()  # its previous output has left for the GPU
                staged.append((chunk, slot, self._fetch(chunk, slot)))
            chunk, slot, fetched = staged.popleft()
            inflight.popleft()
            task = chunk.task
            fetched.synchronize()
            n = chunk.end - chunk.start
            _adam(task, chunk, slot.grad[:n], slot.out[:n], self.threads)
            with torch.cuda.stream(self._h2d):
                task.param.view(-1)[chunk.start : chunk.end].copy_(slot.out[:n], non_blocking=True)
                slot.copied_back = torch.cuda.Event()
                slot.copied_back.record(self._h2d)
            task.chunks_left -= 1
            if task.chunks_left == 0:
                task.written.record(self._h2d)
                self._done(task)

    def _ring(self, task: OffloadTask) -> List[_Slot]:
        key = (task.grad.dtype, task.param.dtype)
        ring = self._slots.get(key)
        if ring is None:
            ring = [_Slot(self.chunk_numel, *key) for _ in range(self.num_slots)]
            self._slots[key] = ring
        return ring

    def _fetch(self, chunk: _Chunk, slot: _Slot) -> Any:
        task = chunk.task
        n = chunk.end - chunk.start
        with torch.cuda.stream(self._d2h):
            self._d2h.wait_event(task.ready)
            slot.grad[:n].copy_(task.grad.reshape(-1)[chunk.start : chunk.end], non_blocking=True)
            fetched = torch.cuda.Event()
            fetched.record(self._d2h)
        if chunk.end == task.param.numel():
            # The copy holds the only use left of this gradient; the caller's references may be gone, so
            # the caching allocator must not hand its memory out before the copy has read it.
            task.grad.record_stream(self._d2h)
            task.grad = None
        return fetched


def _adam(task: OffloadTask, chunk: _Chunk, grad: torch.Tensor, out: Optional[torch.Tensor],
          threads: Optional[int]) -> None:
    state = task.state
    master = state.get("master", task.param).view(-1)[chunk.start : chunk.end]
    ops.adam_step_cpu(master, grad, state["exp_avg"].view(-1)[chunk.start : chunk.end],
                      state["exp_avg_sq"].view(-1)[chunk.start : chunk.end], out=out, num_threads=threads,
                      **task.hyper)
