"""adam_step_cpu: one Adam(W) step on CPU tensors (csrc/cpu/adam.cpp), and the Adam math both devices share.

The Adam math has one plain-PyTorch reference, :func:`_adam_reference`, and one check of the
hyper-parameters, :func:`_check_adam_hyper`; ``adam_cuda.py`` and the offload queue (``offload.py``) use
them too.
"""

from __future__ import annotations

import math
import numbers
from types import ModuleType
from typing import NamedTuple

import torch

from . import _ext

_ADAM_STATE_NAMES: tuple[str, ...] = ("param", "exp_avg", "exp_avg_sq")
_ADAM_COPY_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)


class _AdamHyper(NamedTuple):
    """The hyper-parameters of one step, checked (see _check_adam_hyper)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int
    grad_scale: float
    decoupled: bool


def adam_step_cpu(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    decoupled: bool = True,
    out: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """One AdamW (or Adam) step on CPU tensors, in place, in a single pass over memory.

    Computes what ``torch.optim.AdamW`` (``decoupled=True``) or ``torch.optim.Adam`` with ``weight_decay``
    (``decoupled=False``) computes for one parameter, in fp32 and in the same order of operations. AdamW's
    moments come out bit for bit equal; a parameter now and then differs in its last bit, because torch takes
    sqrt from MKL, which is not always correctly rounded (ours is). The results do not depend on the number of
    threads nor on the instruction set used. The kernel reads each element of the four buffers
    once and writes param, exp_avg, exp_avg_sq (and ``out``) once, vectorised with AVX-512 or AVX2 where the CPU
    has them, on ``torch.get_num_threads()`` threads, without the GIL.

    Per element, with ``t = step`` and ``g = grad * grad_scale``::

        p = p * (1 - lr * weight_decay)          # decoupled=True (AdamW)
        g = g + weight_decay * p                 # decoupled=False (Adam, L2 penalty)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)
        out = p rounded to nearest even in out.dtype

    Args:
        param: the fp32 master weights, updated in place.
        grad: the gradient: float32, float16 or bfloat16, read only.
        exp_avg, exp_avg_sq: the fp32 first and second moments, updated in place (zeros before step 1).
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``; finite, lr, eps and weight_decay
            >= 0, betas in [0, 1).
        step: the number of this step, counting from 1 (sets the bias corrections).
        grad_scale: multiplies the gradient as it is read, e.g. ``1 / loss_scale``; finite and > 0. Default 1.
        decoupled: True (default) for AdamW's decoupled weight decay, False for Adam's L2 penalty.
        out: optional float16 or bfloat16 tensor, written with the updated parameters (the copy that goes
            to the GPU). Default None.
        num_threads: threads to run on; default None: ``torch.get_num_threads()``, which honours the
            user's ``torch.set_num_threads()``.

    All tensors must be contiguous CPU tensors with the same number of elements and no shared memory.

    Raises:
        TypeError: a tensor argument is not a tensor or has the wrong dtype (the master copy, param, and the
            moments must be float32); a hyper-parameter is not a number (step: not an int; decoupled: not a
            bool).
        ValueError: a tensor is not on the CPU, not contiguous, of another size than param, or shares memory
            with another; a hyper-parameter is out of range or not finite.
        NotImplementedError: a tensor is sparse, or on a device other than cpu and cuda.

    Example::

        >>> master = torch.randn(1000)                   # fp32 master weights, e.g. in pinned memory
        >>> m, v = torch.zeros_like(master), torch.zeros_like(master)
        >>> grad = torch.randn(1000, dtype=torch.bfloat16)
        >>> weights = torch.empty(1000, dtype=torch.bfloat16)
        >>> ops.adam_step_cpu(master, grad, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
        ...                   weight_decay=0.1, step=1, out=weights)
    """
    hyper = _check_adam_hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale, decoupled)
    _check_adam_tensors(param, grad, exp_avg, exp_avg_sq, out)
    if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
        raise ValueError(f"num_threads must be a positive int or None, got {num_threads!r}")
    if param.numel() == 0:
        return
    ext = _ext.extension_for(param.device)
    if ext is None:
        _adam_reference(param, grad, exp_avg, exp_avg_sq, **hyper._asdict(), out=out)
        return
    threads = torch.get_num_threads() if num_threads is None else num_threads
    _adam_cpu(ext, param, grad, exp_avg, exp_avg_sq, hyper, out, threads, ext.CpuIsa.best)


def _adam_step_cpu_with(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    decoupled: bool = True,
    out: torch.Tensor | None = None,
    num_threads: int,
    isa: str,
) -> None:
    """adam_step_cpu on exactly ``num_threads`` threads (0: all cores) with the kernels compiled for ``isa``
    (a name from ``_ext.cpu_isas()``, or "best"), for tests and benchmarks. Needs the extension."""
    hyper = _check_adam_hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale, decoupled)
    _check_adam_tensors(param, grad, exp_avg, exp_avg_sq, out)
    ext = _ext.require_extension()
    if param.numel() > 0:
        _adam_cpu(ext, param, grad, exp_avg, exp_avg_sq, hyper, out, num_threads, getattr(ext.CpuIsa, isa))



def _adam_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    decoupled: bool = True,
    out: torch.Tensor | None = None,
) -> None:
    """Plain-PyTorch adam_step_cpu: the operations of torch.optim.AdamW's (or Adam's) single-tensor step, in
    its order (see [Note: matching torch bit for bit] in csrc/cpu/adam.cpp)."""
    with torch.no_grad():
        g = grad.float() * grad_scale  # a new tensor: grad itself is never written
        if weight_decay != 0:
            if decoupled:
                param.mul_(1 - lr * weight_decay)
            else:
                g = g.add(param, alpha=weight_decay)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
        if out is not None:
            out.copy_(param)


def _adam_cpu(
    ext: ModuleType,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: _AdamHyper,
    out: torch.Tensor | None,
    num_threads: int,
    isa: object,
) -> None:
    ext.adam_cpu(
        param.data_ptr(), grad.data_ptr(), _ext.dtype_code(ext, grad.dtype), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        param.numel(), hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, hyper.step,
        hyper.grad_scale, hyper.decoupled, 0 if out is None else out.data_ptr(),
        _ext.dtype_code(ext, torch.float32 if out is None else out.dtype), num_threads, isa,
    )
    # The kernel wrote through raw pointers; tell autograd, as an in-place torch op would have.
    written = [param, exp_avg, exp_avg_sq] + ([] if out is None else [out])
    torch.autograd.graph.increment_version(written)


def _check_adam_tensors(
    param: object, grad: object, exp_avg: object, exp_avg_sq: object, out: object
) -> None:
    tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if out is not None:
        tensors["out"] = out
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        _ext.check_layout_and_device(name, tensor)
        if tensor.device.type != "cpu":
            raise ValueError(f"{name} is on {tensor.device}; adam_step_cpu updates CPU tensors only")
    for name in _ADAM_STATE_NAMES:
        dtype = tensors[name].dtype
        if dtype != torch.float32:
            role = "the master copy of the weights" if name == "param" else "optimizer state"
            raise TypeError(
                f"{name} has dtype {dtype}; {name} is {role} and must be torch.float32 "
                "(keep an fp32 master and pass the low-precision weights as out=)"
            )
    if grad.dtype not in _ext.FLOAT_DTYPES:
        raise TypeError(f"grad has dtype {grad.dtype}; expected one of {_ext.dtype_names(_ext.FLOAT_DTYPES)}")
    if out is not None and out.dtype not in _ADAM_COPY_DTYPES:
        raise TypeError(
            f"out has dtype {out.dtype}; expected one of {_ext.dtype_names(_ADAM_COPY_DTYPES)} "
            "(out is the low-precision copy; param itself is updated in place)"
        )
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(f"{name} is not contiguous; call .contiguous() first")
        if tensor.numel() != param.numel():
            raise ValueError(f"{name} has {tensor.numel()} elements but param has {param.numel()}; expected the same")
        if tensor.data_ptr() % tensor.element_size() != 0:
            raise ValueError(f"{name} is not aligned to its {tensor.element_size()}-byte elements; clone it first")
    _ext.check_no_shared_memory(tensors)


def _check_adam_hyper(
    lr: object, beta1: object, beta2: object, eps: object, weight_decay: object, step: object,
    grad_scale: object, decoupled: object,
) -> _AdamHyper:
    ranges = {  # name: (value, low, high, whether high is excluded, what to say)
        "lr": (lr, 0.0, math.inf, False, ">= 0"),
        "beta1": (beta1, 0.0, 1.0, True, "in [0, 1)"),
        "beta2": (beta2, 0.0, 1.0, True, "in [0, 1)"),
        "eps": (eps, 0.0, math.inf, False, ">= 0"),
        "weight_decay": (weight_decay, 0.0, math.inf, False, ">= 0"),
    }
    for name, (value, low, high, open_high, expected) in ranges.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
        if not (math.isfinite(value) and low <= value and (value < high if open_high else value <= high)):
            raise ValueError(f"{name} must be finite and {expected}, got {value!r}")
    if isinstance(grad_scale, bool) or not isinstance(grad_scale, numbers.Real):
        raise TypeError(f"grad_scale must be a real number, got {type(grad_scale).__name__}")
    if not (math.isfinite(grad_scale) and grad_scale > 0):
        raise ValueError(f"grad_scale must be finite and > 0, got {grad_scale!r}")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (the first step is 1), got {step}")
    if not isinstance(decoupled, bool):
        raise TypeError(f"decoupled must be a bool, got {type(decoupled).__name__}")
    return _AdamHyper(
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), int(step), float(grad_scale), decoupled
    )
