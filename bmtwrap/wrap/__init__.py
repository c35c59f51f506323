"""The converter: ``wrap`` any nn.Module (Hugging Face models included), ``plan`` it, ``materialize`` it."""

from .adapters import HFAdapter, ModelAdapter, register_adapter
from .convert import plan, wrap
from .fp8 import Float8
from .materialize import materialize
from .plan import GroupPlan, MemoryEstimate, WrapPlan

__all__ = ["Float8", "GroupPlan", "HFAdapter", "MemoryEstimate", "ModelAdapter", "WrapPlan", "materialize", "plan",
           "register_adapter", "wrap"]
