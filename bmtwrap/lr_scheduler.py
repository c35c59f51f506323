"""Learning-rate schedules with linear warmup (BMTrain's classes and formulas).

Every schedule rises linearly from 0 to ``start_lr`` over ``warmup_iter`` iterations, then
decays by its own rule until ``end_iter``. ``step()`` advances one iteration and writes the new
rate into every parameter group of the optimizer.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch

__all__ = ["Cosine", "Exponential", "Linear", "NoDecay", "Noam", "WarmupLRScheduler"]


class WarmupLRScheduler:
    """Base class: linear warmup, then :meth:`get_lr_decay`.

    Args:
        optimizer: whose parameter groups get the rate.
        start_lr: the rate reached at the end of warmup.
        warmup_iter: iterations of warmup (0: none).
        end_iter: the iteration the decay reaches its end (used by Linear and Cosine).
        num_iter: the iteration to start at (e.g. when resuming); the rate for it is applied at once.

    Raises:
        ValueError: a negative rate or iteration count, or ``end_iter < warmup_iter``.

    Example::

        scheduler = bmt.lr_scheduler.Cosine(optimizer, start_lr=3e-4, warmup_iter=100, end_iter=10_000)
        for batch in data:
            ...
            optimizer.step()
            scheduler.step()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, start_lr: float, warmup_iter: int, end_iter: int,
                 num_iter: int = 0) -> None:
        if start_lr < 0:
            raise ValueError(f"start_lr must be >= 0, got {start_lr}")
        if warmup_iter < 0 or num_iter < 0:
            raise ValueError(f"warmup_iter and num_iter must be >= 0, got {warmup_iter} and {num_iter}")
        if end_iter < warmup_iter:
            raise ValueError(f"end_iter ({end_iter}) must not be before the end of warmup ({warmup_iter})")
        self.optimizer = optimizer
        self.start_lr = start_lr
        self.warmup_iter = warmup_iter
        self.end_iter = end_iter
        self.num_iter = num_iter
        self._current_lr: Optional[float] = None
        self.step(num_iter)

    def get_lr_warmup(self, num_iter: int) -> float:
        """The rate at iteration ``num_iter`` of warmup (here a line from 0 to ``start_lr``)."""
        return self.start_lr * num_iter / self.warmup_iter

    def get_lr_decay(self, num_iter: int) -> float:
        """The rate at iteration ``num_iter`` after warmup: each schedule defines its own.

        Raises:
            NotImplementedError: in this base class.
        """
        raise NotImplementedError

    def get_lr(self) -> float:
        """The rate at the current iteration ``num_iter``: warmup's before ``warmup_iter``, then the decay's."""
        if self.num_iter < self.warmup_iter:
            return self.get_lr_warmup(self.num_iter)
        return self.get_lr_decay(self.num_iter)

    @property
    def current_lr(self) -> Optional[float]:
        """The rate the last :meth:`step` applied (the constructor applies the first)."""
        return self._current_lr

    def get_last_lr(self) -> list:
        """The rate of each parameter group (torch's scheduler interface)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self, num_iter: Optional[int] = None) -> None:
        """Advance to ``num_iter`` (default: the next iteration) and apply its rate."""
        self.num_iter = self.num_iter + 1 if num_iter is None else num_iter
        self._current_lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = self._current_lr

    def state_dict(self) -> Dict[str, Any]:
        """What :meth:`load_state_dict` needs to resume: ``start_lr``, ``warmup_iter``, ``end_iter``, ``num_iter``."""
        return {"start_lr": self.start_lr, "warmup_iter": self.warmup_iter, "end_iter": self.end_iter,
                "num_iter": self.num_iter}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned and apply the rate of the restored iteration."""
        self.start_lr = state["start_lr"]
        self.warmup_iter = state["warmup_iter"]
        self.end_iter = state["end_iter"]
        self.step(state["num_iter"])


class NoDecay(WarmupLRScheduler):
    """Warmup, then ``start_lr`` for ever."""

    def get_lr_decay(self, num_iter: int) -> float:
        return self.start_lr


class Noam(WarmupLRScheduler):
    """The Transformer paper's schedule: warmup to ``start_lr / sqrt(warmup_iter)``, then ``start_lr / sqrt(num_iter)``."""

    def get_lr_warmup(self, num_iter: int) -> float:
        """A line from 0 to ``start_lr / sqrt(warmup_iter)`` over warmup."""
        return self.start_lr / math.sqrt(self.warmup_iter) * num_iter / self.warmup_iter

    def get_lr_decay(self, num_iter: int) -> float:
        return self.start_lr / math.sqrt(max(num_iter, 1))


class Linear(WarmupLRScheduler):
    """Warmup, then a straight line from ``start_lr`` to 0 at ``end_iter`` (0 after it)."""

    def get_lr_decay(self, num_iter: int) -> float:
        span = self.end_iter - self.warmup_iter
        if span == 0:
            return 0.0
        return max(0.0, self.start_lr * (self.end_iter - num_iter) / span)


class Cosine(WarmupLRScheduler):
    """Warmup, then half a cosine from ``start_lr`` to 0 at ``end_iter`` (0 after it)."""

    def get_lr_decay(self, num_iter: int) -> float:
        progress = min(1.0, (num_iter - self.warmup_iter) / max(1, self.end_iter - self.warmup_iter))
        return self.start_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


class Exponential(WarmupLRScheduler):
    """Warmup, then ``start_lr * gamma ** (num_iter - warmup_iter)``.

    ``gamma`` is set before the base class applies the first rate, so constructing the schedule
    at an iteration past warmup (resuming) works.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, start_lr: float, warmup_iter: int, end_iter: int,
                 num_iter: int = 0, gamma: float = 0.95) -> None:
        if not 0 < gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        self.gamma = gamma
        super().__init__(optimizer, start_lr, warmup_iter, end_iter, num_iter)

    def get_lr_decay(self, num_iter: int) -> float:
        return self.start_lr * self.gamma ** (num_iter - self.warmup_iter)

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "gamma": self.gamma}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.gamma = state.get("gamma", self.gamma)
        super().load_state_dict(state)
