"""Optimizers and the optimizer manager."""

from .adam import AdamOffloadOptimizer, AdamOptimizer
from .optim_manager import OptimManager

__all__ = ["AdamOffloadOptimizer", "AdamOptimizer", "OptimManager"]
