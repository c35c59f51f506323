"""A gradient an offload optimizer took off ``.grad`` during backward, and how readers of gradients find it.

An offload optimizer that starts its updates in backward (``step_in_backward`` other than ``False``) copies each
final gradient shard of the state it updates on the CPU to host memory and sets ``.grad`` to ``None``, so that its
GPU memory is free at once (see ``overlap.py``). Whoever reads the gradients across a step asks for what it took:
the global norm (``optim_manager.grad_norm``), the inf/nan check (``nonfinite.any_nonfinite``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..engine.dist import is_initialized
from ..engine.schedule import engine

__all__ = ["HandedGrad", "handed_grad", "norm_term"]


def norm_term(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """One gradient's contribution to a global p-norm, as ``grad_norm`` sums it: ``norm(grad) ** p`` in fp32."""
    return grad.detach().float().norm(norm_type) ** norm_type


@dataclass
class HandedGrad:
    """A final gradient shard moved off its parameter during backward.

    Attributes:
        host: the gradient, in host memory.
        norm: its 2-norm in fp32, computed where the gradient was (``grad.float().norm(2)``).
        nonfinite: a uint8 flag where the gradient was, set if it (or another handed over with it) holds inf/nan.
        stream: the CUDA stream after whose current work ``host``, ``norm`` and ``nonfinite`` are final; ``None``
            on the CPU.
    """

    host: torch.Tensor
    norm: torch.Tensor
    nonfinite: torch.Tensor
    stream: Optional["torch.cuda.Stream"]

    def ready(self) -> None:
        """Order the current stream's later work after the copy, the norm and the flag (which the current stream
        may then read: their memory is not reused before it has)."""
        if self.stream is not None:
            current = torch.cuda.current_stream(self.stream.device)
            current.wait_stream(self.stream)
            self.norm.record_stream(current)
            self.nonfinite.record_stream(current)

    def host_ready(self) -> None:
        """Wait until ``host`` holds the gradient (for a read on the CPU)."""
        if self.stream is not None:
            self.stream.synchronize()


def handed_grad(param: torch.Tensor) -> Optional[HandedGrad]:
    """The gradient an offload optimizer took off ``param`` during this step's backward, if one did."""
    if not is_initialized():
        return None
    for holder in engine().offload_optimizers():
        handed = holder.handed(param)
        if handed is not None:
            return handed
    return None
