"""Where an offload optimizer's state lives: the decision made at its first step, before any state exists (the
arithmetic is in ``bmtwrap/engine/placement.py``)."""

from __future__ import annotations

import os
from typing import List, Optional, Set

import torch

from ..engine import placement
from ..engine.dist import agree_max, is_initialized
from ..engine.memory import MIN_MARGIN, ceiling_bytes
from ..engine.offload import adam_state_bytes, host_available_bytes, host_zeros
from ..engine.placement import (HOST_MARGIN, HOST_MIN_MARGIN, Candidate, GradsOnGpu, Measured, kept_on_gpu,
                                speculation_share)
from ..engine.schedule import engine

__all__ = ["StatePlacement"]


def _check_host_room(needed: int, available: Optional[int], on_gpu: int) -> None:
    """Raise before making ``needed`` bytes of optimizer state (and gradient room) on the host if it has less
    available: the process would be killed part-way instead."""
    if available is None or needed <= available:
        return
    raise MemoryError(
        f"AdamOffloadOptimizer(offload_fraction='auto'): the optimizer state left for the host (and the "
        f"gradients waiting for the CPU) needs "
        f"{needed / 2**30:.1f} GiB, but the host has {available / 2**30:.1f} GiB available (the GPU keeps "
        f"{on_gpu / 2**30:.1f} GiB of it). Free GPU memory for more of it (a smaller batch or sequence, "
        "checkpoint=True), free host memory, or train on more GPUs, which share the state"
    )


