"""AdamOffloadOptimizer: Adam(W) whose fp32 master and moments live in CPU memory, updated by the CPU while
the GPU computes (see [Note: mixed precision] in ``adam_state.py``)."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple, Union

import torch

from .. import ops
from ..engine.dist import agree_max, is_initialized
from ..engine.memory import MIN_MARGIN, CudaGauge, ceiling_bytes
from ..engine.group import ROOT_LABEL
from ..engine.offload import (DEFAULT_CHUNK_NUMEL, DEFAULT_SLOTS, adam_state_bytes, expandable_segments,
                              host_available_bytes, host_empty, host_zeros)
from ..engine.schedule import engine
from .adam_state import _AdamBase, _offload_policy, _update_in_place
from .nonfinite import NonFiniteGradientError

__all__ = ["AdamOffloadOptimizer"]

# offload_fraction="auto" leaves this share of the GPU free (see [Note: automatic offload fraction]), and
# this much more where the allocator's segments are of fixed size (fragmentation strands memory there).
AUTO_HEADROOM = 0.08
FIXED_SEGMENTS_HEADROOM = 0.04


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


def default_cpu_threads() -> int:
    """The offload optimizer's CPU threads beside a GPU: ``torch.get_num_threads()``, and at least this process's
    share of the cores it may run on among ``LOCAL_WORLD_SIZE`` processes, less one core for the training loop's own
    thread (starved, it launches GPU work late)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, max(torch.get_num_threads(), share) - 1)


