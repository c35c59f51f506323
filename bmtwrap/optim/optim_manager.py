"""OptimManager: loss scaling, global gradient clipping and stepping of several optimizers."""

from __future__ import annotations

import math
import inspect
from typing import Any, Dict, Iterable, List, Optional, Protocol

import torch
import torch.distributed as dist

from ..engine.schedule import engine
from .nonfinite import NonFiniteGradientError, any_nonfinite, check_choice, describe_nonfinite
from .handed import handed_grad, norm_term

__all__ = ["OptimManager", "ScaledStep", "clip_grads_with_norm", "grad_norm"]


class ScaledStep(Protocol):
    """What the manager asks of an optimizer beyond ``torch.optim.Optimizer``; both parts optional.

    - ``step(closure=None, *, grad_scale=1.0)``: the gradients are multiplied by ``grad_scale`` as
      they are read, so unscaling and clipping cost no pass over memory (bmtwrap's Adams). Without
      that keyword, the manager multiplies ``.grad`` itself before ``step()``.
    - ``step_in_backward``: ``True`` when the optimizer updates parameters during backward, so no
      loss scale can be checked and no norm clipped before the update.
    """

    step_in_backward: bool

    def step(self, closure: Any = None, *, grad_scale: float = 1.0) -> Any:
        """Update the parameters, reading each gradient times ``grad_scale``."""


