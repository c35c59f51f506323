"""AdamOffloadOptimizer: Adam(W) whose fp32 master and moments live in CPU memory, updated by the CPU while
the GPU computes (see [Note: mixed precision] in ``adam_state.py``)."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from .. import ops
from ..engine.dist import is_initialized
from ..engine.memory import gauge_for
from ..engine.group import ROOT_LABEL
from ..engine.offload import DEFAULT_CHUNK_NUMEL, DEFAULT_SLOTS, adam_state_bytes, expandable_segments, host_zeros
from ..engine.schedule import engine
from .adam_state import Work, _AdamBase, _offload_policy
from .gpu_updates import GpuUpdates
from .nonfinite import NonFiniteGradientError, PendingCheck
from .overlap import BackwardOverlap
from .state_placement import StatePlacement
from ..engine.placement import GradsOnGpu

__all__ = ["AdamOffloadOptimizer", "STEP_IN_BACKWARD"]

# What step_in_backward takes (see AdamOffloadOptimizer).
STEP_IN_BACKWARD = (False, True, "speculative", "auto")


def default_cpu_threads() -> int:
    """The offload optimizer's CPU threads beside a GPU: ``torch.get_num_threads()``, and at least this process's
    share of the cores it may run on among ``LOCAL_WORLD_SIZE`` processes, less one core for the training loop's own
    thread (starved, it launches GPU work late)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, max(torch.get_num_threads(), share) - 1)


