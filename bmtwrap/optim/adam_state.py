"""What both Adam optimizers share: the parameters they accept, the state's layout and (de)serialisation.

[Note: mixed precision]
A parameter may be bf16 or fp16 (what the model computes in and what gathers move). The
optimizer keeps, per parameter shard, an fp32 master copy and fp32 moments; each step updates the
master in fp32 and writes the rounded result into the parameter in the same pass. An fp32
parameter is its own master. A bf16 parameter whose state is on its own device holds half of its
master: the parameter is the master rounded to nearest even, and the state keeps only the master's
low 16 bits (``state["master_low"]``; see [Note: split master] in ``csrc/common.h``), so that each
parameter is kept once and its state takes 10 bytes per element instead of 12. ``state_dict()``
joins the halves into the fp32 ``"master"`` every other layout has (on the CPU), and
``load_state_dict()`` splits it again, writing the parameter: checkpoints are the same either way.

Both optimizers read ``grad_scale`` (``1 / loss_scale``, times a clipping coefficient) inside
the update, so unscaling and clipping cost no extra pass over the gradients.
"""

from __future__ import annotations

import warnings

from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch.autograd.graph import increment_version

from .. import ops
from ..engine.dist import is_initialized
from ..engine.offload import OffloadPolicy, adam_state_bytes
from ..engine.schedule import engine
from .nonfinite import NonFiniteGradientError, PendingCheck, check_choice, describe_nonfinite, start_check

Work = Tuple[torch.Tensor, Dict[str, Any], Dict[str, Any]]  # a parameter, its state, this update's hyper-parameters


def _check_params(params: List[torch.Tensor], who: str) -> None:
    """Refuse parameters a sharded model cannot be trained through."""
    if not params:
        raise ValueError(f"{who} got an empty parameter list")
    devices = {p.device for p in params}
    # The CPU may join one accelerator only with shards offloaded there by wrap(offload_params=True).
    accelerators = {d for d in devices if d.type != "cpu"}
    registry = engine().registry if is_initialized() else None
    stray = accelerators and any(p.device.type == "cpu" and not _offload_policy(registry, p).params for p in params)
    if len(accelerators) > 1 or stray or any(d.type == "meta" for d in devices):
        raise ValueError(f"{who}: parameters are on {sorted(map(str, devices))}; an optimizer takes parameters "
                         "on one device (the GPU, or the CPU when there is none; beside the GPU, only shards "
                         "that wrap(offload_params=True) keeps on the CPU); move the model to one device, and "
                         "materialise meta models, before building the optimizer")
    if registry is None:
        return
    # Replicated parameters (plain ones outside blocks) are legitimate, so the likely mistake is the
    # whole list coming from an unwrapped copy while a sharded model exists. A warning, not an error:
    # a plain model trained beside a sharded one is legitimate too (BMTrain's programs compare them so).
    if registry.any_sharded() and not any(registry.is_sharded(p) for p in params):
        warnings.warn(
            f"{who}: none of the {len(params)} parameters is sharded by bmtwrap, but a sharded model exists; if "
            "they are an unwrapped copy's, the wrapped model will not train: build the optimizer from the wrapped "
            "model's parameters() after bmtwrap.wrap(model) (or from the model made of bmtwrap blocks)",
            UserWarning, stacklevel=4)


def _offload_policy(registry: Any, param: torch.Tensor) -> OffloadPolicy:
    """What the flat buffer holding ``param`` keeps on the host; nothing for a parameter outside every buffer."""
    found = registry.lookup(param) if registry is not None else None
    return found[0].offload if found is not None else OffloadPolicy()


def _update_in_place(p: torch.Tensor, state: Dict[str, Any], hyper: Dict[str, Any],
                     skip_if: Optional[torch.Tensor] = None) -> None:
    """One Adam(W) step of ``p`` by the kernel of its own device, state on the same device; on a GPU, one that
    writes nothing if ``skip_if`` is set when it runs."""
    gate = {} if skip_if is None else {"skip_if": skip_if}
    low = state.get("master_low")
    if low is not None:
        ops.adam_step_split(p.detach().view(-1), low.view(-1), p.grad.detach().reshape(-1), state["exp_avg"].view(-1),
                            state["exp_avg_sq"].view(-1), **hyper, **gate)
        increment_version(p)
        return
    master = state.get("master", p)
    out = p if master is not p else None
    update = ops.adam_step_cuda if p.is_cuda else ops.adam_step_cpu
    update(master.view(-1), p.grad.detach().reshape(-1), state["exp_avg"].view(-1),
           state["exp_avg_sq"].view(-1), out=None if out is None else out.view(-1), **hyper, **gate)
    increment_version(p)  # written through a raw pointer: gathered copies are now stale