class OptimManager:
    """Steps optimizers together, with an optional dynamic loss scale (BMTrain's class).

    Gradients are averaged over ranks by the engine, so ``backward(loss)`` with each rank's mean
    loss over its share of a batch gives the gradient of the mean over the whole batch, exactly
    as plain ``loss.backward()`` does.

    Unscaling and clipping are one factor applied at the step (``1 / loss_scale`` times the
    clipping coefficient): bmtwrap's optimizers apply it while they read the gradients, so neither
    costs a pass over memory; for any other optimizer it is applied to ``.grad`` just before its
    step. So between backward and ``step`` the ``.grad`` tensors hold the scaled, unclipped values.
    As in BMTrain, the step divides by the loss scale whenever scaling is on, however the loss was
    scaled (``backward(loss)``, or ``(manager.loss_scale * loss).backward()``).

    Args:
        loss_scale: initial loss scale; ``None`` (default) disables scaling (fp32 or bf16).
        loss_scale_factor: the scale is divided by this on overflow and multiplied by it after
            ``loss_scale_steps`` clean steps.
        loss_scale_steps: clean steps before the scale grows.
        min_loss_scale: the scale never shrinks below this.
        max_loss_scale: the scale never grows above this.
        grad_scale: BMTrain's divisor of the loss before its gradients are summed over ranks;
            ``None`` (default) means the number of ranks, i.e. the mean over ranks, which is what
            bmtwrap's reduction computes. Another value ``g`` multiplies the gradients by
            ``world_size / g``.
        nonfinite: without a loss scale, what ``step()`` does when a gradient holds an inf or a
            NaN on any rank: ``"raise"`` (default) :class:`~bmtwrap.optim.NonFiniteGradientError`,
            ``"skip"`` the step (gradients zeroed, ``step()`` returns ``False``), or
            ``"unchecked"``. With a loss scale an overflow always lowers the scale and skips.

    Raises:
        ValueError: a non-positive scale or ``grad_scale``, a factor of 1, bounds out of order.

    Example::

        manager = bmt.optim.OptimManager(loss_scale=2**15)
        manager.add_optimizer(optimizer, scheduler)
        for batch in data:
            manager.zero_grad()
            manager.backward(model(batch))
            manager.clip_grad_norm(optimizer.param_groups, max_norm=1.0)
            manager.step()
    """

    def __init__(self, loss_scale: Optional[float] = None, loss_scale_factor: float = 2,
                 loss_scale_steps: int = 1024, min_loss_scale: float = 1, max_loss_scale: float = float("inf"),
                 grad_scale: Optional[float] = None, nonfinite: str = "raise") -> None:
        check_choice(nonfinite, "OptimManager")
        if loss_scale is not None and not loss_scale > 0:
            raise ValueError(f"loss_scale must be > 0 or None, got {loss_scale!r}")
        if grad_scale is not None and not grad_scale > 0:
            raise ValueError(f"grad_scale must be > 0 or None (the number of ranks), got {grad_scale!r}")
        if loss_scale_factor <= 0 or loss_scale_factor == 1:
            raise ValueError(f"loss_scale_factor must be > 0 and != 1, got {loss_scale_factor!r}")
        if not 0 < min_loss_scale <= max_loss_scale:
            raise ValueError(f"need 0 < min_loss_scale <= max_loss_scale, got {min_loss_scale!r} and {max_loss_scale!r}")
        self.loss_scale_enabled = loss_scale is not None
        self.loss_scale = float(loss_scale) if loss_scale is not None else 1.0
        self.loss_scale_factor = loss_scale_factor if loss_scale_factor > 1 else 1 / loss_scale_factor
        self.loss_scale_steps = loss_scale_steps
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = max_loss_scale
        self.steps_since_last_scale = 0
        self.optimizers: List[torch.optim.Optimizer] = []
        self.lr_schedulers: List[Optional[Any]] = []
        self.grad_scale = grad_scale
        self.nonfinite = nonfinite
        self._clip = 1.0  # the clipping coefficient clip_grad_norm chose for the coming step

    def add_optimizer(self, optimizer: torch.optim.Optimizer, lr_scheduler: Optional[Any] = None) -> None:
        """Manage ``optimizer`` (any ``torch.optim.Optimizer``) and step ``lr_scheduler`` with it."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"add_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if self.loss_scale_enabled and getattr(optimizer, "step_in_backward", False):
            raise ValueError("this optimizer steps in backward (step_in_backward=True), before a loss scale could "
                             "be checked for overflow; use OptimManager(loss_scale=None) (bf16 needs none) or "
                             "step_in_backward='auto'")
        self.optimizers.append(optimizer)
        self.lr_schedulers.append(lr_scheduler)

    def _params(self, param_groups: Optional[Iterable[Dict[str, Any]]] = None) -> List[torch.Tensor]:
        groups = param_groups if param_groups is not None else [g for o in self.optimizers for g in o.param_groups]
        return [p for group in groups for p in group["params"]]

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale; ``loss`` itself when scaling is off."""
        return loss * self.loss_scale if self.loss_scale_enabled else loss

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` with the loss scale applied."""
        self.scale_loss(loss).backward()

    def _unscale(self) -> float:
        """What the gradients are multiplied by before clipping: the loss scale and ``grad_scale`` undone."""
        factor = 1.0 / self.loss_scale if self.loss_scale_enabled else 1.0
        if self.grad_scale is not None:
            factor *= engine().ctx.world_size / self.grad_scale
        return factor

    def zero_grad(self) -> None:
        """``zero_grad()`` of every managed optimizer."""
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    @staticmethod
    def _step_keywords(optimizer: torch.optim.Optimizer) -> List[str]:
        """Which of bmtwrap's step keywords (``grad_scale``, ``assume_finite``) the optimizer takes."""
        names = inspect.signature(optimizer.step).parameters
        return [name for name in ("grad_scale", "assume_finite") if name in names]

    def _skip_nonfinite(self) -> bool:
        """Without a loss scale: whether a non-finite gradient skips this step (it raises with "raise")."""
        if self.nonfinite == "unchecked" or any(getattr(o, "step_in_backward", False) for o in self.optimizers):
            return False  # optimizers stepping in backward check their own gradients
        if not any_nonfinite(self._params()):
            return False
        if self.nonfinite == "raise":
            raise NonFiniteGradientError(
                f"OptimManager: gradients hold inf or NaN ({describe_nonfinite(self._params())}); nothing was updated. The "
                "loss was probably not finite: lower the learning rate, use a loss scale with fp16, or pass "
                "OptimManager(nonfinite='skip') to skip such steps"
            )
        return True

    @torch.no_grad()
    def clip_grad_norm(self, param_groups: Iterable[Dict[str, Any]], max_norm: float, norm_type: float = 2,
                       eps: float = 1e-6) -> torch.Tensor:
        """Scale the gradients of ``param_groups`` so that their global norm is at most ``max_norm``.

        The norm is over the whole (unsharded) gradient: shard norms are combined over ranks,
        replicated parameters counted once. Returns the norm before clipping (unscaled); the
        clipping itself joins the pending factor that the step applies.
        """
        if any(getattr(o, "step_in_backward", False) for o in self.optimizers):
            raise ValueError("clip_grad_norm needs every gradient before any update, but an optimizer steps in "
                             "backward (step_in_backward=True); use step_in_backward='auto' to clip")
        total = grad_norm(self._params(param_groups), norm_type) * (self._unscale() * self._clip)
        coef = max_norm / (total.item() + eps)
        if coef < 1:
            self._clip *= coef
        return total

    def step(self) -> bool:
        """Step every optimizer and scheduler; with a loss scale, skip the step on overflow.

        Returns:
            ``True`` if the optimizers stepped, ``False`` if an overflow skipped the step (the
            scale then shrinks and the gradients are zeroed).
        """
        if self.loss_scale_enabled and any_nonfinite(self._params()):
            self._set_scale(max(self.loss_scale / self.loss_scale_factor, self.min_loss_scale))
            self.zero_grad()
            self._clip = 1.0
            return False
        if not self.loss_scale_enabled and self._skip_nonfinite():
            self.zero_grad()
            self._clip = 1.0
            return False
        factor = self._unscale() * self._clip
        for optimizer, scheduler in zip(self.optimizers, self.lr_schedulers):
            keywords = self._step_keywords(optimizer)
            if "grad_scale" in keywords:
                # The manager checked every gradient already (see nonfinite.py).
                optimizer.step(grad_scale=factor, **({"assume_finite": True} if "assume_finite" in keywords else {}))
            else:
                if factor != 1.0:
                    with torch.no_grad():
                        for group in optimizer.param_groups:
                            for p in group["params"]:
                                if p.grad is not None:
                                    p.grad.mul_(factor)
                optimizer.step()
            if scheduler is not None:
                scheduler.step()
        self._clip = 1.0
        if self.loss_scale_enabled:
            self.steps_since_last_scale += 1
            if self.steps_since_last_scale >= self.loss_scale_steps:
                self._set_scale(min(self.loss_scale * self.loss_scale_factor, self.max_loss_scale))
        return True

    def _set_scale(self, scale: float) -> None:
        self.loss_scale = scale
        self.steps_since_last_scale = 0

    def state_dict(self, gather_opt: bool = False) -> Dict[str, Any]:
        """Optimizers, schedulers and the loss-scale state (this rank's shards).

        Args:
            gather_opt: BMTrain's request for optimizer state gathered to full shapes; only
                ``False`` is supported (:func:`bmtwrap.save_checkpoint` saves optimizer state that
                loads at any world size).

        Raises:
            NotImplementedError: ``gather_opt=True``.
        """
        if gather_opt:
            raise NotImplementedError("OptimManager.state_dict(gather_opt=True) is not supported; save with "
                                      "bmtwrap.save_checkpoint(folder, model, manager), which reshards optimizer "
                                      "state to any world size on load")
        return {
            "optimizers": [o.state_dict() for o in self.optimizers],
            "lr_schedulers": [s.state_dict() if s is not None else None for s in self.lr_schedulers],
            "loss_scale": self.loss_scale,
            "loss_scale_enabled": self.loss_scale_enabled,
            "steps_since_last_scale": self.steps_since_last_scale,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, into the same number of optimizers."""
        if len(state["optimizers"]) != len(self.optimizers):
            raise ValueError(
                f"state holds {len(state['optimizers'])} optimizers but this manager has {len(self.optimizers)}; "
                "add the same optimizers in the same order before loading"
            )
        for optimizer, saved in zip(self.optimizers, state["optimizers"]):
            optimizer.load_state_dict(saved)
        for scheduler, saved in zip(self.lr_schedulers, state["lr_schedulers"]):
            if scheduler is not None and saved is not None:
                scheduler.load_state_dict(saved)
        self.loss_scale = state["loss_scale"]
        self.loss_scale_enabled = state["loss_scale_enabled"]
        self.steps_since_last_scale = state["steps_since_last_scale"]


@torch.no_grad()
def grad_norm(params: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the whole (unsharded) gradient of ``params``, the same on every rank.

    A collective: every rank calls it with its own parameters of the same model. The gradient
    shards of sharded parameters are combined over the ranks of a shard group (each piece once, under
    hybrid sharding too); replicated parameters (plain ones outside blocks) are counted once.
    Parameters without a gradient are skipped.

    Args:
        params: parameters of a model sharded by bmtwrap (and any replicated ones beside them).
        norm_type: the p of the p-norm; ``float("inf")`` for the largest absolute value.

    Returns:
        A 0-dim fp32 tensor on this rank's device.

    Example::

        from bmtwrap.optim.optim_manager import grad_norm

        params = [p for p in model.parameters() if p.grad is not None]
        norm = grad_norm(params)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm=1.0, total_norm=norm)
    """
    eng = engine()
    ctx = eng.ctx
    params = list(params)
    # A gradient an offload optimizer took over during backward counts as if it were still .grad: its 2-norm was
    # taken where it was, the same way; other norms read it in host memory.
    handed = {id(p): handed_grad(p) for p in params if p.grad is None}
    with_grad = [p for p in params if p.grad is not None or handed.get(id(p)) is not None]
    sharded = [p for p in with_grad if eng.registry.is_sharded(p)]
    replicated = [p for p in with_grad if not eng.registry.is_sharded(p)]
    norm_type = float(norm_type)

    def grad_of(p: torch.Tensor) -> torch.Tensor:
        if p.grad is not None:
            return p.grad.detach()
        handed[id(p)].host_ready()
        return handed[id(p)].host

    if math.isinf(norm_type):
        local = torch.zeros((), dtype=torch.float32, device=ctx.device)
        for p in sharded:
            if p.numel():
                local = torch.maximum(local, grad_of(p).abs().max().float().to(ctx.device))
        if ctx.shard_size > 1 or ctx.tp_size > 1 or ctx.pipe_size > 1:  # one shard group holds every piece once
            # (see [Note: hybrid sharding]); the tensor-parallel group's hold different slices (see [Note: tensor
            # parallelism]), the pipeline stages different layers (see [Note: pipeline layout])
            single = ctx.tp_size == 1 and ctx.pipe_size == 1
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=ctx.shard_group if single else ctx.group)
        for p in replicated:
            if p.numel():
                local = torch.maximum(local, grad_of(p).abs().max().float().to(ctx.device))
        return local

    def power_sum(members: List[torch.Tensor]) -> torch.Tensor:
        acc = torch.zeros((), dtype=torch.float32, device=ctx.device)
        for p in members:
            taken = handed.get(id(p))
            if taken is not None and norm_type == 2.0:
                taken.ready()
                acc += taken.norm.to(ctx.device) ** norm_type
            else:
                acc += norm_term(grad_of(p), norm_type).to(ctx.device)
        return acc

    def one_stage(p: torch.Tensor) -> bool:  # a pipeline stage's layer: the other stages hold other layers
        return eng.registry.buffer_of(ctx, p)[0].one_stage

    split_ids = {id(p) for p in sharded if eng.registry.slot_of(ctx, p)[1].tp_split_dim is not None}
    split = [p for p in sharded if id(p) in split_ids]
    whole = [p for p in sharded if id(p) not in split_ids]
    local = power_sum([p for p in whole if not one_stage(p)])
    if ctx.shard_size > 1:  # over one shard group: the replicas' pieces are the same ones again
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=ctx.shard_group)
    if ctx.pipe_size > 1:  # a stage's own layers: over its shard group, then over the stages (whose layers differ)
        staged = power_sum([p for p in whole if one_stage(p)])
        if ctx.shard_size > 1:
            dist.all_reduce(staged, op=dist.ReduceOp.SUM, group=ctx.shard_group)
        dist.all_reduce(staged, op=dist.ReduceOp.SUM, group=ctx.replica_group)
        local = local + staged
    if split:  # slices split by tensor parallelism: every rank holds different pieces, every stage the same
        # ones again but of its own layers (counted pipe_size times here, as the others are)
        split_sum = sum(power_sum([p for p in split if one_stage(p) == own]) * (ctx.pipe_size if own else 1)
                        for own in (False, True))
        dist.all_reduce(split_sum, op=dist.ReduceOp.SUM, group=ctx.group)
        local = local + split_sum / ctx.pipe_size
    return (local + power_sum(replicated)) ** (1.0 / norm_type)


@torch.no_grad()
def clip_grads_with_norm(params: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor,
                         optimizers: Iterable[torch.optim.Optimizer] = ()) -> None:
    """Scale the gradients of ``params`` by ``min(1, max_norm / (total_norm + 1e-6))``, as
    ``torch.nn.utils.clip_grads_with_norm_`` does: the coefficient computed the same way, ``.grad``
    multiplied in place; so are those an offload optimizer among ``optimizers`` took off ``.grad`` during
    backward, where it keeps them (``scale_handed_gradients``).
    """
    params = list(params)
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    for optimizer in optimizers:
        if hasattr(optimizer, "scale_handed_gradients"):
            optimizer.scale_handed_gradients(coef)
