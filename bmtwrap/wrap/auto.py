"""``checkpoint="auto"``: keep activations in the GPU memory a measured step leaves free, and recover when it is short.

[Note: how checkpoint="auto" decides]
1. The first training step runs every block checkpointed. The gauge's peak is reset as its forward
   starts; while backward recomputes each block, the bytes the recomputation keeps alive are that
   block's activations.
2. The decision waits for the first forward with autograd after an optimizer has stepped (or, in a
   loop without a torch optimizer, ``DECIDE_AFTER`` backward passes), so that what persists between
   steps is real, not guessed: the optimizer's state (made in its first step, whatever optimizer it is;
   with gradient accumulation that is several forwards later),
   gradients kept, the offload optimizer's share of the card, NCCL's buffers. The next step's peak
   is predicted as what is allocated now plus what the first step added at its peak (the loss and
   its fp32 logits, gathered blocks, gradients, the recomputation), plus what the allocator held
   beyond its tensors at that peak (fragments; at most a tenth), plus the memory outside it.
3. Blocks stop checkpointing, first to last, while that prediction plus their activations stays
   under the limit: ``max_gpu_memory`` or the card, less ``memory.MARGIN`` of that. Every rank keeps
   the fewest blocks any rank can keep (one all-reduce), so that the ranks agree.
4. For ``WATCH_STEPS`` steps after that, each step's measured peak (the allocator's reserve plus
   the memory outside it, read as its backward ends) is checked against the limit at the next
   forward; a step that came closer to it than half the margin gives blocks back to
   checkpointing, last kept first, until the overshoot is covered.
5. In those steps a kept block that runs out of memory in its forward is not an error: its
   partial work is dropped, it and every kept block after it are checkpointed from then on, and
   it runs again, checkpointed, from the same random state (one warning). Only blocks are
   recovered so: an out-of-memory error elsewhere (the loss, a checkpointed block) is raised,
   named by the engine (see ``Engine.step_failed``).
On the CPU nothing is measured and every block stays checkpointed.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional

import torch

from ..engine.dist import agree_max
from ..engine.memory import Gauge, ceiling_bytes, format_bytes, gauge_for, margin_bytes
from ..engine.runners import BlockRunner, RootRunner
from ..engine.schedule import engine

__all__ = ["AutoRecompute", "WATCH_STEPS"]

# Steps after the decision whose peaks are checked, and in which an out-of-memory kept block recovers.
WATCH_STEPS = 3
# Backward passes after the measured one at which a loop that never steps a torch optimizer decides anyway.
DECIDE_AFTER = 16


class AutoRecompute:
    """``checkpoint="auto"`` for one wrapped model (see [Note: how checkpoint="auto" decides]).

    Args:
        root: the model's root (the steps watched are this model's).
        runners: the model's blocks, in the order the model builds them (first to last).
        max_gpu_memory: the process's GPU budget in bytes (see [Note: what a GPU budget counts]);
            ``None``: the card.
        gauge: the device's memory; ``None`` (the CPU): every block stays checkpointed.
    """

    def __init__(self, root: RootRunner, runners: List[BlockRunner], max_gpu_memory: Optional[int],
                 gauge: Optional[Gauge]) -> None:
        self._runners = runners
        self._gauge = gauge
        self._budget = max_gpu_memory
        self._sizes: Dict[int, int] = {}
        self._phase = "measure" if gauge is not None else "done"
        self._start = 0  # bytes allocated as the measured step began
        self._step_peak = 0  # its peak (forward and backward)
        self._step_reserved = 0  # the allocator's reserve at most in that step
        self._started = False  # the measured step's forward began
        self._measured_at = (0, 0)  # (optimizer steps, backward passes) when the measured step ended
        self._watched = 0  # steps checked since the decision
        self._used = 0  # the last watched step's peak: the allocator's reserve and the memory outside it
        self.kept: List[BlockRunner] = []  # blocks not checkpointed, in the order they stopped
        self.report: Dict[str, float] = {}  # what the decision saw and chose, for benchmarks and plans
        if gauge is not None:
            for runner in runners:
                runner.measure_activations(self._measured, gauge.allocated)
            engine().listen_for_steps(root, self._forward_starts, self._backward_ends)

    @property
    def decided(self) -> bool:
        return self._phase in ("watch", "done")

    def _ceiling(self) -> int:
        """Bytes the process may take from the card: ``max_gpu_memory`` (with the allocator's cap), at most the card."""
        return ceiling_bytes(self._gauge, self._budget, engine().allocator_cap)

    def limit(self) -> int:
        """Bytes the process may take from the card, less the margin."""
        ceiling = self._ceiling()
        return ceiling - margin_bytes(ceiling)

    # --- the engine's calls ------------------------------------------------------------------
    def _measured(self, runner: BlockRunner, nbytes: int) -> None:
        self._sizes[id(runner)] = max(nbytes, self._sizes.get(id(runner), 0))

    def _forward_starts(self) -> None:
        """A forward with autograd starts (outermost root), before anything is gathered."""
        if self._phase == "measure" and not self._started:
            self._started = True
            self._gauge.reset_peak()
            self._start = self._gauge.allocated()
        elif self._phase == "decide":
            steps, passes = self._measured_at
            eng = engine()
            if eng.optimizer_steps > steps or eng.passes_done - passes >= DECIDE_AFTER:
                self._decide()
        elif self._phase == "watch":
            self._check_peak()

    def _backward_ends(self) -> None:
        # Read here, where the step's peak is behind it: a program that resets the peak between steps (to log its
        # own) would hide it from the next forward.
        if self._phase == "watch":
            self._used = self._gauge.reserved_peak() + self._gauge.outside_allocator()
        if self._phase == "measure" and len(self._sizes) == len(self._runners):
            self._step_peak = self._gauge.peak()
            self._step_reserved = self._gauge.reserved_peak()
            self._measured_at = (engine().optimizer_steps, engine().passes_done)
            self._phase = "decide"
            for runner in self._runners:
                runner.measure_activations(None, None)

    def _decide(self) -> None:
        gauge = self._gauge
        base = gauge.allocated()
        outside = gauge.outside_allocator()
        allocated = base + self._step_peak - self._start
        # What the allocator held beyond its tensors at the first step's peak (fragments, blocks cached at another
        # size), at most a tenth of the tensors: cache left over from loading the model is reused, not added.
        excess = max(0, min(self._step_reserved - self._step_peak, allocated // 10))
        predicted = allocated + excess + outside
        # State an offload optimizer decided to keep on the GPU but has not made yet ([Note: who gets the GPU
        # memory left] in schedule.py).
        room = self.limit() - predicted - engine().gpu_claims()
        count = 0
        for runner in self._runners:
            size = self._sizes.get(id(runner), 0)
            if size > room:
                break
            room -= size
            count += 1
        count = -agree_max([-count], "checkpoint='auto'")[0]  # the fewest any rank can keep
        for runner in self._runners[:count]:
            runner.keep_activations()
            self.kept.append(runner)
            runner.on_out_of_memory = self._recover
        kept_bytes = sum(self._sizes[id(r)] for r in self.kept)
        self.report = dict(card_bytes=gauge.card_bytes(), limit_bytes=self.limit(), predicted_peak_bytes=predicted,
                           kept_blocks=count, blocks=len(self._runners), kept_activation_bytes=kept_bytes,
                           first_step_peak_bytes=self._step_peak, outside_allocator_bytes=outside)
        self._phase = "watch" if self.kept else "done"
        gauge.reset_peak()
        if predicted > self.limit() and self._budget is not None:
            warnings.warn(f"bmtwrap: a training step with every block checkpointed is predicted to take "
                          f"{format_bytes(predicted)} of this GPU, above max_gpu_memory={format_bytes(self._budget)} "
                          f"less its margin ({format_bytes(self.limit())}); to stay under it, "
                          f"{_what_else_fits(self._runners)}", RuntimeWarning, stacklevel=2)

    def _check_peak(self) -> None:
        gauge = self._gauge
        used, self._used = self._used, 0
        limit = self.limit()
        margin = margin_bytes(self._ceiling())
        # Every rank gives back what the rank nearest its limit must, and keeps no more blocks than the rank that
        # keeps the fewest (one that recovered from running out of memory).
        overshoot, fewest = agree_max([max(0, used - (limit + margin // 2)), -len(self.kept)], "checkpoint='auto'")
        fewest = -fewest
        freed = self._give_back(overshoot) if overshoot > 0 else 0
        freed += self._keep_first(min(fewest, len(self.kept)))
        if overshoot > 0:
            warnings.warn(f"bmtwrap: a training step came within {format_bytes(margin // 2)} of a GPU's limit "
                          f"({format_bytes(limit + margin)}); checkpoint='auto' recomputes {format_bytes(freed)} of "
                          "activations more from now on", RuntimeWarning, stacklevel=2)
        self._watched += 1
        if self._watched >= WATCH_STEPS or not self.kept:
            self._phase = "done"
            for runner in self.kept:
                runner.on_out_of_memory = None
        else:
            gauge.reset_peak()

    def _give_back(self, nbytes: int) -> int:
        """Blocks recompute again, the last kept first, until ``nbytes`` of activations are freed; returns the bytes."""
        count = len(self.kept)
        freed = 0
        while count and freed < nbytes:
            count -= 1
            freed += self._sizes[id(self.kept[count])]
        return self._keep_first(count)

    def _keep_first(self, count: int) -> int:
        """Only the first ``count`` kept blocks stay kept; returns the bytes of activations freed."""
        freed = 0
        while len(self.kept) > count:
            runner = self.kept.pop()
            runner.recompute = True
            runner.on_out_of_memory = None
            freed += self._sizes[id(runner)]
        self.report["kept_blocks"] = len(self.kept)
        return freed

    def _recover(self, runner: BlockRunner) -> bool:
        """``runner``, a kept block, ran out of memory in its forward: it and the kept blocks after it recompute."""
        if runner not in self.kept:
            return False
        at = self.kept.index(runner)
        after = len(self.kept) - at - 1
        self._keep_first(at)
        warnings.warn(f"bmtwrap: block {runner.name!r} ran out of GPU memory in its forward on rank "
                      f"{engine().ctx.rank}; checkpoint='auto' now recomputes it"
                      f"{f' and the {after} kept block(s) after it' if after else ''}, and runs it again",
                      RuntimeWarning, stacklevel=2)
        return True


def _what_else_fits(runners: List[BlockRunner]) -> str:
    """What a step over its GPU budget can still move off the GPU, for the warning: only what is not there yet."""
    options = []
    # Only the optimizers of these blocks' parameters: another model's (or one not yet collected) says nothing here.
    params = {id(slot.param) for r in runners for slot in r.group.slots}
    offloaders = [o for o in engine().offload_optimizers()
                  if any(id(p) in params for group in o.param_groups for p in group["params"])]
    if not offloaders:
        options.append("keep the optimizer's state where it fits (bmtwrap.optim.auto_adam)")
    elif any(o.offload_fraction < 1.0 for o in offloaders):
        options.append("keep less optimizer state on the GPU (AdamOffloadOptimizer(offload_fraction=1.0))")
    if not all(b.offloaded for r in runners for b in r.group.buffers):
        options.append("offload the blocks' parameters (wrap(model, offload_params=True))")
    return ", ".join(options) + (", or " if options else "") + "lower the per-GPU batch"


def auto_recompute(root: RootRunner, runners: List[BlockRunner], max_gpu_memory: Optional[int],
                   device: torch.device) -> AutoRecompute:
    """The :class:`AutoRecompute` of a model wrapped on ``device`` (measured where the device has a gauge)."""
    return AutoRecompute(root, runners, max_gpu_memory, gauge_for(device))