class AdamOffloadOptimizer(StatePlacement, BackwardOverlap, _AdamBase):
    """Adam(W) whose fp32 master and moments live in CPU memory.

    Each step copies gradient shards to the CPU through a bounded ring of pinned staging buffers,
    updates them there with the vectorised CPU kernel and copies the new parameters back, chunk by
    chunk, all on a C++ worker thread that never needs Python's GIL (``ops.OffloadQueue``; see
    [Note: offload queue] in ``csrc/cpu/offload.cpp``). The GPU keeps only the parameters (and,
    until they are copied, the gradients).

    ``step()`` queues the work and returns; the next forward waits, block by block, only for the
    parameters it gathers, so the CPU update overlaps that forward. When the CPU's update starts is
    ``step_in_backward``'s choice:

    - ``"auto"`` (default): ``"speculative"`` on a GPU, ``False`` on a machine without one (nothing
      to overlap with).
    - ``"speculative"``: during backward, as soon as a block's gradient shard is final, it is copied
      to page-locked host memory on a side stream (its GPU memory is free at once; its norm and an
      inf/nan flag are taken there, for clipping and the checks) and its update starts, into a second
      set of host state, assuming the step will apply the gradient as it is. ``step()`` keeps the
      updates where that held (no clipping coefficient or loss scale below 1, this backward the last
      before it, finite gradients, the same hyper-parameters) and redoes the others from the state they
      started from; a forward or ``zero_grad()`` before ``step()`` undoes them. The parameters come out
      bit for bit as with ``False``, and gradient clipping, accumulation, loss scaling and
      ``nonfinite="skip"`` all work. The second set of state is made only for the share that fits in
      host memory (see [Note: speculative updates] in ``bmtwrap/engine/placement.py``); the rest is
      updated after backward. ``.grad`` of the parameters handed over is ``None`` after backward:
      read norms through :func:`bmtwrap.optim.optim_manager.grad_norm` (the manager, ``bmtwrap.hf``
      and the examples do).
    - ``False``: every update starts at ``step()``.
    - ``True``: each block is updated during backward, in place, with the gradient as it is. That
      requires every backward to be one optimizer step with the hyper-parameters of the moment: no
      gradient accumulation, no gradient clipping and no loss scaling (the manager refuses both), and
      a non-finite gradient damages the weights before ``step()`` can refuse it; ``"speculative"`` has
      none of these limits.

    Args:
        params: as :class:`AdamOptimizer`.
        lr: as :class:`AdamOptimizer`.
        betas: as :class:`AdamOptimizer`.
        eps: as :class:`AdamOptimizer`.
        weight_decay: as :class:`AdamOptimizer`.
        decoupled: as :class:`AdamOptimizer`.
        master_dtype: as :class:`AdamOptimizer`.
        step_in_backward: ``"auto"`` (default), ``"speculative"``, ``False`` or ``True`` (see above);
            all but ``False`` need a distributed context (``bmtwrap.init_distributed()``), which tells
            when each block's gradient is final (``"auto"`` is ``False`` without one).
        chunk_numel: elements per pipelined chunk.
        staging_slots: pinned staging buffers; pinned memory is ``staging_slots * chunk_numel *
            (gradient + parameter bytes)``.
        cpu_threads: threads of the CPU update; default: ``torch.get_num_threads()``, less one when
            the parameters are on a GPU (the training loop's thread keeps a core to launch GPU work),
            and there at least this process's share of the cores it may run on (divided among
            ``LOCAL_WORLD_SIZE`` processes): ``torchrun`` sets ``OMP_NUM_THREADS=1`` for several
            processes per machine, which would leave the update one thread.
        offload_fraction: the share of the parameters (by elements) whose master and moments live
            on the CPU; the rest keep theirs on the GPU and are updated there by the fused kernel
            (10 bytes of GPU memory per element for bf16, 12 for fp16: see [Note: mixed
            precision]). The GPU keeps those the next forward needs
            first (the parameters outside blocks, then the first blocks): their CPU updates are
            the last of a step's backward and the first its next forward waits for. Parameters
            offloaded by ``wrap(offload_params=True)`` are always updated on the CPU. ``"auto"``:
            the state that fits on the GPU, decided at the first ``step()`` before any state exists
            from what that step's forward and backward measured, keeping ``placement.AUTO_HEADROOM`` of the card
            free (and turning on the allocator's expandable segments unless ``PYTORCH_ALLOC_CONF`` is
            set); every rank keeps the same share (see [Note: automatic offload fraction] in
            ``bmtwrap/engine/placement.py``). :attr:`offload_fraction` then tells the share left on the
            CPU, :attr:`auto_report` what the decision saw. On a machine without a GPU, ``"auto"`` is 1.
        hold_steps: as :class:`AdamOptimizer`.
        nonfinite: as :class:`AdamOptimizer`. With ``step_in_backward=True`` a block is updated
            before the rest of the gradient exists: its gradient is checked on the GPU as it is
            handed over, and ``step()`` raises afterwards if any was not finite (the weights are
            then damaged: reload the last checkpoint); ``"skip"`` needs another ``step_in_backward``,
            and blocks offloaded by ``wrap(offload_params=True)`` are not checked in that mode.

    Raises:
        ValueError, TypeError: as :class:`AdamOptimizer`; a ``step_in_backward`` other than those
            above, or ``True`` or ``"speculative"`` without a distributed context; ``offload_fraction``
            neither ``"auto"`` nor in [0, 1], or below 1 with no parameter on a GPU.
        MemoryError: at the first step, when the host has less memory available than the state it
            must hold (the GPU's share told apart).

    Example::

        optimizer = bmt.optim.AdamOffloadOptimizer(model.parameters(), lr=1e-4, offload_fraction="auto")
        for batch in data:
            model(**batch).loss.backward()   # blocks start their CPU updates while backward runs
            optimizer.step()
            optimizer.zero_grad()
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, decoupled: bool = True,
                 master_dtype: torch.dtype = torch.float32, step_in_backward: Union[bool, str] = "auto",
                 chunk_numel: int = DEFAULT_CHUNK_NUMEL, staging_slots: int = DEFAULT_SLOTS,
                 cpu_threads: Optional[int] = None, offload_fraction: Union[float, str] = 1.0, hold_steps: int = 0,
                 nonfinite: str = "raise") -> None:
        if not any(step_in_backward is mode or (isinstance(mode, str) and step_in_backward == mode)
                   for mode in STEP_IN_BACKWARD):
            raise ValueError(f"AdamOffloadOptimizer: step_in_backward must be one of "
                             f"{', '.join(map(repr, STEP_IN_BACKWARD))}, got {step_in_backward!r}")
        self._auto_fraction = offload_fraction == "auto"
        if self._auto_fraction:
            offload_fraction = 1.0  # until the first step has shown how much memory is left
        elif isinstance(offload_fraction, str) or not 0.0 <= offload_fraction <= 1.0:
            raise ValueError(f"AdamOffloadOptimizer: offload_fraction must be 'auto' or in [0, 1], "
                             f"got {offload_fraction!r}")
        if step_in_backward is True and nonfinite == "skip":
            raise ValueError("AdamOffloadOptimizer(step_in_backward=True) updates each block during backward, before "
                             "the whole gradient is known, so it cannot skip a step; use step_in_backward=False with "
                             "nonfinite='skip'")
        super().__init__(params, lr, betas, eps, weight_decay, decoupled, master_dtype, "AdamOffloadOptimizer",
                         hold_steps, nonfinite)
        # Set during backward when a block updated then held a non-finite gradient (step_in_backward).
        self._backward_flags: Dict[torch.device, torch.Tensor] = {}
        all_params = [p for g in self.param_groups for p in g["params"]]
        registry = engine().registry if is_initialized() else None
        device = all_params[0].device
        if any(_offload_policy(registry, p).params for p in all_params):
            # Parameters offloaded to the host by wrap(offload_params=True) get their gradients from
            # the device the model computes on: the queue orders its reads after those copies.
            device = engine().ctx.device
        if step_in_backward == "auto":
            step_in_backward = "speculative" if device.type == "cuda" and is_initialized() else False
        if step_in_backward in (True, "speculative") and not is_initialized():
            raise ValueError(f"AdamOffloadOptimizer(step_in_backward={step_in_backward!r}) needs "
                             "bmtwrap.init_distributed() first: the engine tells it when each block's gradient is "
                             "final")
        if cpu_threads is None and device.type == "cuda":
            cpu_threads = default_cpu_threads()
        # The device the model computes on, and its memory (None on the CPU): what offload_fraction="auto" reads.
        self._device = device
        self._gauge = gauge_for(device)
        dtypes = {p.dtype for p in all_params}
        self._offload = ops.OffloadQueue(device, dtypes=dtypes, chunk_numel=chunk_numel, slots=staging_slots,
                                         num_threads=cpu_threads)
        # Forward order: parameters outside blocks (gathered first, with the root) go first, then
        # the optimizer's own order, which is the model's.
        self._priority: Dict[int, int] = {}
        self._group_of: Dict[int, Dict[str, Any]] = {}
        self._in_block: Dict[int, bool] = {}
        # Each parameter's key in the queue: its updates run in the order they were submitted, whichever of its
        # two sets of state they read (see BackwardOverlap).
        self._order: Dict[int, int] = {}
        for group in self.param_groups:
            for p in group["params"]:
                found = registry.lookup(p) if registry is not None else None
                outside = found is None or found[0].label.startswith(ROOT_LABEL)
                self._priority[id(p)] = len(self._priority) - (1 << 40 if outside else 0)
                self._group_of[id(p)] = group
                self._in_block[id(p)] = not outside
                self._order[id(p)] = len(self._order) + 1
        self._on_gpu = self._kept_on_gpu(offload_fraction)
        # offload_fraction="auto" fills the card: with expandable segments, fragmentation cannot strand the room left.
        self._expandable = self._auto_fraction and any(p.is_cuda for p in all_params) and expandable_segments()
        if self._auto_fraction and registry is not None:
            # What checkpoint="auto" must leave free for this state ([Note: who gets the GPU memory left]).
            engine().claim_gpu_memory(self, sum(p.numel() * adam_state_bytes(p.dtype) for p in all_params if p.is_cuda))
        self.offload_fraction = offload_fraction  # the share of the elements whose state is on the CPU
        # offload_fraction="auto": what the decision saw and chose (set once it is made).
        self.auto_report: Optional[Dict[str, Any]] = None
        self.step_in_backward = step_in_backward is True  # updates in place during backward (the manager asks)
        self.speculative = step_in_backward == "speculative"
        # Updates started in backward (step_in_backward="speculative"): kept by their step, redone by it (clipped,
        # scaled, other hyper-parameters), undone before it (a forward or zero_grad() came first), in parameters.
        self.speculation = dict(kept=0, redone=0, undone=0)
        # The first step decides where state lives and which parameters update speculatively, before making any.
        self._placement_pending = self._auto_fraction or self.speculative
        self._loss_peak: Optional[int] = None  # the GPU's peak when the first step's first gradient was final
        # step_in_backward on a GPU: the side stream copying gradients updated on the CPU to the host.
        self._host_grad_stream: Optional[torch.cuda.Stream] = None
        self._gpu_updates = GpuUpdates()  # the state kept on the GPU: updated beside the next forward
        # BackwardOverlap's state (see overlap.py).
        self._handed = {}
        self._started = {}
        self._spare = {}
        self._handover_flags = {}
        self._in_step = False
        self._accumulating = False
        self._handed_scaled = False  # scale_handed_gradients changed this step's handed-over gradients
        self._passes_per_step: Optional[int] = None
        self._passes_at_step = engine().passes_done if is_initialized() else 0
        if is_initialized() and (self.step_in_backward or self.speculative or self._auto_fraction):
            engine().listen_for_final_grads(self._grads_final)
        if is_initialized():
            engine().add_offload_optimizer(self)
        if self.speculative:
            engine().listen_for_forward_starts(self._forward_starts)

    # --- state ---------------------------------------------------------------------------------------------------
    def _state_device(self, param: torch.Tensor) -> torch.device:
        return param.device if id(param) in self._on_gpu else torch.device("cpu")

    def _splits_master(self, p: torch.Tensor, device: torch.device) -> bool:
        # The CPU's updates keep whole masters, even beside a parameter on the CPU.
        return id(p) in self._on_gpu and super()._splits_master(p, device)

    def _new_state(self, p: torch.Tensor) -> Dict[str, Any]:
        if id(p) in self._on_gpu:
            return super()._new_state(p)
        state: Dict[str, Any] = {"step": 0, "exp_avg": host_zeros(p.numel()).view(p.shape),
                                 "exp_avg_sq": host_zeros(p.numel()).view(p.shape)}
        if p.dtype != torch.float32 or p.device.type != "cpu":
            state["master"] = host_zeros(p.numel()).view(p.shape).copy_(p.detach())
        return state

    def _place(self, param: torch.Tensor, name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or id(param) in self._on_gpu:
            return super()._place(param, name, value)
        return host_zeros(param.numel()).view(param.shape).copy_(value.detach().reshape(param.shape))

    def state_dict(self) -> Dict[str, Any]:
        """This rank's optimizer state, once every queued update is done (see :meth:`wait`)."""
        self.wait()
        return super().state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Wait for the queued updates, then load as :class:`AdamOptimizer` does (state stays fp32)."""
        self.wait()
        self._discard_backward()
        super().load_state_dict(state_dict)

    def wait(self) -> None:
        """Block until every queued update is written back (the host side; CUDA copies may still run), and order
        the current stream after the updates of the state kept on the GPU (see [Note: GPU updates beside the
        next forward] in ``gpu_updates.py``)."""
        self._offload.wait_all()
        self._gpu_updates.wait()

    def offload_stats(self) -> Dict[str, float]:
        """Where the CPU worker's time went so far (see ``ops.OffloadQueue.stats``): seconds in the
        Adam kernel, stalled on gradient copies, idle; and the elements updated."""
        return self._offload.stats()

    @torch.no_grad()
    def scale_handed_gradients(self, factor: torch.Tensor) -> None:
        """Multiply the gradients this optimizer took off ``.grad`` in this step's backward by ``factor`` (a 0-dim
        clipping coefficient) in place, as ``.grad.mul_(factor)`` does to the others, rounding alike (see
        ``optim_manager.clip_grads_with_norm``); the updates started on them are then redone."""
        if float(factor) == 1.0 or not self._handed:
            return
        factor = factor.detach().cpu()
        for handed in self._handed.values():
            handed.host_ready()
            # As the gradient's own device would round it: a CUDA kernel reads a 0-dim factor on its device in the
            # gradient's dtype (bf16: the factor rounded first), the CPU's reads it in fp32.
            handed.host.mul_(factor.to(handed.host.dtype) if handed.stream is not None else factor)
        self._handed_scaled = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; gradients handed over during backward and updates started on them are dropped (a step that
        is skipped: the parameters get back the values they had)."""
        self._discard_backward()
        self._accumulating = False
        if is_initialized():
            self._passes_at_step = engine().passes_done  # the next backward is the first of a step
        if not set_to_none:
            self._gpu_updates.wait()  # zeros written over gradients the GPU updates may still read
        super().zero_grad(set_to_none)

    def _discard_backward(self) -> None:
        if self._started:
            self._cancel_started()
        self._clear_overlap()

    # --- the queue -----------------------------------------------------------------------------------------------
    def _queue(self, work: List[Work],
               ready_stream: Optional["torch.cuda.Stream"] = None) -> None:
        """Hand updates to the offload queue (the next gather of each parameter waits for its own), or
        run them on the GPU now for parameters whose state stays there. The gradients are final once
        ``ready_stream`` (default: the current one) reaches this point; those handed over in backward once
        their copies are. An update started in backward is kept where it used what this step applies, and
        redone from the state it started from where it did not (see [Note: speculative updates])."""
        self._gpu_updates.run([item for item in work if id(item[0]) in self._on_gpu], self._priority,
                              self._buffer_of)
        host = [(p, state, hyper) for p, state, hyper in work if id(p) not in self._on_gpu]
        plain = [item for item in host if id(item[0]) not in self._handed]
        grads = [p.grad.detach().contiguous() for p, _, _ in plain]
        if self.step_in_backward and any(g.is_cuda for g in grads):
            grads, ready_stream = self._grads_to_host(grads, ready_stream)
        handed = [item for item in host if id(item[0]) in self._handed]
        self._submit(plain, grads, ready_stream)
        if handed:  # copied to the host by one side stream (see overlap.py)
            taken = [self._handed[id(p)] for p, _, _ in handed]
            self._submit(handed, [h.host for h in taken], taken[0].stream)

    def _submit(self, work: List[Work], grads: List[torch.Tensor],
                ready_stream: Optional["torch.cuda.Stream"]) -> None:
        """Queue the CPU updates of ``work`` with ``grads``, final once ``ready_stream`` reaches this point; an
        update started in backward is kept where it did what this one would, else redone from its state."""
        updates, params = [], []
        for (p, state, hyper), grad in zip(work, grads):
            started = self._started.pop(id(p), None)
            if (started is not None and started.hyper == hyper and started.grad.data_ptr() == grad.data_ptr()
                    and not self._handed_scaled):
                self._swap_state(p, state)  # the update started in backward is this step's
                self.speculation["kept"] += 1
                continue
            self.speculation["redone"] += started is not None
            targets = self._spare[id(p)] if started is not None else (None, None, None)
            updates.append(ops.OffloadUpdate(p.detach(), grad, state.get("master", p).detach(), state["exp_avg"],
                                             state["exp_avg_sq"], hyper, self._priority[id(p)], *targets,
                                             self._order[id(p)]))
            params.append(p)
            if started is not None:
                self._swap_state(p, state)  # redone into the spare set, which becomes the state
        for p, ticket in zip(params, self._offload.submit(updates, ready_stream)):
            self._after_write(p, ticket)

    @staticmethod
    def _buffer_of(p: torch.Tensor) -> Any:
        """The engine buffer that gathers ``p`` (whose gathers wait for its writes), or ``None``."""
        registry = engine().registry if is_initialized() else None
        found = registry.lookup(p) if registry is not None else None
        return None if found is None else found[0]

    def _after_write(self, p: torch.Tensor, ticket: ops.OffloadTicket) -> None:
        """The next reader of ``p`` waits for the update behind ``ticket``."""
        buffer = self._buffer_of(p)
        if buffer is not None:
            buffer.await_write(ticket)
        else:
            # No gather stands between this parameter and its next reader (a replicated one):
            # the caller's stream waits here. These go first, so the wait is short.
            ticket.wait()

    # --- the engine's calls --------------------------------------------------------------------------------------
    def _grads_final(self, buffer: Any) -> None:
        """The engine's report, during backward: ``buffer``'s gradient shard is final."""
        params = [slot.param for slot in buffer.slots
                  if id(slot.param) in self._group_of and slot.param.grad is not None and slot.param.numel() > 0]
        if not params:
            return
        if self._loss_peak is None and self._gauge is not None:
            self._loss_peak = self._gauge.peak()  # past the loss (see engine/placement.py)
        if self.step_in_backward:
            self._update_in_backward(buffer, params)
        elif self.speculative and self._handing_over():
            params = [p for p in params if id(p) not in self._on_gpu and id(p) not in self._handed]
            if params:
                self._overlap_final(params, buffer.grad_stream, buffer.offloaded)

    def _forward_starts(self, with_grad: bool) -> None:
        self._overlap_forward(with_grad)

    def _finite(self, params: List[torch.Tensor], check: PendingCheck) -> bool:
        try:
            finite = super()._finite(params, check)
        except NonFiniteGradientError:
            self._discard_backward()  # nothing is updated: the parameters are as they were
            raise
        if not finite:
            self._discard_backward()
        return finite

    # --- the step ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_scale: float = 1.0,
             assume_finite: bool = False) -> Any:
        """Queue the update of every parameter that has a gradient, and return without waiting for it.

        With ``step_in_backward=False`` it first waits for the previous step's updates; with
        ``"speculative"``, it keeps the updates started in backward that this step applies as they were
        and redoes the others; with ``True``, the blocks were updated during backward, and this queues
        the rest. The next forward waits, per block, for the parameters it gathers. On a machine
        without a GPU it waits for the updates before returning, as there is nothing to overlap them with.
        The first step decides where the state lives (``offload_fraction="auto"``) before making any.

        Args:
            closure: re-evaluates the model and returns the loss, as for any torch optimizer.
            grad_scale: gradients are multiplied by it as they are read.
            assume_finite: skip the check for non-finite gradients (the caller made it).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            ValueError: ``grad_scale`` other than 1 with ``step_in_backward=True``.
            NonFiniteGradientError: a gradient holds an inf or a NaN (``nonfinite="raise"``).
            MemoryError: at the first step, the host cannot hold the state left to it.
        """
        if self.step_in_backward and grad_scale != 1.0:
            raise ValueError("AdamOffloadOptimizer(step_in_backward=True) updated the blocks during backward "
                             f"with the gradients as they were; it cannot apply grad_scale={grad_scale} (loss "
                             "scaling or clipping) afterwards: use step_in_backward='auto' for that")
        loss = None
        if closure is not None:
            self._in_step = True  # the closure's backward is this step's: nothing to start early
            try:
                with torch.enable_grad():
                    loss = closure()
            finally:
                self._in_step = False
        if self.step_in_backward:
            if self.nonfinite != "unchecked":
                self._check_backward_updates()
        elif not self.speculative:
            self.wait()
        passes = engine().passes_done - self._passes_at_step if is_initialized() else 1
        if self._placement_pending:
            self._first_step(passes)
        launched = self._checked(assume_finite, grad_scale, lambda p: id(p) in self._on_gpu and p.is_cuda,
                                 lambda work, flag: self._gpu_updates.run(work, self._priority, self._buffer_of,
                                                                          skip_if=flag))
        if launched is None:
            self._end_pass_count(passes)
            return loss
        work = [self._advance(p, group, grad_scale) for group in self.param_groups for p in group["params"]
                if (p.grad is not None or id(p) in self._handed) and p.numel() > 0 and id(p) not in launched]
        self._offload.prioritise()
        self._queue(work)
        self._end_step()
        self._clear_overlap()
        self._end_pass_count(passes)
        if is_initialized():
            engine().claim_gpu_memory(self, 0)  # the state kept on the GPU exists now
        if self._offload.device.type == "cpu" and not self.step_in_backward:
            self.wait()  # nothing to overlap with on a CPU-only machine
        return loss

    def _first_step(self, passes: int) -> None:
        """Decide where the state lives before making it; in the speculative mode, hand the gradients the CPU will
        update over to the host first, so that the state kept on the GPU has their room."""
        if self.speculative:
            self._decide_placement(GradsOnGpu.LEAVE if passes <= 1 else GradsOnGpu.ACCUMULATE)
            self._return_grads(list(self._on_gpu))  # their updates run on the GPU
            params = [p for g in self.param_groups for p in g["params"]
                      if p.grad is not None and p.is_cuda and p.numel() > 0 and id(p) not in self._on_gpu
                      and self._in_block[id(p)]]
            if params:  # kept on the GPU through an accumulating step: the state needs their room now
                self._hand_over(params, None)
        else:
            self._decide_placement(GradsOnGpu.WAIT)

    def _end_pass_count(self, passes: int) -> None:
        """Remember how many backward passes this step had: the next one starts its updates in its own last."""
        self._passes_per_step = passes if passes > 0 else None
        self._accumulating = False
        self._passes_at_step = engine().passes_done if is_initialized() else 0
