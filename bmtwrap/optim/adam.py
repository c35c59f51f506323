"""Adam(W) with an fp32 master copy: on the parameters' device, or with its state on the CPU.

[Note: mixed precision]
A parameter may be bf16 or fp16 (what the model computes in and what gathers move). The
optimizer keeps, per parameter shard, an fp32 master copy and fp32 moments; each step updates the
master in fp32 and writes the rounded result into the parameter in the same pass. An fp32
parameter is its own master.

Both optimizers read ``grad_scale`` (``1 / loss_scale``, times a clipping coefficient) inside
the update, so unscaling and clipping cost no extra pass over the gradients.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch.autograd.graph import increment_version

from .. import ops
from ..dist import is_initialized
from ..schedule import engine

__all__ = ["AdamOffloadOptimizer", "AdamOptimizer"]


def _check_params(params: List[torch.Tensor], who: str) -> None:
    """Refuse parameters a sharded model cannot be trained through."""
    if not params:
        raise ValueError(f"{who} got an empty parameter list")
    devices = {p.device for p in params}
    if len(devices) > 1 or next(iter(devices)).type == "meta":
        raise ValueError(f"{who}: parameters are on {sorted(map(str, devices))}; an optimizer takes parameters "
                         "on one device (the GPU, or the CPU when there is none); materialise meta models first")
    if not is_initialized():
        return
    # Replicated parameters (plain ones outside blocks) are legitimate, so the mistake caught is
    # the whole list coming from an unwrapped copy while a sharded model exists.
    registry = engine().registry
    if registry.any_sharded() and not any(registry.is_sharded(p) for p in params):
        raise ValueError(
            f"{who}: none of the {len(params)} parameters is sharded by bmtwrap, but a sharded model exists; "
            "build the optimizer from the wrapped model's parameters() after bmtwrap.wrap(model) (or from the "
            "model made of bmtwrap blocks), not from an unwrapped copy"
        )


class _AdamBase(torch.optim.Optimizer):
    """Hyper-parameters, state layout and (de)serialisation shared by both optimizers."""

    def __init__(self, params: Iterable[Any], lr: float, betas: Tuple[float, float], eps: float,
                 weight_decay: float, decoupled: bool, master_dtype: torch.dtype, who: str) -> None:
        if master_dtype != torch.float32:
            raise TypeError(f"{who}: the master copy must be fp32 (master_dtype=torch.float32), got {master_dtype}")
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"{who}: lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"{who}: betas must be in [0, 1), got {betas}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, decoupled=decoupled)
        super().__init__(params, defaults)
        _check_params([p for g in self.param_groups for p in g["params"]], who)
        self._who = who

    # Loading keeps fp32 state fp32: torch's Optimizer.load_state_dict would cast it to each
    # parameter's dtype, rounding the master copy of a bf16 model to bf16.
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"{self._who}: the state has {len(groups)} parameter groups, this optimizer "
                             f"{len(self.param_groups)}")
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in groups for i in g["params"]]
        if len(saved_ids) != len(params):
            raise ValueError(f"{self._who}: the state is for {len(saved_ids)} parameters, this optimizer has {len(params)}")
        mine = dict(zip(saved_ids, params))
        new_state: Dict[torch.Tensor, Dict[str, Any]] = {}
        for key, entry in state_dict["state"].items():
            p = mine[key]
            for name, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() != p.numel():
                    raise ValueError(
                        f"{self._who}: state '{name}' of parameter {key} has {value.numel()} elements but the "
                        f"parameter has {p.numel()}; load optimizer states at the world size they were saved at, "
                        "or through bmtwrap's sharded checkpoints"
                    )
            new_state[p] = {name: self._place(p, name, value) for name, value in entry.items()}
        self.state.clear()
        self.state.update(new_state)
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def _place(self, param: torch.Tensor, name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        return value.to(device=self._state_device(param), dtype=torch.float32).view(param.shape).clone()

    def _state_device(self, param: torch.Tensor) -> torch.device:
        return param.device

    def _new_state(self, p: torch.Tensor) -> Dict[str, Any]:
        device = self._state_device(p)
        state: Dict[str, Any] = {"step": 0,
                                 "exp_avg": torch.zeros(p.shape, dtype=torch.float32, device=device),
                                 "exp_avg_sq": torch.zeros(p.shape, dtype=torch.float32, device=device)}
        if p.dtype != torch.float32 or device != p.device:
            state["master"] = p.detach().to(device=device, dtype=torch.float32).clone()
        return state

    def _prepare(self, closure: Optional[Callable[[], Any]], grad_scale: float) -> Tuple[Any, List[Tuple[Any, ...]]]:
        """Run the closure; advance the step of every parameter with a gradient; return the work."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p.numel() == 0:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self._new_state(p))
                state["step"] += 1
                work.append((p, state, self._hyper(group, state["step"], grad_scale)))
        return loss, work

    @staticmethod
    def _hyper(group: Dict[str, Any], step: int, grad_scale: float) -> Dict[str, Any]:
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                    step=step, grad_scale=grad_scale, decoupled=group["decoupled"])


