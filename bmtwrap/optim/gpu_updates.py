"""The updates of the state kept on the GPU, on a side stream beside the next forward.

[Note: GPU updates beside the next forward]
``AdamOffloadOptimizer.step()`` updates the parameters whose state stays on the GPU with the fused
Adam kernel, which reads and writes 28 bytes an element (bf16 parameter and gradient, fp32 master and
moments): bound by memory bandwidth, and a few percent of an 8B step at the card's bandwidth. Run on
the computing stream, the next forward starts only after all of it. Here they run on a side stream
instead, in the order the next forward reads the parameters (those outside the blocks, gathered
first, then the blocks in order), and each block's parameter buffer records the point its updates
reach (an ``await_write``, as for the CPU's updates): its next gather, issued while the block before
it computes, makes the computing stream wait for that point only. The first block waits for its own
updates and those outside the blocks; the later blocks' updates run while earlier blocks compute. On two
H200s it took 0.7 % off the 8B step (``benchmarks/RESULTS.md``, "Two H200s"), of the about 4 % the update
takes there (each GPU's 4 B elements at 28 bytes and the 3.9 TB/s the kernel was measured at).
Run during backward instead (``step_in_backward=True`` with the state on the GPU), they take SMs from
backward's matrix products: on one H200 at 1B the step took 3.7 ms more, and the updates 60 % longer
(``benchmarks/RESULTS.md``, "Adam during backward").

What keeps it exact:
- the side stream starts after the computing stream's work so far (the gradients are final);
- each gradient is recorded as used on the side stream (``record_stream``), so ``zero_grad()``
  freeing it does not let the allocator give its memory to the next forward before the update has
  read it; ``zero_grad(set_to_none=False)``, which writes zeros over it, first waits for the updates;
- a parameter no gather stands before (not a wrapped model's) makes the computing stream wait at once;
- whoever reads the state or the shards otherwise (``state_dict()``, ``load_state_dict()``,
  checkpoints, which wait for each buffer's writes) waits for the updates first (:meth:`GpuUpdates.wait`).

``BESIDE_FORWARD = False`` runs them on the computing stream as before (for comparison).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .adam_state import Work, _update_in_place

__all__ = ["BESIDE_FORWARD", "GpuUpdates", "StreamWrite"]

BESIDE_FORWARD = True


class StreamWrite:
    """Updates queued on a side stream up to an event: :meth:`wait` orders the current stream after them (the
    ``await_write`` protocol of the engine's buffers)."""

    __slots__ = ("_event", "_device")

    def __init__(self, event: "torch.cuda.Event", device: torch.device) -> None:
        self._event = event
        self._device = device

    def wait(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)


class GpuUpdates:
    """Runs the GPU-state updates of one optimizer (see [Note: GPU updates beside the next forward])."""

    def __init__(self) -> None:
        self._stream: Optional["torch.cuda.Stream"] = None

    def run(self, work: List[Work], priority: Dict[int, int], buffer_of: Callable[[torch.Tensor], Any],
            skip_if: Optional[torch.Tensor] = None) -> None:
        """Update every ``(param, state, hyper)`` of ``work``; ``priority`` orders them as the next forward reads
        them, and ``buffer_of(param)`` is the engine buffer whose gather must wait for ``param``'s update (or
        ``None``). The GPU's updates write nothing if ``skip_if`` is set when they run (see [Note: updates
        before the check] in ``nonfinite.py``)."""
        beside: List[Work] = []
        for item in work:
            if BESIDE_FORWARD and item[0].is_cuda:
                beside.append(item)
            else:
                _update_in_place(*item, skip_if=skip_if)
        if not beside:
            return
        device = beside[0][0].device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        stream, current = self._stream, torch.cuda.current_stream(device)
        stream.wait_stream(current)  # the gradients are final
        by_buffer: Dict[int, Tuple[Any, List[Work]]] = {}
        for item in sorted(beside, key=lambda item: priority[id(item[0])]):
            buffer = buffer_of(item[0])
            by_buffer.setdefault(id(buffer), (buffer, []))[1].append(item)
        with torch.cuda.stream(stream):
            for buffer, items in by_buffer.values():
                for p, state, hyper in items:
                    p.grad.record_stream(stream)  # zero_grad() may free it before the update has read it
                    _update_in_place(p, state, hyper, skip_if)
                event = torch.cuda.Event()
                event.record(stream)
                write = StreamWrite(event, device)
                if buffer is None:
                    write.wait()  # nothing gathers it: its next reader is the computing stream itself
                else:
                    buffer.await_write(write)

    def wait(self) -> None:
        """Order the current stream after every update queued so far."""
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
