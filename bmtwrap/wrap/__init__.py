"""The converter: ``wrap`` any nn.Module (Hugging Face models included), ``plan`` it, ``materialize`` it."""

from .adapters import HFAdapter, ModelAdapter, register_adapter
from .convert import plan, wrap
from .materialize import materialize
from .plan import GroupPlan, MemoryEstimate, WrapPlan

__all__ = ["GroupPlan", "HFAdapter", "MemoryEstimate", "ModelAdapter", "WrapPlan", "materialize", "plan",
           "register_adapter", "wrap"]
