"""AdamOptimizer: Adam(W) with its state on the parameters' device (see [Note: mixed precision] in
``adam_state.py``)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Tuple

import torch

from .adam_state import _AdamBase, _update_in_place

__all__ = ["AdamOptimizer"]


class AdamOptimizer(_AdamBase):
    """Adam(W) on the parameters' device with an fp32 master (see [Note: mixed precision]).

    On CUDA one fused kernel reads the gradient (fp32/bf16/fp16), updates master and moments and
    writes the rounded parameter; on the CPU the vectorised CPU kernel does the same.

    Args:
        params: parameters (or groups) of a wrapped model.
        lr: learning rate, as ``torch.optim.AdamW``.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: weight decay coefficient.
        decoupled: weight decay as AdamW (default) or as L2 added to the gradient (Adam).
        master_dtype: must be ``torch.float32``; any other raises ``TypeError``.
        hold_steps: the first ``hold_steps`` steps update the moments but not the parameters
            (learning rate 0), as BMTrain's argument does; what is left of it is saved with the
            optimizer's state.
        nonfinite: what a step does when a gradient holds an inf or a NaN on any rank (see
            [Note: non-finite gradients] in ``bmtwrap/optim/nonfinite.py``): ``"raise"``
            (default) :class:`~bmtwrap.optim.NonFiniteGradientError`, ``"skip"`` the step
            (counted in ``skipped_steps``), or ``"unchecked"``.

    Raises:
        ValueError: bad hyper-parameters; parameters on several devices or on meta; parameters
            that are not a wrapped model's when one is in use.
        TypeError: a master dtype other than fp32.

    Example::

        optimizer = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-4, weight_decay=0.1)
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, decoupled: bool = True,
                 master_dtype: torch.dtype = torch.float32, hold_steps: int = 0, nonfinite: str = "raise") -> None:
        super().__init__(params, lr, betas, eps, weight_decay, decoupled, master_dtype, "AdamOptimizer", hold_steps,
                         nonfinite)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_scale: float = 1.0,
             assume_finite: bool = False) -> Any:
        """One update; gradients are multiplied by ``grad_scale`` as they are read.

        Args:
            closure: re-evaluates the model and returns the loss, as for any torch optimizer.
            grad_scale: gradients are multiplied by it as they are read.
            assume_finite: skip the check for non-finite gradients (the caller made it).

        Raises:
            NonFiniteGradientError: a gradient holds an inf or a NaN (``nonfinite="raise"``).
        """
        loss, work = self._prepare(closure, grad_scale, assume_finite)
        if work is None:
            return loss
        for p, state, hyper in work:
            _update_in_place(p, state, hyper)
        self._end_step()
        return loss