class StatePlacement:
    """The placement half of ``AdamOffloadOptimizer``: which parameters keep their state on the GPU, which get a
    second set of state on the host for speculative updates, and the refusal when the host cannot hold the rest."""

    def _kept_on_gpu(self, offload_fraction: float) -> Set[int]:
        """Ids of the parameters whose state stays on the GPU: first in forward order, up to ``1 -
        offload_fraction`` of all elements."""
        params = [p for g in self.param_groups for p in g["params"]]
        if offload_fraction == 1.0:
            return set()
        if not any(p.is_cuda for p in params):
            raise ValueError(f"AdamOffloadOptimizer: offload_fraction={offload_fraction} keeps optimizer state on "
                             "the GPU, but no parameter is on one")
        budget = (1.0 - offload_fraction) * sum(p.numel() for p in params)
        kept: Set[int] = set()
        for p in self._in_forward_order():
            if budget < p.numel() / 2:  # half a parameter may overshoot: the nearest fit
                break
            if p.is_cuda:
                kept.add(id(p))
                budget -= p.numel()
        return kept

    def _in_forward_order(self) -> List[torch.Tensor]:
        """Every parameter, in the order the next forward needs them."""
        return sorted((p for g in self.param_groups for p in g["params"]), key=lambda q: self._priority[id(q)])

    # --- the first step: where the state lives -------------------------------------------------------------------
    def _decide_placement(self, grads: GradsOnGpu) -> None:
        """Keep on the GPU the state that fits (``offload_fraction="auto"``) and give the speculative share its
        second set of state, before any state is made (see [Note: automatic offload fraction] and [Note:
        speculative updates] in ``bmtwrap/engine/placement.py``)."""
        self._placement_pending = False
        order = self._in_forward_order()
        candidates = [Candidate(on_gpu=self._resident(p), state=p.numel() * adam_state_bytes(p.dtype),
                                grad=p.numel() * p.element_size(), in_block=self._in_block[id(p)],
                                spare=self._spare_bytes(p) if self.speculative else 0) for p in order]
        kept = [id(p) in self._on_gpu for p in order]
        if self._auto_fraction:
            self._auto_fraction = False
            kept = self._fitting(order, candidates, grads)
        chosen = self._host_check(order, candidates, kept)
        if self.speculative and any(chosen):
            for p, spare in zip(order, chosen):
                if spare:
                    self._spare[id(p)] = tuple(host_zeros(p.numel()).view(p.shape) for _ in range(3))
        self._keep_on_gpu({id(p) for p, keep in zip(order, kept) if keep})

    def _resident(self, p: torch.Tensor) -> bool:
        """Whether ``p`` lives on the device the model computes on, whose memory is measured (its state may too)."""
        return self._gauge is not None and p.device == self._device

    def _fitting(self, order: List[torch.Tensor], candidates: List[Candidate], grads: GradsOnGpu) -> List[bool]:
        """``offload_fraction="auto"``: which parameters keep their state on the GPU, the same share on every rank."""
        gauge = self._gauge
        if gauge is None or not any(c.on_gpu for c in candidates):
            return [False] * len(order)
        budgeted = is_initialized() and engine().max_gpu_memory is not None  # wrap(max_gpu_memory=...)
        ceiling = ceiling_bytes(gauge, engine().max_gpu_memory if budgeted else None,
                                engine().allocator_cap if budgeted else None)
        headroom = placement.AUTO_HEADROOM + (0.0 if self._expandable else placement.FIXED_SEGMENTS_HEADROOM)
        # The peak as with every gradient on the GPU: those this step's backward handed over count again.
        peak = gauge.peak() + sum(c.grad for p, c in zip(order, candidates) if id(p) in self._handed)
        measured = Measured(ceiling=ceiling, outside=gauge.outside_allocator(),
                            margin=max(int(headroom * ceiling), MIN_MARGIN), peak=peak,
                            loss_peak=min(peak, self._loss_peak or peak))
        kept = kept_on_gpu(candidates, measured, grads)
        count = sum(kept)
        if is_initialized() and engine().ctx.world_size > 1:
            # Every rank keeps what the one with the least room keeps (ranks hold shards of equal size).
            count = -agree_max([-count], "offload_fraction='auto'")[0]
        on_gpu = [c.on_gpu for c in candidates]
        kept = [keep and sum(on_gpu[: index + 1]) <= count for index, keep in enumerate(kept)]
        kept_bytes = sum(c.state for c, keep in zip(candidates, kept) if keep)
        self.auto_report = dict(gpu_bytes=ceiling, peak_bytes=peak, loss_peak_bytes=measured.loss_peak,
                                outside_bytes=measured.outside, headroom=headroom, grads=grads.value,
                                state_bytes_on_gpu=kept_bytes, params_on_gpu=sum(kept), params=len(order))
        return kept

    @staticmethod
    def _spare_bytes(p: torch.Tensor) -> int:
        """Host bytes of a second set of ``p``'s state; 0 where there cannot be one (an fp32 host parameter is its
        own master and is updated in place)."""
        if p.device.type == "cpu" and p.dtype == torch.float32:
            return 0
        return p.numel() * adam_state_bytes(p.dtype, offloaded=True)

    def _host_check(self, order: List[torch.Tensor], candidates: List[Candidate], kept: List[bool]) -> List[bool]:
        """Raise if the host cannot hold the state left to it; return which parameters also get a second set of
        state for speculative updates (what fits beside it, see [Note: speculative updates])."""
        made = [bool(self.state.get(p)) for p in order]
        needed = sum(p.numel() * adam_state_bytes(p.dtype, offloaded=True)
                     for p, keep, exists in zip(order, kept, made) if not keep and not exists)
        if self.speculative or self.step_in_backward:
            # The gradients handed over wait for the CPU in page-locked memory: at worst all of them at once.
            needed += sum(c.grad for c, keep in zip(candidates, kept) if not keep and c.on_gpu and c.in_block)
        available = host_available_bytes()
        _check_host_room(needed, available, sum(c.state for c, keep in zip(candidates, kept) if keep))
        if not self.speculative or available is None:
            return [False] * len(order)
        processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # they share the host
        room = (available - max(int(HOST_MARGIN * available), HOST_MIN_MARGIN)) // processes - needed
        return speculation_share(candidates, kept, room)

    def _keep_on_gpu(self, kept: Set[int]) -> None:
        """From now on the state of ``kept`` lives on the GPU; state made already moves there."""
        params = [p for g in self.param_groups for p in g["params"]]
        if is_initialized():
            # The state not made yet keeps its claim until the end of this step.
            engine().claim_gpu_memory(self, sum(p.numel() * adam_state_bytes(p.dtype) for p in params
                                                if id(p) in kept and not self.state.get(p)))
        if kept == self._on_gpu:
            return
        self.wait()  # the CPU updates so far are written back
        self._on_gpu = kept  # first: a bf16 parameter kept on the GPU then holds half of its master
        for p in params:
            if id(p) in kept and self.state.get(p) and self.state[p]["exp_avg"].device != p.device:
                state = {k: v.to(p.device) if isinstance(v, torch.Tensor) else v for k, v in self.state[p].items()}
                if p.dtype == torch.float32:
                    state.pop("master", None)  # on the GPU an fp32 parameter is its own master (equal after wait())
                self.state[p] = self._split_master(p, state)
        kept_numel = sum(p.numel() for p in params if id(p) in kept)
        self.offload_fraction = 1.0 - kept_numel / max(1, sum(p.numel() for p in params))

    def _settle_fraction(self) -> None:
        """``offload_fraction="auto"`` with ``step_in_backward=True``: decided when the first backward hands over
        its first gradient, past the loss and the last block's recomputation (the peak of a checkpointed step),
        before any state exists; the gradients leave the GPU as they are handed over."""
        self._loss_peak = self._gauge.peak() if self._gauge is not None else None
        self._decide_placement(GradsOnGpu.ACCUMULATE)  # measured at the hand-over: what is there then stays