class AdamOffloadOptimizer(_AdamBase):
    """Adam(W) whose fp32 master and moments live in CPU memory.

    Each step copies gradient shards to the CPU through a bounded ring of pinned staging buffers,
    updates them there with the vectorised CPU kernel and copies the new parameters back, chunk by
    chunk, all on a C++ worker thread that never needs Python's GIL (``ops.OffloadQueue``; see
    [Note: offload queue] in ``csrc/cpu/offload.cpp``). The GPU keeps only the parameters (and,
    until they are copied, the gradients).

    By default ``step()`` queues the work and returns; the next forward waits, block by block,
    only for the parameters it gathers, so the CPU update overlaps that forward.

    With ``step_in_backward=True`` each block's update starts during backward, as soon as its
    gradient shard is final, so the CPU works while the GPU computes the rest of backward; the
    gradient is copied to page-locked host memory on a side stream at once, so its GPU memory is
    freed while it waits for the CPU (the host memory is reused step after step, and grows to the
    most gradients waiting at once); ``step()`` then updates what is left (the parameters
    outside blocks, whose gradients complete with backward) and puts the remaining work in the
    order the next forward needs it. That requires every backward to be one optimizer step with
    the hyper-parameters of the moment: no gradient accumulation over several backward passes,
    no gradient clipping and no loss scaling (the manager refuses both), and ``.grad`` of the
    updated parameters is ``None`` after backward.

    Args:
        params: as :class:`AdamOptimizer`.
        lr: as :class:`AdamOptimizer`.
        betas: as :class:`AdamOptimizer`.
        eps: as :class:`AdamOptimizer`.
        weight_decay: as :class:`AdamOptimizer`.
        decoupled: as :class:`AdamOptimizer`.
        master_dtype: as :class:`AdamOptimizer`.
        step_in_backward: start each block's update during backward (see above); needs a
            distributed context (``bmtwrap.init_distributed()``).
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
            the state that fits in the GPU memory the first step leaves unused (keeping
            ``AUTO_HEADROOM`` of the card free, and turning on the allocator's expandable segments
            unless ``PYTORCH_ALLOC_CONF`` is set) stays on the GPU, the first-needed first; with
            ``step_in_backward`` it is decided during the first backward and that state is never
            made on the host, otherwise it moves there after the first step (see [Note: automatic
            offload fraction]); :attr:`offload_fraction` then tells the share left on the CPU. On a
            machine without a GPU, ``"auto"`` is 1.
        hold_steps: as :class:`AdamOptimizer`.
        nonfinite: as :class:`AdamOptimizer`. With ``step_in_backward=True`` a block is updated
            before the rest of the gradient exists: its gradient is checked on the GPU as it is
            handed over, and ``step()`` raises afterwards if any was not finite (the weights are
            then damaged: reload the last checkpoint); ``"skip"`` needs ``step_in_backward=False``,
            and blocks offloaded by ``wrap(offload_params=True)`` are not checked in that mode.

    Raises:
        ValueError, TypeError: as :class:`AdamOptimizer`; ``step_in_backward`` without a
            distributed context; ``offload_fraction`` neither ``"auto"`` nor in [0, 1], or below 1
            with no parameter on a GPU.

    Example::

        optimizer = bmt.optim.AdamOffloadOptimizer(model.parameters(), lr=1e-4, step_in_backward=True)
        for batch in data:
            model(**batch).loss.backward()   # blocks are updated on the CPU while backward runs
            optimizer.step()
            optimizer.zero_grad()
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, decoupled: bool = True,
                 master_dtype: torch.dtype = torch.float32, step_in_backward: bool = False,
                 chunk_numel: int = DEFAULT_CHUNK_NUMEL, staging_slots: int = DEFAULT_SLOTS,
                 cpu_threads: Optional[int] = None, offload_fraction: Union[float, str] = 1.0, hold_steps: int = 0,
                 nonfinite: str = "raise") -> None:
        self._auto_fraction = offload_fraction == "auto"
        if self._auto_fraction:
            offload_fraction = 1.0  # until the first step has shown how much memory is left
        elif isinstance(offload_fraction, str) or not 0.0 <= offload_fraction <= 1.0:
            raise ValueError(f"AdamOffloadOptimizer: offload_fraction must be 'auto' or in [0, 1], got {offload_fraction!r}")
        if step_in_backward and nonfinite == "skip":
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
        if cpu_threads is None and device.type == "cuda":
            cpu_threads = default_cpu_threads()
        dtypes = {p.dtype for p in all_params}
        self._offload = ops.OffloadQueue(device, dtypes=dtypes, chunk_numel=chunk_numel, slots=staging_slots,
                                         num_threads=cpu_threads)
        # Forward order: parameters outside blocks (gathered first, with the root) go first, then
        # the optimizer's own order, which is the model's.
        self._priority: Dict[int, int] = {}
        self._group_of: Dict[int, Dict[str, Any]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                found = registry.lookup(p) if registry is not None else None
                outside = found is None or found[0].label.startswith(ROOT_LABEL)
                self._priority[id(p)] = len(self._priority) - (1 << 40 if outside else 0)
                self._group_of[id(p)] = group
        self._on_gpu = self._kept_on_gpu(offload_fraction)
        # offload_fraction="auto" fills the card: with expandable segments, fragmentation cannot strand the room left.
        self._expandable = self._auto_fraction and any(p.is_cuda for p in all_params) and expandable_segments()
        if self._auto_fraction and registry is not None:
            # What checkpoint="auto" must leave free for this state ([Note: who gets the GPU memory left]).
            engine().claim_gpu_memory(self, sum(p.numel() * adam_state_bytes(p.dtype) for p in all_params if p.is_cuda))
        self.offload_fraction = offload_fraction  # the share of the elements whose state is on the CPU
        # offload_fraction="auto": what the decision saw and chose (set once it is made).
        self.auto_report: Optional[Dict[str, Any]] = None
        self.step_in_backward = step_in_backward
        # step_in_backward on a GPU: the side stream copying gradients updated on the CPU to the host.
        self._host_grad_stream: Optional[torch.cuda.Stream] = None
        if step_in_backward:
            if not is_initialized():
                raise ValueError("AdamOffloadOptimizer(step_in_backward=True) needs bmtwrap.init_distributed() "
                                 "first: the engine tells it when each block's gradient is final")
            engine().listen_for_final_grads(self._grads_final)

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
        return self._first_needed(lambda p: p.numel(), budget)

    def _first_needed(self, cost: Callable[[torch.Tensor], float], budget: float) -> Set[int]:
        """Ids of the GPU parameters the next forward needs first, while their summed ``cost`` fits ``budget``
        (half a parameter's cost may overshoot: the nearest fit)."""
        kept: Set[int] = set()
        params = [p for g in self.param_groups for p in g["params"]]
        for p in sorted(params, key=lambda q: self._priority[id(q)]):
            if budget < cost(p) / 2:
                break
            if p.is_cuda:
                kept.add(id(p))
                budget -= cost(p)
        return kept

    def _settle_fraction(self) -> None:
        """``offload_fraction="auto"``: keep on the GPU the state that fits there.

        [Note: automatic offload fraction]
        The first step shows the most memory training needs on this GPU
        (``torch.cuda.max_memory_allocated``: parameters, gathered blocks, gradients, activations and
        recomputation). With ``step_in_backward`` the decision is made when the first backward hands
        over its first gradient: the loss and the last block's recomputation, the peak of a
        checkpointed step, are behind it, and no state exists yet, so the state that stays on the GPU
        is made there and never on the host (a model whose whole state would not fit the host still
        trains); the bytes of that state stay claimed until it exists (end of the first step).
        Otherwise it is decided after the first step, and the state then moves.

        What is left of the card (or of ``wrap(max_gpu_memory=...)``), less the memory outside torch's
        allocator (the CUDA context, NCCL's buffers: both count against it), holds optimizer state, less:
        - ``AUTO_HEADROOM`` of the card (at least ``MIN_MARGIN``, 512 MiB, as ``checkpoint="auto"``
          leaves: a small budget's share is too thin), for later variation (another sequence length)
          and what the allocator cannot hand out; the optimizer turns on the allocator's expandable
          segments, unless ``PYTORCH_ALLOC_CONF`` is set (``offload.expandable_segments``), and
          leaves ``FIXED_SEGMENTS_HEADROOM`` more where they are off: fixed-size segments strand
          several GiB as reserved but unusable memory on a full card;
        - without ``step_in_backward``, the gradients of the parameters updated on the CPU: each
          waits on the GPU until the CPU takes it, and when the CPU is the slower side a step's
          worth waits into the next forward. With it they wait on the host instead (copied there
          as each becomes final), and the GPU needs no room for them.
        The state takes 12 bytes per element on the host (fp32 master, two moments; 8 for an fp32
        parameter, its own master) and 10 on the GPU beside a bf16 parameter (the master split with
        it: [Note: mixed precision]), less the gradient it spares when gradients wait on the GPU, and goes to
        the parameters the next forward needs first, as a fixed ``offload_fraction`` would. (It has
        first call on the memory: [Note: who gets the GPU memory left] in ``schedule.py``.) State that
        already exists is
        moved once, after the CPU updates so far are done; from then on those parameters are
        updated on the GPU by the fused kernel, and the rest on the CPU.
        """
        self._auto_fraction = False
        params = [p for g in self.param_groups for p in g["params"]]
        cuda = [p for p in params if p.is_cuda]
        if not cuda:
            return
        device = cuda[0].device
        gauge = CudaGauge(device)
        outside = gauge.outside_allocator()  # the CUDA context, NCCL: the card and a budget count them
        budgeted = is_initialized() and engine().max_gpu_memory is not None  # wrap(max_gpu_memory=...)
        total = ceiling_bytes(gauge, engine().max_gpu_memory if budgeted else None,
                              engine().allocator_cap if budgeted else None)
        peak = torch.cuda.max_memory_allocated(device)
        headroom = AUTO_HEADROOM + (0.0 if self._expandable else FIXED_SEGMENTS_HEADROOM)
        budget = total - max(headroom * total, MIN_MARGIN) - peak - outside
        grads_wait_on_gpu = not self.step_in_backward
        if grads_wait_on_gpu:
            # The gradient of a parameter updated on the CPU stays on the GPU until the CPU takes it, up
            # to a step's worth when the CPU is the slower side: room for those, less what each
            # parameter kept on the GPU spares.
            budget -= sum(p.numel() * p.element_size() for p in cuda)
        if is_initialized() and engine().ctx.replicas > 1:
            # Replicas update the same shards: each keeps on the GPU what the one with the least room keeps.
            budget = -agree_max([-int(budget)], "offload_fraction='auto'")[0]
        kept = self._first_needed(lambda p: p.numel() * (adam_state_bytes(p.dtype)
                                                         - (p.element_size() if grads_wait_on_gpu else 0)), budget)
        kept_bytes = sum(p.numel() * adam_state_bytes(p.dtype) for p in params if id(p) in kept)
        self.auto_report = dict(gpu_bytes=total, peak_bytes=peak, outside_bytes=outside, headroom=headroom,
                                state_bytes_on_gpu=kept_bytes,
                                params_on_gpu=len(kept), params=len(params))
        host_needed = sum(p.numel() * adam_state_bytes(p.dtype, offloaded=True) for p in params
                          if id(p) not in kept and not self.state.get(p))
        if self.step_in_backward:
            # At worst, when the CPU is the slower side, every gradient it updates waits there at once.
            host_needed += sum(p.numel() * p.element_size() for p in cuda if id(p) not in kept)
        _check_host_room(host_needed, host_available_bytes(), kept_bytes)
        if is_initialized():
            # The state not made yet keeps its claim until the end of this step.
            engine().claim_gpu_memory(self, sum(p.numel() * adam_state_bytes(p.dtype) for p in params
                                                if id(p) in kept and not self.state.get(p)))
        if not kept:
            return
        self.wait()  # the CPU updates of the first step are written back
        self._on_gpu = kept  # first: a bf16 parameter kept on the GPU then holds half of its master
        for p in params:
            if id(p) in kept and self.state.get(p):
                state = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.state[p].items()}
                if p.dtype == torch.float32:
                    state.pop("master", None)  # on the GPU an fp32 parameter is its own master (equal after wait())
                self.state[p] = self._split_master(p, state)
        kept_numel = sum(p.numel() for p in params if id(p) in kept)
        self.offload_fraction = 1.0 - kept_numel / max(1, sum(p.numel() for p in params))

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
        super().load_state_dict(state_dict)

    def wait(self) -> None:
        """Block until every queued update is written back (the host side; CUDA copies may still run)."""
        self._offload.wait_all()

    def offload_stats(self) -> Dict[str, float]:
        """Where the CPU worker's time went so far (see ``ops.OffloadQueue.stats``): seconds in the
        Adam kernel, stalled on gradient copies, idle; and the elements updated."""
        return self._offload.stats()

    def _queue(self, work: List[Tuple[torch.Tensor, Dict[str, Any], Dict[str, Any]]],
               ready_stream: Optional["torch.cuda.Stream"] = None) -> None:
        """Hand updates to the offload queue (the next gather of each parameter waits for its own), or
        run them on the GPU now for parameters whose state stays there. The gradients are final once
        ``ready_stream`` (default: the current one) reaches this point."""
        for p, state, hyper in work:
            if id(p) in self._on_gpu:
                _update_in_place(p, state, hyper)
        work = [item for item in work if id(item[0]) not in self._on_gpu]
        grads = [p.grad.detach().contiguous() for p, _, _ in work]
        if self.step_in_backward and any(g.is_cuda for g in grads):
            grads, ready_stream = self._grads_to_host(grads, ready_stream)
        updates = [ops.OffloadUpdate(p.detach(), grad, state.get("master", p).detach(), state["exp_avg"],
                                     state["exp_avg_sq"], hyper, self._priority[id(p)])
                   for (p, state, hyper), grad in zip(work, grads)]
        tickets = self._offload.submit(updates, ready_stream)
        registry = engine().registry if is_initialized() else None
        for (p, _, _), ticket in zip(work, tickets):
            found = registry.lookup(p) if registry is not None else None
            if found is not None:
                found[0].await_write(ticket)
            else:
                # No gather stands between this parameter and its next reader (a replicated one):
                # the caller's stream waits here. These go first, so the wait is short.
                ticket.wait()

    def _grads_to_host(self, grads: List[torch.Tensor], ready_stream: Optional["torch.cuda.Stream"]
                       ) -> Tuple[List[torch.Tensor], "torch.cuda.Stream"]:
        """Copies of the GPU ``grads`` in page-locked host memory, made on a side stream once
        ``ready_stream`` (default: the current one) reaches this point; returns them (host ones as they
        were) and the stream that the copies are final on. A GPU gradient's memory can be reused once its
        copy is done, whoever drops it: it is marked in use by the side stream."""
        device = next(g.device for g in grads if g.is_cuda)
        if self._host_grad_stream is None:
            self._host_grad_stream = torch.cuda.Stream(device)
        stream = self._host_grad_stream
        stream.wait_stream(ready_stream or torch.cuda.current_stream(device))
        copies = []
        with torch.cuda.stream(stream):
            for grad in grads:
                if grad.is_cuda:
                    host = host_empty(grad.numel(), grad.dtype, pinned=True).view(grad.shape)
                    host.copy_(grad, non_blocking=True)
                    grad.record_stream(stream)
                    grad = host
                copies.append(grad)
        return copies, stream

    def _grads_final(self, buffer: Any) -> None:
        """The engine's report, during backward: ``buffer``'s gradient shard is final."""
        if self._auto_fraction:
            self._settle_fraction()  # the first backward is past its peak ([Note: automatic offload fraction])
        work = []
        for slot in buffer.slots:
            p = slot.param
            group = self._group_of.get(id(p))
            if group is None or p.grad is None or p.numel() == 0:
                continue
            work.append(self._advance(p, group, 1.0))
        if self.nonfinite != "unchecked" and not buffer.offloaded:
            for p, _, _ in work:  # queued behind this stream's work: no synchronisation (see step())
                flag = self._backward_flags.setdefault(p.grad.device,
                                                       torch.zeros(1, dtype=torch.uint8, device=p.grad.device))
                ops.has_inf_nan_into(p.grad.detach(), flag)
        self._queue(work, buffer.grad_stream)  # an offloaded buffer's gradient is still on its way to the host
        for p, _, _ in work:
            p.grad = None  # handed over: the queue holds it until the update is done

    def _check_backward_updates(self) -> None:
        """Raise if a block updated during this backward had a non-finite gradient on any rank."""
        flags, self._backward_flags = self._backward_flags, {}
        flag = torch.zeros(1, dtype=torch.uint8)
        for other in flags.values():
            flag = torch.maximum(flag, other.cpu())
        if is_initialized() and engine().ctx.world_size > 1:
            ctx = engine().ctx
            flag = flag.to(ctx.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=ctx.group)
        if bool(flag.item()):
            raise NonFiniteGradientError(
                "AdamOffloadOptimizer(step_in_backward=True): blocks were updated during backward with gradients "
                "holding inf or NaN, so their weights are damaged; reload the last checkpoint. The loss was "
                "probably not finite: lower the learning rate, or use step_in_backward=False, which checks every "
                "gradient before updating anything"
            )

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_scale: float = 1.0,
             assume_finite: bool = False) -> Any:
        """Queue the update of every parameter that has a gradient, and return without waiting for it.

        Without ``step_in_backward`` it first waits for the previous step's updates; with it, the
        blocks were updated during backward, and this queues the rest. The next forward waits, per
        block, for the parameters it gathers. On a machine without a GPU it waits for the updates
        before returning, as there is nothing to overlap them with.

        Args:
            closure: re-evaluates the model and returns the loss, as for any torch optimizer.
            grad_scale: gradients are multiplied by it as they are read.
            assume_finite: skip the check for non-finite gradients (the caller made it).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            ValueError: ``grad_scale`` other than 1 with ``step_in_backward=True``.
            NonFiniteGradientError: a gradient holds an inf or a NaN (``nonfinite="raise"``).
        """
        if self.step_in_backward and grad_scale != 1.0:
            raise ValueError("AdamOffloadOptimizer(step_in_backward=True) updated the blocks during backward "
                             f"with the gradients as they were; it cannot apply grad_scale={grad_scale} (loss "
                             "scaling or clipping) afterwards: use step_in_backward=False for that")
        if not self.step_in_backward:
            self.wait()
        elif self.nonfinite != "unchecked":
            self._check_backward_updates()
        loss, work = self._prepare(closure, grad_scale, assume_finite)
        if work is None:
            return loss
        self._offload.prioritise()
        self._queue(work)
        self._end_step()
        if self._auto_fraction:
            self._settle_fraction()
        elif is_initialized():
            engine().claim_gpu_memory(self, 0)  # the state kept on the GPU exists now
        if self._offload.device.type == "cpu" and not self.step_in_backward:
            self.wait()  # nothing to overlap with on a CPU-only machine
        return loss
