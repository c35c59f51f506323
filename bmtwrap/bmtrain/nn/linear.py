"""BMTrain's ``bmt.nn.Linear``: a linear layer whose weight and bias are sharded parameters."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..module import DistributedModule
from ...engine.param import DistributedParameter

__all__ = ["Linear", "OpLinear"]


class OpLinear(torch.autograd.Function):
    """``y = x Wᵀ + b`` (``F.linear``) whose backward computes only the gradients that are needed.

    It saves the input and the weight, nothing else, and returns ``None`` for every input that
    does not require a gradient (BMTrain's ``OpLinear``).

    Example::

        y = bmt.nn.OpLinear.apply(x, weight, bias)
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``; saves ``x`` and ``weight`` for backward."""
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        """The gradients of ``x``, ``weight`` and ``bias`` that autograd asks for (``None`` for the others)."""
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        rows = grad_out.reshape(-1, grad_out.shape[-1])  # (N, out): every leading dimension flattened
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.matmul(weight)  # (..., in)
        if ctx.needs_input_grad[1]:
            grad_weight = rows.t().matmul(x.reshape(-1, x.shape[-1]))  # (out, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)  # (out,)
        return grad_x, grad_weight, grad_bias


class Linear(DistributedModule):
    """A linear layer with sharded parameters (BMTrain's ``bmt.nn.Linear``).

    ``weight`` (``(out_features, in_features)``) and ``bias`` (``(out_features,)``) are
    :class:`~bmtwrap.DistributedParameter` objects: each rank keeps its piece, and the layer is
    gathered around its forward (or by the :class:`~bmtwrap.Block` that runs it). They hold zeros
    until :func:`bmtwrap.init_parameters` draws them: Xavier-normal for the weight, zeros for the
    bias, as in BMTrain.

    Args:
        in_features: size of each input's last dimension.
        out_features: size of each output's last dimension.
        bias: add a learned bias.
        dtype: the parameters' dtype; default: torch's default dtype.

    Example::

        layer = bmt.nn.Linear(1024, 4096, dtype=torch.bfloat16)
        bmt.init_parameters(layer)
        y = layer(x)   # x: (..., 1024) -> y: (..., 4096)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # Built from meta tensors: no full-size host copy, and zeros (not garbage) until initialised.
        self.weight = DistributedParameter(torch.empty(out_features, in_features, dtype=dtype, device="meta"),
                                           init_method=torch.nn.init.xavier_normal_)
        if bias:
            self.bias = DistributedParameter(torch.empty(out_features, dtype=dtype, device="meta"),
                                             init_method=torch.nn.init.zeros_)
        else:
            self.register_parameter("bias", None)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input Wᵀ + b`` over the last dimension of ``input``."""
        return OpLinear.apply(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        """``in_features``, ``out_features`` and whether there is a bias, for ``repr``."""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
