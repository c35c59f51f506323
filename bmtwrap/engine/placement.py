"""Where the offload optimizer keeps each parameter's state, decided once from what fits, before any state exists.

[Note: automatic offload fraction]
``AdamOffloadOptimizer(offload_fraction="auto")`` (what :func:`bmtwrap.optim.auto_adam` builds on a GPU) keeps on
the GPU the optimizer state that fits there and updates the rest on the CPU. It decides at the start of the first
``step()``, before it makes any state, from what the first step's forward and backward measured on this card (or
under ``wrap(max_gpu_memory=...)``), and every rank keeps the same share (the one with the least room decides):

- ``limit``: the card (or the budget), less ``headroom`` of it (at least ``MIN_MARGIN``) for what varies between
  steps and what the allocator cannot hand out, less the memory outside torch's allocator (the CUDA context,
  NCCL's buffers), as ``nvidia-smi`` counts;
- ``peak``: the most the first step held in tensors (parameters, gathered blocks, every gradient, the activations
  and the recomputation; no optimizer state yet), and ``loss_peak``: the most before backward made its first final
  gradient (the forward, the loss, the last block's recomputation);
- each parameter ``p`` kept on the GPU costs its state there (10 bytes per element for bf16, 12 for fp16, 8 for
  fp32: see [Note: mixed precision] in ``adam_state.py``); the rest cost the GPU nothing but their gradients:
  * ``GradsOnGpu.LEAVE``: gradients updated on the CPU are copied to the host as backward makes them final and
    leave the GPU (``AdamOffloadOptimizer(step_in_backward=...)`` other than ``False``, one backward per step): a
    step then holds ``max(loss_peak, peak - those gradients) + state``;
  * ``GradsOnGpu.ACCUMULATE``: the same, but several backward passes make one step, so every gradient is on the
    GPU between them: ``peak + state``;
  * ``GradsOnGpu.WAIT`` (``step_in_backward=False``): a gradient updated on the CPU stays on the GPU until the CPU
    takes it, up to a step's worth into the next step: ``peak + that worth + state``, a kept parameter's gradient
    sparing its share.
  The parameters the next forward needs first go first (those outside blocks, then the first blocks): their CPU
  updates would be the last of a step and the first the next forward waits for.

[Note: speculative updates]
With ``step_in_backward="auto"`` on a GPU (the default), each block's CPU update starts during backward, as soon as
its gradient is final, assuming that the step will apply the gradient as it is: a clipping coefficient of 1, no loss
scale, this backward the last before ``step()``, gradients finite, the same hyper-parameters. It reads the state and
writes the new state into a second set of buffers; ``step()`` checks the assumption and swaps the sets where it held,
and where it did not, redoes the update from the untouched state with what the step really applies (the CPU then
works after backward, as without speculation). A forward or a ``zero_grad()`` before ``step()`` cancels it: the
parameters get back the values they had. The result is the same, bit for bit, as updating after backward. The second
set takes the state's bytes again in host memory, so only the share that fits the host (less a margin, divided
among this host's processes) is updated speculatively: the last blocks first, whose gradients backward makes
first.

[Note: who gets the GPU memory left]
Two automatic choices spend the GPU memory that the first step leaves unused: the offload
optimizer's ``offload_fraction="auto"`` moves optimizer state there, and ``checkpoint="auto"``
keeps blocks' activations instead of recomputing them. The state comes first: a GiB of it
spares the CPU update of 89 M elements (about 20 ms of a CPU's step), a GiB of kept
activations spares a fraction of one block's forward (a few ms), and the CPU update is the
slower side of an offloaded step. So the optimizer claims the bytes of all its state when it
is built and settles at the first step, before it makes any, and ``checkpoint="auto"`` decides only at
the first forward after an optimizer step (``wrap/auto.py``): it measures the state the
optimizer made, and keeps activations only in the memory beyond any claim still open. Once
settled, the optimizer claims only the state it decided to keep on the GPU but has not made
yet, and withdraws the claim at the end of the first step (or with the optimizer).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Sequence

__all__ = ["AUTO_HEADROOM", "FIXED_SEGMENTS_HEADROOM", "HOST_MARGIN", "HOST_MIN_MARGIN", "Candidate", "GradsOnGpu",
           "Measured", "kept_on_gpu", "speculation_share"]

# offload_fraction="auto" leaves this share of the GPU free, and this much more where the allocator's segments are
# of fixed size (fragmentation strands memory there). The state cannot give memory back as checkpoint="auto"'s
# activations can, so it keeps more than that one's margin (memory.MARGIN): on one H100 (8B, 4 x 2048 tokens) the
# allocator held 4 GiB beyond its tensors at the peak, and with 4 % the card was full to 0.2 GiB.
AUTO_HEADROOM = 0.08
FIXED_SEGMENTS_HEADROOM = 0.04
# Host memory the speculative share leaves free: this share of what is available, at least HOST_MIN_MARGIN.
HOST_MARGIN = 0.1
HOST_MIN_MARGIN = 4 * 2**30


class GradsOnGpu(enum.Enum):
    """How long the gradients of the parameters updated on the CPU stay on the GPU (see the Note)."""

    LEAVE = "leave"  # copied to the host as backward makes them final
    ACCUMULATE = "accumulate"  # on the GPU between the backward passes of a step, then copied to the host
    WAIT = "wait"  # until the CPU takes them, up to a step's worth into the next step


@dataclass(frozen=True)
class Measured:
    """What the first step showed of the GPU, in bytes (see [Note: automatic offload fraction]).

    Attributes:
        ceiling: the card, or the budget (``wrap(max_gpu_memory=...)``), at most the card.
        outside: memory outside torch's allocator (the CUDA context, NCCL's buffers).
        margin: what is left unplanned (headroom and margin).
        peak: the first step's peak in tensors, with every gradient and no optimizer state.
        loss_peak: the peak before backward made its first final gradient.
    """

    ceiling: int
    outside: int
    margin: int
    peak: int
    loss_peak: int

    @property
    def limit(self) -> int:
        return self.ceiling - self.margin - self.outside


@dataclass(frozen=True)
class Candidate:
    """One parameter shard, in the order the next forward needs it.

    Attributes:
        on_gpu: the shard is on the GPU (a shard offloaded to the host keeps its state there).
        state: bytes of its optimizer state on the GPU.
        grad: bytes of its gradient.
        in_block: its gradient is final during backward (a block's), so it can leave the GPU then.
        spare: bytes of a second set of its host state for a speculative update (0: it cannot have one).
    """

    on_gpu: bool
    state: int
    grad: int
    in_block: bool
    spare: int = 0


def kept_on_gpu(candidates: Sequence[Candidate], measured: Measured, grads: GradsOnGpu) -> List[bool]:
    """Which candidates keep their state on the GPU: the first ones, in order, while the step fits ``limit``.

    A candidate off the GPU is skipped (its state is on the host) without ending the run.
    """
    limit = measured.limit
    kept = [False] * len(candidates)
    state = 0
    if grads is GradsOnGpu.WAIT:
        # Every gradient updated on the CPU may wait on the GPU; a kept one spares its share.
        base = measured.peak + sum(c.grad for c in candidates if c.on_gpu)
        for index, c in enumerate(candidates):
            if not c.on_gpu:
                continue
            if base + state + c.state - c.grad > limit:
                break
            state += c.state - c.grad
            kept[index] = True
        return kept
    leave = grads is GradsOnGpu.LEAVE
    # With every gradient leaving: what the step holds beside the state, once the loss is past.
    after = measured.peak - (sum(c.grad for c in candidates if c.on_gpu and c.in_block) if leave else 0)
    for index, c in enumerate(candidates):
        if not c.on_gpu:
            continue
        grows = c.grad if leave and c.in_block else 0  # a kept parameter's gradient stays on the GPU
        if max(measured.loss_peak, after + grows) + state + c.state > limit:
            break
        after += grows
        state += c.state
        kept[index] = True
    return kept


def speculation_share(candidates: Sequence[Candidate], kept: Sequence[bool], host_room: int) -> List[bool]:
    """Which candidates updated on the CPU get a second set of host state for speculative updates: from the last
    (whose gradients backward makes first) while their ``spare`` bytes fit ``host_room``."""
    chosen = [False] * len(candidates)
    for index in range(len(candidates) - 1, -1, -1):
        c = candidates[index]
        if kept[index] or not c.in_block or c.spare <= 0:
            continue
        if c.spare > host_room:
            break
        host_room -= c.spare
        chosen[index] = True
    return chosen
