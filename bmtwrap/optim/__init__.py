"""Optimizers and the optimizer manager."""

from .optim_manager import OptimManager

__all__ = ["OptimManager"]