class _AdamBase(torch.optim.Optimizer):
    """Hyper-parameters, state layout and (de)serialisation shared by both optimizers."""

    def __init__(self, params: Iterable[Any], lr: float, betas: Tuple[float, float], eps: float,
                 weight_decay: float, decoupled: bool, master_dtype: torch.dtype, who: str, hold_steps: int = 0,
                 nonfinite: str = "raise") -> None:
        if master_dtype != torch.float32:
            raise TypeError(f"{who}: the master copy must be fp32 (master_dtype=torch.float32), got {master_dtype}")
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"{who}: lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"{who}: betas must be in [0, 1), got {betas}")
        if not isinstance(hold_steps, int) or hold_steps < 0:
            raise ValueError(f"{who}: hold_steps must be an int >= 0, got {hold_steps!r}")
        check_choice(nonfinite, who)
        # hold_steps lives in each group, so that state_dict()/load_state_dict() carry what is left of it.
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, decoupled=decoupled,
                        hold_steps=hold_steps)
        super().__init__(params, defaults)
        _check_params([p for g in self.param_groups for p in g["params"]], who)
        self._who = who
        self.nonfinite = nonfinite
        self.skipped_steps = 0  # steps skipped for non-finite gradients (nonfinite="skip")

    # Loading keeps fp32 state fp32: torch's Optimizer.load_state_dict would cast it to each
    # parameter's dtype, rounding the master copy of a bf16 model to bf16.
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore what ``state_dict()`` returned; master copies and moments stay fp32.

        Raises:
            ValueError: a different number of parameter groups or parameters, or state of another
                size than its parameter (saved at another world size: load it through
                :func:`bmtwrap.load_checkpoint`, which reshards).
        """
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
            new_state[p] = self._split_master(p, {name: self._place(p, name, value) for name, value in entry.items()})
        self.state.clear()
        self.state.update(new_state)
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def _place(self, param: torch.Tensor, name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        return value.to(device=self._state_device(param), dtype=torch.float32).view(param.shape).clone()

    def state_dict(self) -> Dict[str, Any]:
        """As torch's, with every master an fp32 ``"master"``: split ones are joined, on the CPU (see
        [Note: mixed precision]). The other state tensors are the optimizer's own, as torch returns them."""
        state_dict = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for index, entry in list(state_dict["state"].items()):
            if "master_low" in entry:
                entry = dict(entry)  # torch hands out the state's own dicts
                low = entry.pop("master_low")
                weight = params[index].detach().reshape(-1).cpu()
                entry["master"] = ops.join_master(weight, low.reshape(-1).cpu()).view(low.shape)
                state_dict["state"][index] = entry
        return state_dict

    def _splits_master(self, p: torch.Tensor, device: torch.device) -> bool:
        """Whether a master on ``device`` is split with ``p`` (see [Note: mixed precision])."""
        return p.dtype == torch.bfloat16 and device == p.device

    @torch.no_grad()
    def _split_master(self, p: torch.Tensor, state: Dict[str, Any]) -> Dict[str, Any]:
        """``state`` with its fp32 ``"master"`` split, if ``p`` holds half of it: ``p`` is written (the
        master rounded to nearest even) and ``"master_low"`` takes its place."""
        master = state.get("master")
        if master is None or not self._splits_master(p, master.device):
            return state
        state = {k: v for k, v in state.items() if k != "master"}
        weight = torch.empty(p.numel(), dtype=torch.bfloat16)
        low = torch.empty(p.numel(), dtype=ops.master_split.LOW_DTYPE)
        ops.split_master(master.detach().reshape(-1).cpu(), weight, low)
        p.detach().view(-1).copy_(weight)  # bumps p's version: gathered copies are stale
        state["master_low"] = low.to(p.device).view(p.shape)
        return state

    def _state_device(self, param: torch.Tensor) -> torch.device:
        return param.device

    def _new_state(self, p: torch.Tensor) -> Dict[str, Any]:
        device = self._state_device(p)
        state: Dict[str, Any] = {"step": 0,
                                 "exp_avg": torch.zeros(p.shape, dtype=torch.float32, device=device),
                                 "exp_avg_sq": torch.zeros(p.shape, dtype=torch.float32, device=device)}
        if self._splits_master(p, device):
            # p is its own master to begin with: low halves of zero.
            state["master_low"] = torch.zeros(p.shape, dtype=ops.master_split.LOW_DTYPE, device=device)
        elif p.dtype != torch.float32 or device != p.device:
            state["master"] = p.detach().to(device=device, dtype=torch.float32).clone()
        return state

    def _prepare(self, closure: Optional[Callable[[], Any]], grad_scale: float,
                 assume_finite: bool) -> Tuple[Any, Optional[List[Work]]]:
        """Run the closure; check the gradients (see [Note: non-finite gradients]), launching the updates of the
        state on the GPU before the answer is read; advance the step of every other parameter with a gradient and
        return its work, or ``None`` for a step skipped."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        launched = self._checked(assume_finite, grad_scale, lambda p: p.is_cuda,
                                 lambda work, flag: [_update_in_place(*item, skip_if=flag) for item in work])
        if launched is None:
            return loss, None
        self._check_room([p for g in self.param_groups for p in g["params"]
                          if p.grad is not None and not self.state.get(p)])
        work = [self._advance(p, group, grad_scale) for group in self.param_groups for p in group["params"]
                if p.grad is not None and p.numel() > 0 and id(p) not in launched]
        return loss, work

    def _checked(self, assume_finite: bool, grad_scale: float, early: Callable[[torch.Tensor], bool],
                 launch: Callable[[List[Work], torch.Tensor], Any]) -> Optional[Set[int]]:
        """Check the gradients for this step; ``launch(work, flag)`` the updates of the parameters ``early``
        picks (with state made by an earlier step) before reading the answer, each gated on ``flag`` (see
        [Note: updates before the check]). Returns the ids of the parameters launched, or ``None`` for a step
        skipped (their step counts put back)."""
        if assume_finite or self.nonfinite == "unchecked":
            return set()
        params = [p for g in self.param_groups for p in g["params"]]
        check = start_check(params)
        launched: List[Work] = []
        if check.on_gpu:
            launched = [self._advance(p, group, grad_scale) for group in self.param_groups for p in group["params"]
                        if p.grad is not None and p.numel() > 0 and self.state.get(p) and early(p)]
            if launched:
                launch(launched, check.flag)
        finite = False
        try:
            finite = self._finite(params, check)
        finally:
            if not finite:
                for _, state, _ in launched:
                    state["step"] -= 1  # their kernels read the flag and wrote nothing
        return {id(p) for p, _, _ in launched} if finite else None

    def _check_room(self, params: List[torch.Tensor]) -> None:
        """Raise before making the state of ``params`` on a GPU that cannot hold it (a clear error instead of the
        allocator's, part-way through the step)."""
        devices = {self._state_device(p) for p in params}
        for device in (d for d in devices if d.type == "cuda"):
            needed = sum(p.numel() * adam_state_bytes(p.dtype) for p in params if self._state_device(p) == device)
            free, _ = torch.cuda.mem_get_info(device)
            room = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            if needed > room:
                raise torch.OutOfMemoryError(
                    f"{self._who}: its state (fp32 master and moments) needs {needed / 2**30:.1f} GiB on {device}, "
                    f"which has {room / 2**30:.1f} GiB left; nothing was made or updated. "
                    "bmtwrap.optim.auto_adam(model.parameters(), ...) keeps on the GPU the state that fits and "
                    "updates the rest on the CPU (or AdamOffloadOptimizer(offload_fraction=...) by hand)")

    def _finite(self, params: List[torch.Tensor], check: PendingCheck) -> bool:
        """Whether to step, by ``check`` of ``params``: gradients finite on every rank; else raise, or count a
        skipped step."""
        if self.nonfinite == "unchecked" or not check.found():
            return True
        if self.nonfinite == "skip":
            self.skipped_steps += 1
            return False
        raise NonFiniteGradientError(
            f"{self._who}: gradients hold inf or NaN ({describe_nonfinite(params)}); nothing was "
            "updated. The loss was probably not finite: lower the learning rate, use a loss scale with fp16, "
            "or pass nonfinite='skip' to skip such steps"
        )

    def _advance(self, p: torch.Tensor, group: Dict[str, Any],
                 grad_scale: float) -> Tuple[torch.Tensor, Dict[str, Any], Dict[str, Any]]:
        """Count one more step for ``p``; return it with its state and this update's hyper-parameters."""
        state = self.state[p]
        if not state:
            state.update(self._new_state(p))
        state["step"] += 1
        return p, state, self._hyper(group, state["step"], grad_scale)

    def _end_step(self) -> None:
        """A step is over: one held step fewer in every group that holds."""
        for group in self.param_groups:
            if group.get("hold_steps", 0) > 0:
                group["hold_steps"] -= 1

    @staticmethod
    def _hyper(group: Dict[str, Any], step: int, grad_scale: float) -> Dict[str, Any]:
        beta1, beta2 = group["betas"]
        # A held step (BMTrain's hold_steps) updates the moments but moves no parameter: lr 0.
        lr = 0.0 if group.get("hold_steps", 0) > 0 else group["lr"]
        return dict(lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                    step=step, grad_scale=grad_scale, decoupled=group["decoupled"])
