"""The converter: ``wrap`` any nn.Module (Hugging Face models included), ``plan`` it, ``materialize`` it."""

from .convert import materialize, plan, wrap
from .plan import GroupPlan, MemoryEstimate, WrapPlan

__all__ = ["GroupPlan", "MemoryEstimate", "WrapPlan", "materialize", "plan", "wrap"]
