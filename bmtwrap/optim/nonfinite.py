"""Non-finite gradients: found before a step, agreed on by every rank, never written into the weights.

[Note: non-finite gradients]
A loss that overflows (bf16, fp16 without a loss scale) or turns NaN gives non-finite gradients,
and one Adam step with them turns the weights to NaN for good. So a step first asks whether any
gradient it will read holds an inf or a NaN: one flag per device set by the ``has_inf_nan`` kernel
over every gradient, one all-reduce (MAX) so that every rank decides the same (a NaN may sit in
one rank's shard only), one host synchronisation (:func:`start_check` makes the flag,
:meth:`PendingCheck.found` reads it). Then, by the ``nonfinite`` option:

- ``"raise"`` (default): :class:`NonFiniteGradientError`, naming parameters whose gradient is not
  finite; nothing is updated, the step count does not advance.
- ``"skip"``: the step is skipped (parameters, moments and step count unchanged) and counted.
- ``"unchecked"``: no check (a step's worth of time, for whoever checks elsewhere).

:class:`~bmtwrap.optim.OptimManager` checks once for all its optimizers (with a loss scale, an
overflow lowers the scale and skips the step instead) and tells them not to check again.

[Note: updates before the check]
Reading the flag waits for the end of backward. The updates of the state kept on the GPU are launched
*before* that read, each kernel gated on the flag (``skip_if``: a kernel that finds it set writes
nothing), and the host reads a pinned copy of the flag made before those launches, so that the read
waits for backward and the check only, and the GPU goes from the check straight to the updates
without waiting for the host to launch them. A step found non-finite puts back the step counts it
had advanced; nothing was written. The CPU's updates are queued after the read, as before. Measured
at 1B on one H200 (``benchmarks/RESULTS.md``), the gain is within the step's noise: there the host
launched the updates about as fast as the GPU ran them.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

from .. import ops
from ..engine.dist import is_initialized
from ..engine.group import ROOT_LABEL
from ..engine.schedule import engine
from .handed import HandedGrad, handed_grad

__all__ = ["NONFINITE_CHOICES", "NonFiniteGradientError", "PendingCheck", "any_nonfinite", "check_choice",
           "describe_nonfinite", "start_check"]

NONFINITE_CHOICES = ("raise", "skip", "unchecked")


class NonFiniteGradientError(FloatingPointError):
    """A step found an inf or a NaN in the gradients it was to apply; nothing was updated."""


def check_choice(nonfinite: str, who: str) -> None:
    """Refuse an unknown ``nonfinite`` option."""
    if nonfinite not in NONFINITE_CHOICES:
        raise ValueError(f"{who}: nonfinite must be one of {', '.join(map(repr, NONFINITE_CHOICES))}, got {nonfinite!r}")


def _grads(params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None and p.grad.numel() > 0]


def _to_check(grads: List[torch.Tensor]) -> List[torch.Tensor]:
    """The tensors whose check covers ``grads``: a block's flat gradient once, where ``grads`` hold every view of it
    (``FlatBuffer.accumulate_grad`` gives each trainable parameter one; the rest of it, padding, is zeros), so
    that one kernel checks the block; each gradient on its own otherwise. A check per gradient costs a launch: 146
    of them took 1.5 ms of a 1B step on an H200, against 0.9 ms of kernel time."""
    out: List[torch.Tensor] = []
    by_flat: Dict[int, List[torch.Tensor]] = {}
    for grad in grads:
        flat = getattr(grad, "_bmtwrap_flat_grad", None)
        if flat is None:
            out.append(grad)
        else:
            by_flat.setdefault(id(flat), []).append(grad)
    for views in by_flat.values():
        flat = views[0]._bmtwrap_flat_grad
        start, end = flat.data_ptr(), flat.data_ptr() + flat.nbytes
        whole = (getattr(flat, "_bmtwrap_whole_views", None) == len({id(v) for v in views})
                 and all(start <= v.data_ptr() < end for v in views))  # none given other data since
        out.extend([flat] if whole else views)
    return out


def _handed(params: Iterable[torch.Tensor]) -> List[HandedGrad]:
    """What offload optimizers took off the ``.grad`` of ``params`` during this step's backward."""
    handed = (handed_grad(p) for p in params if p.grad is None)
    return [h for h in handed if h is not None]


