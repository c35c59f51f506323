"""Optimizers and the optimizer manager."""

from .adam import AdamOffloadOptimizer, AdamOptimizer
from .nonfinite import NonFiniteGradientError
from .optim_manager import OptimManager

__all__ = ["AdamOffloadOptimizer", "AdamOptimizer", "NonFiniteGradientError", "OptimManager"]
