"""Optimizers and the optimizer manager."""

from .adam import AdamOptimizer
from .adam_offload import AdamOffloadOptimizer
from .choice import auto_adam
from .nonfinite import NonFiniteGradientError
from .optim_manager import OptimManager

__all__ = ["AdamOffloadOptimizer", "AdamOptimizer", "auto_adam", "NonFiniteGradientError", "OptimManager"]