class AdamOptimizer(_AdamBase):
    """Adam(W) on the parameters' device with an fp32 master (see [Note: mixed precision]).

    On CUDA one fused kernel reads the gradient (fp32/bf16/fp16), updates master and moments and
    writes the rounded parameter; on the CPU the vectorised CPU kernel does the same.

    Args:
        params: parameters (or groups) of a wrapped model.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        decoupled: weight decay as AdamW (default) or as L2 added to the gradient (Adam).
        master_dtype: must be ``torch.float32``; any other raises ``TypeError``.

    Raises:
        ValueError: bad hyper-parameters; parameters on several devices or on meta; parameters
            that are not a wrapped model's when one is in use.
        TypeError: a master dtype other than fp32.

    Example::

        optimizer = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-4, weight_decay=0.1)
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, decoupled: bool = True,
                 master_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, decoupled, master_dtype, "AdamOptimizer")

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_scale: float = 1.0) -> Any:
        """One update; gradients are multiplied by ``grad_scale`` as they are read."""
        loss, work = self._prepare(closure, grad_scale)
        for p, state, hyper in work:
            master = state.get("master", p)
            out = p if master is not p else None
            update = ops.adam_step_cuda if p.is_cuda else ops.adam_step_cpu
            update(master.view(-1), p.grad.detach().reshape(-1), state["exp_avg"].view(-1),
                   state["exp_avg_sq"].view(-1), out=None if out is None else out.view(-1), **hyper)
            increment_version(p)  # written through a raw pointer: gathered copies are now stale
        return loss


class AdamOffloadOptimizer(_AdamBase):
    """Adam(W) whose fp32 master and moments live in pinned CPU memory.

    ``step()`` copies each gradient shard to the CPU, updates it there with the vectorised CPU
    kernel on a worker thread, and copies the new parameter back, pipelined parameter by
    parameter, in the order the model's forward needs them. It returns once every update is
    queued; a parameter's gather (the next forward) waits for its own copy only, so the CPU work
    overlaps the next forward.

    Args: as :class:`AdamOptimizer`.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, decoupled: bool = True,
                 master_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, decoupled, master_dtype, "AdamOffloadOptimizer")
        self._worker: Optional[threading.Thread] = None
        self._error: List[BaseException] = []

    def _state_device(self, param: torch.Tensor) -> torch.device:
        return torch.device("cpu")

    def _new_state(self, p: torch.Tensor) -> Dict[str, Any]:
        state = super()._new_state(p)
        pin = p.is_cuda
        for key in ("exp_avg", "exp_avg_sq", "master"):
            if pin and key in state:
                state[key] = state[key].pin_memory()
        if p.is_cuda:
            state["grad_host"] = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
            state["param_host"] = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
        return state

    def _place(self, param: torch.Tensor, name: str, value: Any) -> Any:
        placed = super()._place(param, name, value)
        if isinstance(placed, torch.Tensor) and param.is_cuda:
            if name in ("grad_host", "param_host"):
                return torch.empty(param.shape, dtype=param.dtype, pin_memory=True)
            return placed.pin_memory()
        return placed

    def state_dict(self) -> Dict[str, Any]:
        self.wait()
        full = super().state_dict()
        for entry in full["state"].values():
            entry.pop("grad_host", None)
            entry.pop("param_host", None)
        return full

    def wait(self) -> None:
        """Block until the last step's updates are written back."""
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        if self._error:
            error, self._error = self._error[0], []
            raise error

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_scale: float = 1.0) -> Any:
        self.wait()
        loss, work = self._prepare(closure, grad_scale)
        if not work:
            return loss
        if not work[0][0].is_cuda:
            for p, state, hyper in work:  # CPU parameters: nothing to overlap with
                self._update_on_cpu(p, state, hyper, p.grad.detach())
                increment_version(p)
            return loss
        self._pipeline(work)
        return loss

    def _update_on_cpu(self, p: torch.Tensor, state: Dict[str, Any], hyper: Dict[str, Any],
                       grad: torch.Tensor) -> torch.Tensor:
        """Update master and moments; return the host tensor holding the new parameter value."""
        master = state.get("master", p)
        if p.dtype == torch.float32:
            out = None  # the master is the new value
        else:
            out = state["param_host"] if p.is_cuda else p
        ops.adam_step_cpu(master.view(-1), grad.reshape(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1),
                          out=None if out is None else out.view(-1), **hyper)
        return master if out is None else out

    def _pipeline(self, work: List[Tuple[torch.Tensor, Dict[str, Any], Dict[str, Any]]]) -> None:
        """D2H of every gradient (queued at once) → CPU update per parameter → H2D per parameter."""
        device = work[0][0].device
        d2h = torch.cuda.Stream(device)
        h2d = torch.cuda.Stream(device)
        compute = torch.cuda.current_stream(device)
        d2h.wait_stream(compute)  # gradients are final on the compute stream
        fetched = []
        with torch.cuda.stream(d2h):
            for p, state, _ in work:
                p.grad.record_stream(d2h)  # zero_grad() may drop it before the copy has read it
                state["grad_host"].copy_(p.grad.detach(), non_blocking=True)
                event = torch.cuda.Event()
                event.record(d2h)
                fetched.append(event)
        # Until its copy lands, each parameter's next gather must wait: the engine checks this.
        written = [torch.cuda.Event() for _ in work]
        gates = [threading.Event() for _ in work]
        registry = engine().registry if is_initialized() else None
        for (p, _, _), gate, event in zip(work, gates, written):
            if registry is not None:
                found = registry.lookup(p)
                if found is not None:
                    found[0].await_write(gate, event)

        def run() -> None:
            try:
                for (p, state, hyper), ready, gate, event in zip(work, fetched, gates, written):
                    ready.synchronize()
                    value = self._update_on_cpu(p, state, hyper, state["grad_host"])
                    with torch.cuda.stream(h2d):
                        p.detach().copy_(value, non_blocking=True)
                        event.record(h2d)
                    increment_version(p)
                    gate.set()
            except BaseException as error:  # surfaced by wait(); release waiters first
                self._error.append(error)
                for gate in gates:
                    gate.set()

        self._worker = threading.Thread(target=run, name="bmtwrap-offload-adam", daemon=True)
        self._worker.start()