class PendingCheck:
    """The agreed answer of :func:`start_check`, read by the host when it needs it (see [Note: updates before
    the check]): ``flag`` (one ``uint8`` on the device, nonzero for a non-finite gradient) is what kernels
    launched meanwhile read as ``skip_if``."""

    __slots__ = ("flag", "_host", "_copied")

    def __init__(self, flag: torch.Tensor) -> None:
        self.flag = flag
        self._host: Optional[torch.Tensor] = None
        self._copied: Optional["torch.cuda.Event"] = None
        if flag.is_cuda:  # a copy ordered before whatever the stream runs next, so that reading waits for no more
            self._host = torch.empty(1, dtype=torch.uint8, pin_memory=True)
            self._host.copy_(flag, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    @property
    def on_gpu(self) -> bool:
        return self.flag.is_cuda

    def found(self) -> bool:
        """Whether any rank's gradients hold an inf or a NaN: the one host synchronisation."""
        if self._copied is None:
            return bool(self.flag.item())
        self._copied.synchronize()
        return bool(self._host[0])


def start_check(params: Iterable[torch.Tensor]) -> PendingCheck:
    """Check whether any rank's gradient of ``params`` holds an inf or a NaN (a collective once distributed),
    without waiting for the answer.

    Every rank must call it with the parameters of the same optimizers; a rank without gradients
    still takes part in the agreement. Gradients an offload optimizer took over during backward
    (``.grad`` is ``None`` then) count through the flag it set as it took them.
    """
    params = list(params)
    grads = _grads(params)
    device = engine().ctx.device if is_initialized() else (grads[0].device if grads else torch.device("cpu"))
    flags: Dict[torch.device, torch.Tensor] = {device: torch.zeros(1, dtype=torch.uint8, device=device)}
    for grad in _to_check(grads):
        # Gradients of parameters offloaded to the CPU are checked there.
        if grad.device not in flags:
            flags[grad.device] = torch.zeros(1, dtype=torch.uint8, device=grad.device)
        ops.has_inf_nan_into(grad.detach().contiguous(), flags[grad.device])
    flag = flags.pop(device)
    for other in flags.values():
        flag = torch.maximum(flag, other.to(device))
    handed_flags = {id(h.nonfinite): h for h in _handed(params)}
    for handed in handed_flags.values():
        handed.ready()
        flag = torch.maximum(flag, handed.nonfinite.to(device))
    if is_initialized() and engine().ctx.world_size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=engine().ctx.group)
    return PendingCheck(flag)


def any_nonfinite(params: Iterable[torch.Tensor]) -> bool:
    """Whether any rank's gradient of ``params`` holds an inf or a NaN: :func:`start_check`, waited for."""
    return start_check(params).found()


def _name(index: int, param: torch.Tensor) -> str:
    found = engine().registry.lookup(param) if is_initialized() else None
    if found is None:
        return f"parameter {index}"
    buffer, slot = found[0], found[0].slots[found[1]]
    # A block's label is its place in the model (wrap) or its name (Block): with the slot, the full key.
    return f"'{slot.name}'" if buffer.label.startswith(ROOT_LABEL) else f"'{buffer.label}.{slot.name}'"


def _finite_grad(param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient (on it, or taken over by an offload optimizer) is finite; True without one."""
    if param.grad is not None:
        return bool(torch.isfinite(param.grad).all())
    handed = handed_grad(param)
    if handed is None:
        return True
    handed.host_ready()
    return bool(torch.isfinite(handed.host).all())


def describe_nonfinite(params: Iterable[torch.Tensor], limit: int = 5) -> str:
    """Which of this rank's parameters have a non-finite gradient, for an error message (a slow path)."""
    bad = [_name(i, p) for i, p in enumerate(params) if not _finite_grad(p)]
    if not bad:
        return "another rank's gradients"
    shown = ", ".join(bad[:limit])
    return f"{shown}{f' and {len(bad) - limit} more' if len(bad) > limit else ''}"
