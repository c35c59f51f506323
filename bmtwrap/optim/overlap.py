"""The offload optimizer's work during backward: gradients handed to the host as they become final, and updates
started on them before ``step()`` (see [Note: speculative updates] in ``bmtwrap/engine/placement.py``).

The tensors involved, for one parameter ``p`` whose state is on the host:
- its gradient shard, final once backward has run every block that uses ``p``: copied to host memory (page-locked
  beside a GPU) on a side stream, with its 2-norm and an inf/nan flag computed there as ``grad_norm`` and
  ``any_nonfinite`` would, and ``p.grad`` set to ``None`` so that its GPU memory is free at once (a
  :class:`HandedGrad`, found by those functions through the engine's gradient holders);
- two sets of state (fp32 master and moments): ``optimizer.state[p]``, the state of the last step, and a spare
  set; a speculative update reads the first and writes the second (a :class:`Started`), so that the first is
  still there if the update must be redone or undone.

Invariants: a speculative update exists only for a gradient handed over in the backward pass predicted to be the
step's last; ``optimizer.state[p]`` is never written before ``step()`` decides; the parameter itself is written by
the speculative update, so anything that may read it before ``step()`` (a forward, ``zero_grad()``) first gives it
back the value it had (``BackwardOverlap._cancel_started``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import increment_version

from .. import ops
from ..engine.dist import is_initialized
from ..engine.offload import host_empty
from ..engine.schedule import engine
from .handed import HandedGrad
from .nonfinite import NonFiniteGradientError

__all__ = ["BackwardOverlap", "Started"]


@dataclass
class Started:
    """A speculative update in flight: what it read and with which hyper-parameters, and its ticket."""

    param: torch.Tensor
    grad: torch.Tensor
    hyper: Dict[str, Any]
    ticket: ops.OffloadTicket


class BackwardOverlap:
    """What :class:`~bmtwrap.optim.AdamOffloadOptimizer` does during backward with ``step_in_backward="auto"`` or
    ``"speculative"``. A mixin: it uses the optimizer's state, hyper-parameters and offload queue.

    State per step: ``_handed`` (param id -> :class:`HandedGrad`), ``_started`` (param id -> :class:`Started`),
    ``_spare`` (param id -> the second set of state), ``_passes_at_step`` (the engine's backward passes when the
    last step ended) and ``_passes_per_step`` (how many the last step had; ``None`` before the first).
    """

    # Set by the optimizer (see AdamOffloadOptimizer.__init__).
    _handed: Dict[int, HandedGrad]
    _started: Dict[int, Started]
    _spare: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    _passes_at_step: int
    _passes_per_step: Optional[int]
    _host_grad_stream: Optional["torch.cuda.Stream"]
    _handover_flags: Dict[torch.device, torch.Tensor]
    _in_step: bool
    _handed_scaled: bool
    _accumulating: bool
    _backward_flags: Dict[torch.device, torch.Tensor]
    _auto_fraction: bool
    speculation: Dict[str, int]

    def handed(self, param: torch.Tensor) -> Optional[HandedGrad]:
        """The gradient this optimizer took off ``param`` in this step's backward (the engine's holder protocol)."""
        return self._handed.get(id(param))

    def _pass_in_step(self) -> int:
        """The number, from 1, of the backward pass running now within this step."""
        return engine().passes_done - self._passes_at_step + 1

    def _handing_over(self) -> bool:
        """Whether final gradients leave for the host in the backward running now: in the pass that, as the last step
        had it, is the step's last; while the steps' shape is not known (the first step), in every pass until a
        second one comes before ``step()`` (then they come back, see :meth:`_overlap_forward`)."""
        if self._in_step:
            return False
        if self._passes_per_step is None:
            return not self._accumulating
        return self._passes_per_step == self._pass_in_step()

    def _overlap_final(self, params: Sequence[torch.Tensor], ready_stream: Optional["torch.cuda.Stream"],
                       offloaded: bool) -> None:
        """``params``' gradients are final (once ``ready_stream``, default the current one, reaches this point):
        hand them over and start the updates that have a spare set of state."""
        if offloaded:
            # Shards offloaded by wrap(offload_params=True): the engine is copying the gradient to the host already,
            # and .grad stays (host memory: it holds no GPU memory).
            grads = {id(p): (p.grad.detach(), ready_stream) for p in params}
        else:
            handed = self._hand_over(params, ready_stream)
            grads = {id(p): (h.host, h.stream) for p, h in zip(params, handed)}
        for p in params:
            if id(p) in self._spare and self.state.get(p):
                grad, stream = grads[id(p)]
                self._speculate(p, grad, stream)

    def _hand_over(self, params: Sequence[torch.Tensor],
                   ready_stream: Optional["torch.cuda.Stream"]) -> List[HandedGrad]:
        """Copy the gradients of ``params`` to host memory, with their norms and an inf/nan flag, and drop
        ``.grad``. Beside a GPU the work runs on a side stream once ``ready_stream`` (default: the current one)
        reaches this point, and each GPU gradient's memory is free for reuse once its copy is done."""
        device = params[0].grad.device
        flag = self._handover_flags.get(device)
        if flag is None:
            flag = self._handover_flags[device] = torch.zeros(1, dtype=torch.uint8, device=device)
        stream = None
        if device.type == "cuda":
            if self._host_grad_stream is None:
                self._host_grad_stream = torch.cuda.Stream(device)
            stream = self._host_grad_stream
            stream.wait_stream(ready_stream or torch.cuda.current_stream(device))
        handed = []
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for p in params:
                grad = p.grad.detach()
                norm = grad.float().norm(2.0)  # as grad_norm computes it: the same value, bit for bit
                ops.has_inf_nan_into(grad.contiguous(), flag)
                if grad.is_cuda:
                    host = host_empty(grad.numel(), grad.dtype, pinned=True).view(grad.shape)
                    host.copy_(grad, non_blocking=True)
                    grad.record_stream(stream)
                else:
                    host = grad.clone()  # the CPU: the same path, for the same results (and its tests)
                handed.append(HandedGrad(host, norm, flag, stream))
        for p, h in zip(params, handed):
            p.grad = None
            self._handed[id(p)] = h
        return handed

    def _speculate(self, p: torch.Tensor, grad: torch.Tensor, stream: Optional["torch.cuda.Stream"]) -> None:
        """Start ``p``'s update from its state into the spare set, with the hyper-parameters of the moment and the
        gradient as it is (once ``stream``, default the current one, reaches this point)."""
        state = self.state[p]
        hyper = self._hyper(self._group_of[id(p)], state["step"] + 1, 1.0)
        master, exp_avg, exp_avg_sq = self._spare[id(p)]
        update = ops.OffloadUpdate(p.detach(), grad, state.get("master", p).detach(), state["exp_avg"],
                                   state["exp_avg_sq"], hyper, self._priority[id(p)], master, exp_avg, exp_avg_sq,
                                   self._order[id(p)])
        ticket = self._offload.submit([update], stream)[0]
        self._after_write(p, ticket)
        self._started[id(p)] = Started(p, grad, hyper, ticket)

    def _overlap_forward(self, with_grad: bool) -> None:
        """A forward starts: updates started before ``step()`` were premature (the parameters must read as they
        were); with autograd, so is the hand-over (another backward is coming into the same gradients)."""
        if self._in_step:
            return
        if self._started:
            self._cancel_started()
        if with_grad and self._handed:
            self._return_grads()
            self._passes_per_step = None  # the steps changed shape: learn it again from the next one
            self._accumulating = True  # and keep this step's gradients on the GPU until its step

    def _cancel_started(self) -> None:
        """Undo the speculative updates: each parameter gets back its master rounded (the value it had), once the
        update's own write is done; the state was never written."""
        started, self._started = self._started, {}
        self.speculation["undone"] += len(started)
        with torch.no_grad():
            for s in started.values():
                s.ticket.wait()  # the host side is done, and the current stream follows its copy back
                master = self.state[s.param].get("master")
                if master is not None and master is not s.param:
                    s.param.detach().view(-1).copy_(master.detach().view(-1))  # rounds to nearest even
                increment_version(s.param)

    def _return_grads(self, keys: Optional[Sequence[int]] = None) -> None:
        """Put the handed-over gradients (of the parameters with ids ``keys``, default all) back on their parameters,
        where the next backward adds to them."""
        keys = list(self._handed) if keys is None else [k for k in keys if k in self._handed]
        if len(keys) == len(self._handed):
            self._handover_flags = {}
        params = {id(p): p for g in self.param_groups for p in g["params"]}
        for key in keys:
            h = self._handed.pop(key)
            h.ready()
            p = params[key]
            p.grad = h.host.to(p.device, non_blocking=True).view_as(p)

    def _clear_overlap(self) -> None:
        """The step has used what backward handed over."""
        self._handed = {}
        self._started = {}
        self._handover_flags = {}
        self._handed_scaled = False

    def _swap_state(self, p: torch.Tensor, state: Dict[str, Any]) -> None:
        """The spare set becomes ``p``'s state (written by a finished or queued update), the state the spare."""
        master, exp_avg, exp_avg_sq = self._spare[id(p)]
        self._spare[id(p)] = (state["master"], state["exp_avg"], state["exp_avg_sq"])
        state["master"], state["exp_avg"], state["exp_avg_sq"] = master, exp_avg, exp_avg_sq

    # --- step_in_backward=True: updates in place during backward ------------------------------------------------
    def _update_in_backward(self, buffer: Any, params: List[torch.Tensor]) -> None:
        """``step_in_backward=True``: update ``params`` now, in place, with their gradients as they are."""
        if self._auto_fraction:
            self._settle_fraction()  # the first backward is past its peak ([Note: automatic offload fraction])
        work = [self._advance(p, self._group_of[id(p)], 1.0) for p in params]
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
                "probably not finite: lower the learning rate, or use step_in_backward='auto', which checks every "
                "gradient before keeping any update"
            )

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
