"""Checked entry points to the compiled kernels of ``bmtwrap._C``, each with a plain-PyTorch fallback.

This is the only module that imports ``bmtwrap._C``. The extension does not link against torch, so tensors
reach it as raw data pointers, element counts and dtype codes (see [Note: tensors crossing into C++] in
``csrc/common.h``); every public function here therefore checks type, dtype, layout, device and contiguity
before a pointer leaves Python.

Every op ``<op>`` has a ``_<op>_reference`` written in plain PyTorch. It is what runs when the extension is
missing (or was built without CUDA and the tensor is on a GPU), with one warning per process, and it is
what ``tests/test_ops.py`` compares the kernels against.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import NamedTuple

import torch

_C: ModuleType | None
_C_IMPORT_ERROR: ImportError | None = None
try:
    from . import _C
except ImportError as error:  # never built, or built for another Python
    _C = None
    _C_IMPORT_ERROR = error

_BUILD_COMMAND = "pip install --no-build-isolation -e ."
_FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
_DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda")
_GET_RAW_STREAM: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def extension_available(*, cuda: bool = False) -> bool:
    """Whether the compiled kernels of ``bmtwrap._C`` are in use.

    Args:
        cuda: if True, also require the CUDA kernels to be compiled in (whether a GPU is present is
            ``torch.cuda.is_available()``'s question, not this one's). Default False: the CPU kernels.

    Returns:
        False if ``bmtwrap._C`` cannot be imported; the ops then fall back to plain PyTorch.

    Example::

        >>> from bmtwrap import ops
        >>> ops.extension_available()
        True
    """
    if _C is None:
        return False
    return bool(_C.has_cuda()) if cuda else True


def has_inf_nan(tensor: torch.Tensor) -> bool:
    """Whether any element of ``tensor`` is ``+inf``, ``-inf`` or ``nan``.

    Reads the bit patterns directly (an element is non-finite exactly when all its exponent bits are set),
    on several threads for large CPU tensors, stopping early once one is found. For a CUDA tensor the check
    runs on the current stream and the answer is copied to the host, which synchronises; use
    :func:`has_inf_nan_into` to check many tensors with one synchronisation at the end.

    Args:
        tensor: a contiguous float32, float16 or bfloat16 tensor on the CPU or a CUDA device. An empty
            tensor has no inf or nan.

    Returns:
        True if at least one element is inf or nan.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor`` or has another dtype.
        ValueError: ``tensor`` is not contiguous.
        NotImplementedError: ``tensor`` is sparse, or on a device other than cpu and cuda.

    Example::

        >>> ops.has_inf_nan(torch.tensor([1.0, float("inf")], dtype=torch.bfloat16))
        True
    """
    _check_float_tensor("tensor", tensor)
    if tensor.numel() == 0:
        return False
    ext = _extension_for(tensor.device)
    if ext is None:
        return bool(_has_inf_nan_reference(tensor))
    if tensor.device.type == "cpu":
        return _has_inf_nan_cpu(ext, tensor)
    flag = torch.zeros(1, dtype=torch.uint8, device=tensor.device)
    _has_inf_nan_cuda(ext, tensor, flag)
    return bool(flag.item())


def has_inf_nan_into(tensor: torch.Tensor, flag: torch.Tensor) -> None:
    """Set ``flag`` to 1 if any element of ``tensor`` is ``+inf``, ``-inf`` or ``nan``; never set it to 0.

    The caller zeroes ``flag`` once and calls this for many tensors; ``flag`` then says whether any of them
    had an inf or nan. On CUDA nothing synchronises: the check is enqueued on the current stream of
    ``tensor``'s device, so read ``flag`` (``flag.item()``) once, after the last call.

    Args:
        tensor: a contiguous float32, float16 or bfloat16 tensor on the CPU or a CUDA device.
        flag: a one-element ``torch.uint8`` tensor on the same device as ``tensor``, e.g.
            ``torch.zeros(1, dtype=torch.uint8, device=tensor.device)``.

    Raises:
        TypeError: ``tensor`` or ``flag`` is not a ``torch.Tensor`` or has the wrong dtype.
        ValueError: ``tensor`` is not contiguous, ``flag`` does not have exactly one element, or the two are
            on different devices.
        NotImplementedError: a tensor is sparse, or on a device other than cpu and cuda.

    Example::

        >>> found = torch.zeros(1, dtype=torch.uint8, device="cuda")
        >>> for p in model.parameters():
        ...     ops.has_inf_nan_into(p.grad, found)
        >>> skip_step = bool(found.item())  # the only synchronisation
    """
    _check_float_tensor("tensor", tensor)
    _check_flag(flag, tensor.device)
    if tensor.numel() == 0:
        return
    ext = _extension_for(tensor.device)
    if ext is None:
        flag.masked_fill_(_has_inf_nan_reference(tensor), 1)
    elif tensor.device.type == "cpu":
        if _has_inf_nan_cpu(ext, tensor):
            flag.fill_(1)
    else:
        _has_inf_nan_cuda(ext, tensor, flag)


def _has_inf_nan_reference(tensor: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch has_inf_nan: a 0-dim bool tensor on ``tensor``'s device (no synchronisation)."""
    return ~torch.isfinite(tensor).all()


def _has_inf_nan_cpu(ext: ModuleType, tensor: torch.Tensor) -> bool:
    # torch.get_num_threads() so that the kernel honours the user's torch.set_num_threads().
    return bool(
        ext.has_inf_nan(tensor.data_ptr(), tensor.numel(), _dtype_code(ext, tensor.dtype), torch.get_num_threads())
    )


def _has_inf_nan_cuda(ext: ModuleType, tensor: torch.Tensor, flag: torch.Tensor) -> None:
    # The kernel launches on the current device, which must own the stream and both buffers.
    index = tensor.device.index
    if index == torch.cuda.current_device():
        _launch_has_inf_nan_cuda(ext, tensor, flag, index)
    else:
        with torch.cuda.device(index):
            _launch_has_inf_nan_cuda(ext, tensor, flag, index)


def _launch_has_inf_nan_cuda(ext: ModuleType, tensor: torch.Tensor, flag: torch.Tensor, index: int) -> None:
    code = _dtype_code(ext, tensor.dtype)
    ext.has_inf_nan_cuda(tensor.data_ptr(), tensor.numel(), code, flag.data_ptr(), _current_raw_stream(index))


def _current_raw_stream(index: int) -> int:
    """The cudaStream_t of device ``index``'s current stream, as an integer.

    torch.cuda.current_stream() builds a Stream object (about 6 us, more than the kernel launch); the raw
    getter that torch's own generated kernels use costs 0.2 us. It is private, hence the public fallback.
    """
    if _GET_RAW_STREAM is not None:
        return _GET_RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


def _dtype_code(ext: ModuleType, dtype: torch.dtype) -> object:
    """The ``_C.DType`` member of a dtype already checked to be in _FLOAT_DTYPES (names match torch's)."""
    return getattr(ext.DType, str(dtype).removeprefix("torch."))


def _extension_for(device: torch.device) -> ModuleType | None:
    """The extension if it has kernels for ``device``; otherwise None, after warning once."""
    if _C is None:
        cause = f" ({_C_IMPORT_ERROR})" if _C_IMPORT_ERROR is not None else ""
        _warn_fallback(f"the compiled extension bmtwrap._C is missing{cause}")
        return None
    if device.type == "cuda" and not _C.has_cuda():
        _warn_fallback(
            "the compiled extension bmtwrap._C was built without CUDA kernels "
            "(nvcc was not found at build time, or BMTWRAP_NO_CUDA was set)"
        )
        return None
    return _C


@functools.cache
def _warn_fallback(reason: str) -> None:
    """Warns once per process and reason (functools.cache remembers which reasons were given)."""
    warnings.warn(
        f"{reason}; bmtwrap.ops falls back to slower plain-PyTorch implementations. "
        f"Build it with `{_BUILD_COMMAND}` in the bmtwrap source tree.",
        RuntimeWarning,
        stacklevel=4,  # the caller of the public op: _warn_fallback <- _extension_for <- op <- caller
    )


def _check_float_tensor(name: str, tensor: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {tensor.dtype}; expected one of {_dtype_names(_FLOAT_DTYPES)}")
    _check_layout_and_device(name, tensor)
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is not contiguous; call .contiguous() first")


def _check_flag(flag: object, device: torch.device) -> None:
    if not isinstance(flag, torch.Tensor):
        raise TypeError(f"flag must be a torch.Tensor, got {type(flag).__name__}")
    if flag.dtype != torch.uint8:
        raise TypeError(f"flag has dtype {flag.dtype}; expected torch.uint8")
    _check_layout_and_device("flag", flag)
    if flag.numel() != 1:
        raise ValueError(
            f"flag has {flag.numel()} elements; expected 1, e.g. torch.zeros(1, dtype=torch.uint8, device=...)"
        )
    if flag.device != device:
        raise ValueError(f"flag is on {flag.device} but tensor is on {device}; expected both on the same device")


def _check_layout_and_device(name: str, tensor: torch.Tensor) -> None:
    if tensor.layout != torch.strided:
        raise NotImplementedError(f"{name} has layout {tensor.layout}; bmtwrap.ops supports torch.strided only")
    if tensor.device.type not in _DEVICE_TYPES:
        raise NotImplementedError(f"{name} is on device {tensor.device}; bmtwrap.ops supports cpu and cuda tensors")


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d) for d in dtypes)


# ------------------------------------------------------------------------------------------------ CPU Adam
# adam_step_cpu and what it needs; the kernel is csrc/cpu/adam.cpp.

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
    ext = _extension_for(param.device)
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
    (a name from _cpu_isas(), or "best"), for tests and benchmarks. Needs the extension."""
    hyper = _check_adam_hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale, decoupled)
    _check_adam_tensors(param, grad, exp_avg, exp_avg_sq, out)
    if _C is None:
        raise RuntimeError(f"bmtwrap._C is missing ({_C_IMPORT_ERROR}); build it with `{_BUILD_COMMAND}`")
    if param.numel() > 0:
        _adam_cpu(_C, param, grad, exp_avg, exp_avg_sq, hyper, out, num_threads, getattr(_C.CpuIsa, isa))


def _cpu_isas() -> tuple[str, ...]:
    """Names of the instruction sets this CPU can run the kernels for, "scalar" first; () without _C."""
    return tuple(isa.name for isa in _C.cpu_supported_isas()) if _C is not None else ()


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
        param.data_ptr(), grad.data_ptr(), _dtype_code(ext, grad.dtype), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        param.numel(), hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, hyper.step,
        hyper.grad_scale, hyper.decoupled, 0 if out is None else out.data_ptr(),
        _dtype_code(ext, torch.float32 if out is None else out.dtype), num_threads, isa,
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
        _check_layout_and_device(name, tensor)
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
    if grad.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"grad has dtype {grad.dtype}; expected one of {_dtype_names(_FLOAT_DTYPES)}")
    if out is not None and out.dtype not in _ADAM_COPY_DTYPES:
        raise TypeError(
            f"out has dtype {out.dtype}; expected one of {_dtype_names(_ADAM_COPY_DTYPES)} "
            "(out is the low-precision copy; param itself is updated in place)"
        )
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(f"{name} is not contiguous; call .contiguous() first")
        if tensor.numel() != param.numel():
            raise ValueError(f"{name} has {tensor.numel()} elements but param has {param.numel()}; expected the same")
        if tensor.data_ptr() % tensor.element_size() != 0:
            raise ValueError(f"{name} is not aligned to its {tensor.element_size()}-byte elements; clone it first")
    _check_no_shared_memory(tensors)


def _check_no_shared_memory(tensors: dict[str, torch.Tensor]) -> None:
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name) for name, t in tensors.items() if t.numel()
    )
    for (_, end, name), (start, _, next_name) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{name} and {next_name} share memory; expected a separate buffer for each")


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


# ---------------------------------------------------------------------------- CUDA Adam and cross-entropy
# adam_step_cuda (csrc/cuda/adam.cu), cross_entropy_forward and cross_entropy_backward_
# (csrc/cuda/cross_entropy.cu). The Adam math has one reference, _adam_reference above, shared with
# adam_step_cpu. The cross-entropy ops also take CPU tensors: there is no CPU kernel, so the torch reference
# runs on them by design, without the fallback warning (which means "a kernel you could have is missing").


def adam_step_cuda(
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
    skip_if: torch.Tensor | None = None,
) -> None:
    """One AdamW (or Adam) step on CUDA tensors, in place, in one fused kernel on the current stream.

    Computes what ``torch.optim.AdamW`` (``decoupled=True``) or ``torch.optim.Adam`` with ``weight_decay``
    (``decoupled=False``) computes for one parameter on CUDA, in fp32 and in the same order of operations
    (see :func:`adam_step_cpu` for the formulas); results agree with torch's to within an ulp or two per step.
    The kernel reads each element of the four buffers once and writes param, exp_avg, exp_avg_sq (and
    ``out``) once, in 16-byte vectors wherever the buffers' offsets allow. Nothing synchronises the host.

    Args:
        param: the fp32 master weights, updated in place.
        grad: the gradient: float32, float16 or bfloat16, read only.
        exp_avg, exp_avg_sq: the fp32 first and second moments, updated in place (zeros before step 1).
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``; finite, lr, eps and weight_decay
            >= 0, betas in [0, 1).
        step: the number of this step, counting from 1 (sets the bias corrections).
        grad_scale: multiplies the gradient as it is read, e.g. ``1 / loss_scale``; finite and > 0. Default 1.
        decoupled: True (default) for AdamW's decoupled weight decay, False for Adam's L2 penalty.
        out: optional float16 or bfloat16 tensor, written with the updated parameters rounded to nearest even
            (the compute copy of the weights). Default None.
        skip_if: optional one-element ``torch.uint8`` tensor on the same device. If it holds a nonzero value
            when the kernel runs, the step writes nothing at all: pass the flag that
            :func:`has_inf_nan_into` set on the gradients to skip an overflowed step without a host
            synchronisation. Default None.

    All tensors must be contiguous, on one CUDA device, with the same number of elements and no shared
    memory. Views that start anywhere are fine (the kernel falls back to scalar accesses where needed).

    Raises:
        TypeError: a tensor argument is not a tensor or has the wrong dtype (the master copy must be fp32, and
            so must the moments); a hyper-parameter is not a number (step: not an int; decoupled: not a bool).
        ValueError: a tensor is not on CUDA, not on param's device, not contiguous, of another size than
            param, or shares memory with another; skip_if does not have exactly one element; a
            hyper-parameter is out of range or not finite.
        NotImplementedError: a tensor is sparse, or on a device other than cpu and cuda.

    Example::

        >>> master = torch.randn(1000, device="cuda")           # fp32 master shard
        >>> m, v = torch.zeros_like(master), torch.zeros_like(master)
        >>> grad = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
        >>> weights = torch.empty(1000, device="cuda", dtype=torch.bfloat16)
        >>> found_inf = torch.zeros(1, dtype=torch.uint8, device="cuda")
        >>> ops.has_inf_nan_into(grad, found_inf)
        >>> ops.adam_step_cuda(master, grad, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
        ...                    weight_decay=0.1, step=1, grad_scale=1 / 1024, out=weights, skip_if=found_inf)
    """
    hyper = _check_adam_hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale, decoupled)
    _check_adam_cuda_tensors(param, grad, exp_avg, exp_avg_sq, out, skip_if)
    if param.numel() == 0:
        return
    ext = _extension_for(param.device)
    if ext is None:
        _adam_reference_unless(skip_if, param, grad, exp_avg, exp_avg_sq, hyper, out)
        return
    with _launch_context(param) as stream:
        _launch_adam_cuda(ext, param, grad, exp_avg, exp_avg_sq, hyper, out, skip_if, stream)
    written = [param, exp_avg, exp_avg_sq] + ([] if out is None else [out])
    torch.autograd.graph.increment_version(written)  # raw-pointer writes, as an in-place torch op would count


def cross_entropy_forward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy of ``logits`` against class indices, softmax and NLL fused in one pass.

    Row ``n`` of the result is what ``torch.nn.functional.cross_entropy(logits.float(), targets,
    reduction="none", ignore_index=ignore_index, label_smoothing=label_smoothing)`` gives for it:
    ``(1 - eps) * (lse - x[t]) + eps * (lse - mean(x))`` with ``eps = label_smoothing``, ``t = targets[n]``
    and ``lse = logsumexp(x)``, all in fp32 whatever the logits dtype. Rows whose target is
    ``ignore_index`` get loss 0 (and lse 0) and are not read. A target that is neither ``ignore_index`` nor
    in ``[0, V)`` gives that row a nan loss instead of an error: checking would synchronise the host.

    CUDA tensors run the kernel of ``csrc/cuda/cross_entropy.cu``; CPU tensors run the plain-PyTorch
    reference (there is no CPU kernel), without a warning.

    Args:
        logits: ``(N, V)``, contiguous, float32, float16 or bfloat16, V >= 1.
        targets: ``(N,)`` ``torch.int64`` class indices on the same device.
        ignore_index: targets equal to this are skipped. Default -100, as torch's.
        label_smoothing: ``eps`` in [0, 1]. Default 0.
        out: optional preallocated ``(loss, lse)``, two contiguous ``(N,)`` fp32 tensors on the device of
            ``logits`` (for CUDA graphs, or to reuse memory). Default None: new tensors.

    Returns:
        ``(loss, lse)``: fp32 ``(N,)`` per-row losses and logsumexps; pass ``lse`` to
        :func:`cross_entropy_backward_`. A mean over the counted rows is ``loss.sum() / (targets !=
        ignore_index).sum()``.

    Raises:
        TypeError: logits or targets is not a tensor or has the wrong dtype; ignore_index is not an int;
            label_smoothing is not a number.
        ValueError: logits is not 2-D with V >= 1, targets is not ``(N,)``, a tensor is not contiguous, the
            tensors are on different devices, label_smoothing is outside [0, 1], or ``out`` is malformed.
        NotImplementedError: a tensor is sparse, or on a device other than cpu and cuda.

    Example::

        >>> logits = torch.randn(8, 32000, device="cuda", dtype=torch.bfloat16)
        >>> targets = torch.randint(0, 32000, (8,), device="cuda")
        >>> loss, lse = ops.cross_entropy_forward(logits, targets, label_smoothing=0.1)
        >>> loss.mean()  # the mean-reduced loss
    """
    shape = _check_cross_entropy_inputs(logits, targets, ignore_index, label_smoothing)
    loss, lse = _check_or_allocate_ce_out(out, shape, logits, targets)
    if shape.N == 0:
        return loss, lse
    ext = None if logits.device.type == "cpu" else _extension_for(logits.device)
    if ext is None:
        ref_loss, ref_lse = _cross_entropy_forward_reference(
            logits, targets, ignore_index=ignore_index, label_smoothing=label_smoothing
        )
        loss.copy_(ref_loss)
        lse.copy_(ref_lse)
        return loss, lse
    with _launch_context(logits) as stream:
        ext.cross_entropy_forward_cuda(
            logits.data_ptr(), _dtype_code(ext, logits.dtype), targets.data_ptr(), shape.N, shape.V,
            int(ignore_index), float(label_smoothing), loss.data_ptr(), lse.data_ptr(), stream,
        )
    torch.autograd.graph.increment_version([loss, lse])
    return loss, lse


def cross_entropy_backward_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_rows: torch.Tensor,
    *,
    ignore_index: int,
    label_smoothing: float,
) -> torch.Tensor:
    """Overwrite ``logits`` with the gradient of the per-row losses of :func:`cross_entropy_forward`.

    Element ``(n, c)`` becomes ``(softmax(x)[c] - (1 - eps) * [c == t] - eps / V) * grad_rows[n]``, computed
    in fp32 from the forward's ``lse`` and rounded to nearest even into the logits dtype, with ``eps =
    label_smoothing`` and ``t = targets[n]``: the gradient of ``sum(loss * grad_rows)``. Rows whose target
    is ``ignore_index`` become 0; rows with a target out of ``[0, V)`` become nan. In place, so the logits
    need no second buffer of their size; CPU tensors use the plain-PyTorch reference, as in the forward.

    Args:
        logits: the forward's ``(N, V)`` logits, overwritten.
        targets: the forward's ``(N,)`` ``torch.int64`` targets.
        lse: the forward's ``(N,)`` fp32 logsumexps.
        grad_rows: ``(N,)`` fp32 upstream gradient of each row's loss, e.g. ``1 / count`` for a mean over
            the ``count`` counted rows (0 in ignored rows is fine, they are zeroed anyway).
        ignore_index, label_smoothing: the values given to the forward (required, so that they cannot
            silently differ).

    Returns:
        ``logits``, now holding the gradient.

    Raises:
        TypeError, ValueError, NotImplementedError: as :func:`cross_entropy_forward`, and when lse or
            grad_rows is not a contiguous fp32 ``(N,)`` tensor on the logits' device, or shares memory with
            the logits.

    Example::

        >>> loss, lse = ops.cross_entropy_forward(logits, targets)
        >>> count = (targets != -100).sum()
        >>> grad_rows = torch.full_like(loss, 1.0) / count
        >>> ops.cross_entropy_backward_(logits, targets, lse, grad_rows, ignore_index=-100, label_smoothing=0.0)
    """
    shape = _check_cross_entropy_inputs(logits, targets, ignore_index, label_smoothing)
    for name, tensor in (("lse", lse), ("grad_rows", grad_rows)):
        _check_row_vector(name, tensor, shape.N, logits.device)
    _check_no_shared_memory({"logits": logits, "targets": targets, "lse": lse, "grad_rows": grad_rows})
    if shape.N == 0:
        return logits
    ext = None if logits.device.type == "cpu" else _extension_for(logits.device)
    if ext is None:
        logits.copy_(_cross_entropy_backward_reference(
            logits, targets, lse, grad_rows, ignore_index=ignore_index, label_smoothing=label_smoothing
        ))
        return logits
    with _launch_context(logits) as stream:
        ext.cross_entropy_backward_cuda(
            logits.data_ptr(), _dtype_code(ext, logits.dtype), targets.data_ptr(), shape.N, shape.V,
            int(ignore_index), float(label_smoothing), lse.data_ptr(), grad_rows.data_ptr(), stream,
        )
    torch.autograd.graph.increment_version([logits])
    return logits


def _cross_entropy_forward_reference(
    logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch cross_entropy_forward: new fp32 ``(loss, lse)`` on the logits' device, no synchronisation."""
    x = logits.float()  # (N, V)
    ignored, valid = _target_masks(targets, ignore_index, x.shape[1])
    lse = torch.logsumexp(x, dim=1)  # (N,)
    target_logit = x.gather(1, torch.where(valid, targets, 0).unsqueeze(1)).squeeze(1)
    loss = lse - target_logit
    if label_smoothing != 0:
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - x.mean(dim=1))
    loss = loss.masked_fill(~valid, math.nan).masked_fill(ignored, 0.0)
    return loss, lse.masked_fill(ignored, 0.0)


def _cross_entropy_backward_reference(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_rows: torch.Tensor,
    *,
    ignore_index: int,
    label_smoothing: float,
) -> torch.Tensor:
    """Plain-PyTorch cross_entropy_backward_, out of place: the fp32 ``(N, V)`` gradient."""
    x = logits.float()  # (N, V)
    V = x.shape[1]
    ignored, valid = _target_masks(targets, ignore_index, V)
    grad = torch.exp(x - lse.unsqueeze(1))  # softmax, from the forward's lse; a new tensor
    if label_smoothing != 0:
        grad.sub_(label_smoothing / V)
    on_target = torch.where(valid, -(1 - label_smoothing), 0.0).to(grad.dtype)  # (N,)
    grad.scatter_add_(1, torch.where(valid, targets, 0).unsqueeze(1), on_target.unsqueeze(1))
    grad.mul_(grad_rows.unsqueeze(1))
    grad.masked_fill_(~valid.unsqueeze(1), math.nan)
    return grad.masked_fill_(ignored.unsqueeze(1), 0.0)


def _target_masks(targets: torch.Tensor, ignore_index: int, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ignored, valid): rows whose target is ignore_index; rows whose target is a class in [0, V)."""
    ignored = targets == ignore_index
    return ignored, ~ignored & (targets >= 0) & (targets < V)


def _adam_reference_unless(
    skip_if: torch.Tensor | None,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: _AdamHyper,
    out: torch.Tensor | None,
) -> None:
    """_adam_reference, except that a nonzero ``skip_if`` keeps every buffer as it was; no synchronisation."""
    if skip_if is None:
        _adam_reference(param, grad, exp_avg, exp_avg_sq, **hyper._asdict(), out=out)
        return
    olds = [param, exp_avg, exp_avg_sq] + ([] if out is None else [out])
    news = [t.clone() for t in olds]
    _adam_reference(news[0], grad, news[1], news[2], **hyper._asdict(), out=news[3] if out is not None else None)
    skip = skip_if.bool()  # (1,): broadcasts
    with torch.no_grad():
        for old, new in zip(olds, news):
            old.copy_(torch.where(skip, old, new))


def _launch_adam_cuda(
    ext: ModuleType,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: _AdamHyper,
    out: torch.Tensor | None,
    skip_if: torch.Tensor | None,
    stream: int,
) -> None:
    ext.adam_cuda(
        param.data_ptr(), grad.data_ptr(), _dtype_code(ext, grad.dtype), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        param.numel(), hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, hyper.step,
        hyper.grad_scale, hyper.decoupled, 0 if out is None else out.data_ptr(),
        _dtype_code(ext, torch.float32 if out is None else out.dtype), 0 if skip_if is None else skip_if.data_ptr(),
        stream,
    )


@contextlib.contextmanager
def _launch_context(tensor: torch.Tensor) -> Iterator[int]:
    """Makes ``tensor``'s device current and yields its current stream (a raw cudaStream_t): kernels launch on
    the current device, which must own the stream and the buffers."""
    index = tensor.device.index
    if index == torch.cuda.current_device():
        yield _current_raw_stream(index)
    else:
        with torch.cuda.device(index):
            yield _current_raw_stream(index)


def _check_adam_cuda_tensors(
    param: object, grad: object, exp_avg: object, exp_avg_sq: object, out: object, skip_if: object
) -> None:
    tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if out is not None:
        tensors["out"] = out
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        _check_layout_and_device(name, tensor)
    if param.dtype != torch.float32:
        raise TypeError(
            f"param has dtype {param.dtype}; the master copy must be fp32 (torch.float32): keep an fp32 master "
            "and pass the low-precision weights as out="
        )
    for name in ("exp_avg", "exp_avg_sq"):
        if tensors[name].dtype != torch.float32:
            raise TypeError(
                f"{name} has dtype {tensors[name].dtype}; the optimizer moments must be fp32 (torch.float32)"
            )
    if grad.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"grad has dtype {grad.dtype}; expected one of {_dtype_names(_FLOAT_DTYPES)}")
    if out is not None and out.dtype not in _ADAM_COPY_DTYPES:
        raise TypeError(
            f"out has dtype {out.dtype}; expected one of {_dtype_names(_ADAM_COPY_DTYPES)} "
            "(out is the low-precision copy; param itself is updated in place)"
        )
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(f"{name} is not contiguous; call .contiguous() first")
        if tensor.numel() != param.numel():
            raise ValueError(f"{name} has {tensor.numel()} elements but param has {param.numel()}; expected the same")
    if skip_if is not None:
        _check_skip_flag(skip_if)
        tensors["skip_if"] = skip_if
    if param.device.type != "cuda":
        raise ValueError(f"param is on {param.device}; adam_step_cuda updates CUDA tensors (adam_step_cpu: CPU ones)")
    for name, tensor in tensors.items():
        if tensor.device != param.device:
            raise ValueError(f"{name} is on {tensor.device} but param is on {param.device}; expected one device")
    _check_no_shared_memory(tensors)


def _check_skip_flag(skip_if: object) -> None:
    if not isinstance(skip_if, torch.Tensor):
        raise TypeError(f"skip_if must be a torch.Tensor or None, got {type(skip_if).__name__}")
    if skip_if.dtype != torch.uint8:
        raise TypeError(f"skip_if has dtype {skip_if.dtype}; expected torch.uint8 (as has_inf_nan_into writes)")
    _check_layout_and_device("skip_if", skip_if)
    if skip_if.numel() != 1:
        raise ValueError(f"skip_if has {skip_if.numel()} elements; expected 1")


class _RowsShape(NamedTuple):
    N: int  # rows
    V: int  # classes


def _check_cross_entropy_inputs(
    logits: object, targets: object, ignore_index: object, label_smoothing: object
) -> _RowsShape:
    _check_float_tensor("logits", logits)
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; expected (N, V) with V >= 1 classes")
    N, V = logits.shape
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    if targets.dtype != torch.int64:
        raise TypeError(f"targets has dtype {targets.dtype}; expected torch.int64 class indices")
    _check_layout_and_device("targets", targets)
    if tuple(targets.shape) != (N,):
        raise ValueError(
            f"targets has shape {tuple(targets.shape)}; expected ({N},), one class index per row of logits"
        )
    if not targets.is_contiguous():
        raise ValueError("targets is not contiguous; call .contiguous() first")
    if targets.device != logits.device:
        raise ValueError(f"targets is on {targets.device} but logits is on {logits.device}; expected one device")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        raise TypeError(f"label_smoothing must be a real number, got {type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    return _RowsShape(N, V)


def _check_row_vector(name: str, tensor: object, N: int, device: torch.device) -> None:
    """An fp32 (N,) contiguous tensor on ``device``: lse, grad_rows, and the forward's outputs."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.float32:
        raise TypeError(f"{name} has dtype {tensor.dtype}; expected torch.float32")
    _check_layout_and_device(name, tensor)
    if tuple(tensor.shape) != (N,):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected ({N},), one value per row of logits")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is not contiguous; call .contiguous() first")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but logits is on {device}; expected one device")


def _check_or_allocate_ce_out(
    out: object, shape: _RowsShape, logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        return (torch.empty(shape.N, dtype=torch.float32, device=logits.device),
                torch.empty(shape.N, dtype=torch.float32, device=logits.device))
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError(f"out must be a (loss, lse) tuple of two tensors, got {type(out).__name__}")
    names = ("out[0] (loss)", "out[1] (lse)")
    for name, tensor in zip(names, out):
        _check_row_vector(name, tensor, shape.N, logits.device)
    _check_no_shared_memory({"logits": logits, "targets": targets, names[0]: out[0], names[1]: out[1]})
    return out


# ----------------------------------------------------------------------------------------- offload queue
# OffloadQueue (csrc/cpu/offload.cpp, csrc/cuda/offload_link.cu): Adam updates of parameter shards run on
# the CPU by a C++ worker thread, with the gradient and parameter copies of GPU shards.


class OffloadUpdate(NamedTuple):
    """One parameter shard's update for :class:`OffloadQueue`."""

    param: torch.Tensor  # the shard, on the queue's device or the CPU; rewritten with the new values
    grad: torch.Tensor  # its gradient: same device and element count, any float dtype
    master: torch.Tensor  # the fp32 master on the CPU; ``param`` itself for an fp32 CPU shard
    exp_avg: torch.Tensor  # fp32, CPU
    exp_avg_sq: torch.Tensor  # fp32, CPU
    hyper: dict  # keyword arguments of adam_step_cpu: lr, beta1, beta2, eps, weight_decay, step, ...
    priority: int  # lower first once the queue is prioritised


class OffloadTicket:
    """One submitted update: :meth:`wait` for it before reading its parameter."""

    __slots__ = ("_ticket", "_device")

    def __init__(self, ticket: object, device: torch.device) -> None:
        self._ticket = ticket
        self._device = device

    def done(self) -> bool:
        """Whether the update has finished on the host (on a GPU: its copy back is queued)."""
        return self._ticket is None or self._ticket.done()

    def wait(self) -> None:
        """Block until the update is done; on a GPU, make the device's current stream wait for its copy back.

        Raises:
            RuntimeError: the update failed on the worker thread (the message says why).
        """
        if self._ticket is not None:
            stream = _current_raw_stream(self._device.index) if self._device.type == "cuda" else 0
            self._ticket.wait(stream)


class OffloadQueue:
    """Adam(W) updates of parameter shards, run on the CPU by a C++ worker thread while Python goes on.

    :meth:`submit` returns at once. The worker cuts each update into chunks of ``chunk_numel``
    elements; for shards on a GPU it copies each gradient chunk into pinned staging (once the
    current stream has reached the point of submission), runs :func:`adam_step_cpu`'s kernel on
    the fp32 master and moments in CPU memory and copies the new parameters back, the three
    overlapping across chunks; CPU shards are updated in place. A queue for a GPU also takes CPU
    shards whose gradients the current stream is still copying to the host (parameters offloaded
    by ``wrap(offload_params=True)``): it updates them in place once the stream has reached the
    point of submission. The worker never needs the GIL.
    It takes the newest update first (or by priority, see :meth:`prioritise`); updates of the same
    buffers always run in the order they were submitted.
    See [Note: offload queue] in ``csrc/cpu/offload.cpp``. The queue keeps each update's tensors
    alive until it is done. Without the compiled extension (or its CUDA half, for a GPU) every
    update runs synchronously in :meth:`submit`, through :func:`adam_step_cpu`.

    Args:
        device: where the parameters are (``cpu`` or one CUDA device).
        dtypes: every parameter dtype it will update (sizes the staging).
        chunk_numel: elements per chunk.
        slots: pinned staging slots on a GPU, at least 2: pinned memory is ``slots * chunk_numel *
            2 * (largest element size)``.
        num_threads: CPU threads of the Adam kernel (None: ``torch.get_num_threads()``).

    Raises:
        ValueError: bad sizes or counts.
    """

    def __init__(self, device: torch.device, *, dtypes: set[torch.dtype], chunk_numel: int, slots: int,
                 num_threads: int | None = None) -> None:
        if not isinstance(chunk_numel, int) or chunk_numel < 1 or not isinstance(slots, int) or slots < 2:
            raise ValueError(f"need chunk_numel >= 1 and slots >= 2, got {chunk_numel!r} and {slots!r}")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"num_threads must be a positive int or None, got {num_threads!r}")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._itemsize = max([d.itemsize for d in dtypes] + [2])
        self._held: list[tuple[object, tuple[torch.Tensor, ...]]] = []
        self._ext = _extension_for(device)
        self._queue = None
        if self._ext is not None:
            threads = torch.get_num_threads() if num_threads is None else num_threads
            index = device.index if device.type == "cuda" else -1
            out_bytes = chunk_numel * self._itemsize if any(d != torch.float32 for d in dtypes) else 0
            self._queue = self._ext.OffloadQueue(index, chunk_numel, slots, chunk_numel * self._itemsize,
                                                 out_bytes, threads)

    def submit(self, updates: list[OffloadUpdate],
               ready_stream: torch.cuda.Stream | None = None) -> list[OffloadTicket]:
        """Queue ``updates``; returns one ticket per update, in order.

        On a GPU the gradients are read once ``ready_stream`` (default: the current stream) has reached
        this point.

        Raises:
            TypeError, ValueError: a tensor or hyper-parameter is not what :class:`OffloadUpdate`
                describes (nothing is queued then).
            RuntimeError: an earlier update failed on the worker thread.
        """
        hypers = [self._check(u) for u in updates]
        self.check()
        if not updates:
            return []
        if self._queue is None:
            if self.device.type == "cuda" and any(u.grad.device.type == "cpu" for u in updates):
                # Host gradients may still be arriving.
                (ready_stream or torch.cuda.current_stream(self.device)).synchronize()
            for u in updates:
                self._run_now(u)
            return [OffloadTicket(None, self.device) for _ in updates]
        ext = self._ext
        specs = [(u.param.data_ptr(), _dtype_code(ext, u.param.dtype), u.grad.data_ptr(), _dtype_code(ext, u.grad.dtype),
                  u.master.data_ptr(), u.exp_avg.data_ptr(), u.exp_avg_sq.data_ptr(), u.param.numel(), *h, u.priority,
                  u.param.device.type == "cpu")
                 for u, h in zip(updates, hypers)]
        if self.device.type != "cuda":
            ready = 0
        else:
            ready = _current_raw_stream(self.device.index) if ready_stream is None else ready_stream.cuda_stream
        self._held = [(t, keep) for t, keep in self._held if not t.done()]
        tickets = self._queue.submit(specs, ready)
        self._held.extend((t, tuple(u[:5])) for t, u in zip(tickets, updates))
        # The parameters change behind autograd's back: copies gathered from the old values are stale.
        torch.autograd.graph.increment_version([u.param for u in updates])
        return [OffloadTicket(t, self.device) for t in tickets]

    def prioritise(self) -> None:
        """From now until the queue is next empty, run the lowest ``priority`` first instead of the newest
        (updates submitted right after this call included). Updates of one buffer keep their order."""
        if self._queue is not None:
            self._queue.prioritise()

    def wait_all(self) -> None:
        """Block until every update is done on the host; raise if one failed since the last check."""
        if self._queue is not None:
            self._queue.wait_all()
            self._held = []

    def stats(self) -> dict[str, float]:
        """Where the worker's time went since the queue was made: ``adam_s`` (in the Adam kernel),
        ``stalled_s`` (waiting for a gradient copy, or for the gradient itself to be final), ``idle_s``
        (nothing to do), and ``elements`` updated. All zero when updates run synchronously."""
        if self._queue is None:
            return dict(adam_s=0.0, stalled_s=0.0, idle_s=0.0, elements=0)
        return self._queue.stats()

    def check(self) -> None:
        """Raise ``RuntimeError`` if an update failed since the last check, without waiting."""
        if self._queue is not None:
            self._queue.check()

    def _check(self, u: OffloadUpdate) -> tuple:
        if not isinstance(u, OffloadUpdate):
            raise TypeError(f"expected an OffloadUpdate, got {type(u).__name__}")
        for name in ("param", "grad", "master", "exp_avg", "exp_avg_sq"):
            tensor = getattr(u, name)
            (_check_float_tensor if name in ("param", "grad") else _check_adam_state)(name, tensor)
            if tensor.numel() != u.param.numel():
                raise ValueError(f"{name} has {tensor.numel()} elements but param has {u.param.numel()}")
        host = u.param.device.type == "cpu"
        for name in ("param", "grad"):
            if getattr(u, name).device != u.param.device or not (host or u.param.device == self.device):
                raise ValueError(f"{name} is on {getattr(u, name).device} but the queue is for {self.device}; param "
                                 "and grad must both be there, or both on the CPU")
            if getattr(u, name).element_size() > self._itemsize:
                raise ValueError(f"{name} has dtype {getattr(u, name).dtype}, wider than the dtypes the queue "
                                 "was made for; pass it in dtypes")
        own_master = u.master is u.param or u.master.data_ptr() == u.param.data_ptr()
        if own_master != (host and u.param.dtype == torch.float32):
            raise ValueError("master must be param itself exactly when param is an fp32 CPU tensor; otherwise "
                             "a separate fp32 CPU tensor")
        tensors = {"master": u.master, "exp_avg": u.exp_avg, "exp_avg_sq": u.exp_avg_sq}
        if host:
            tensors["grad"] = u.grad
            if not own_master:
                tensors["param"] = u.param
        _check_no_shared_memory(tensors)
        if isinstance(u.priority, bool) or not isinstance(u.priority, numbers.Integral):
            raise TypeError(f"priority must be an int, got {type(u.priority).__name__}")
        return tuple(_check_adam_hyper(**u.hyper))

    def _run_now(self, u: OffloadUpdate) -> None:
        """The update, synchronously, through adam_step_cpu (its kernel where only the CUDA half is missing)."""
        rounded = None if u.param.dtype == torch.float32 else torch.empty(u.param.numel(), dtype=u.param.dtype)
        adam_step_cpu(u.master.view(-1), u.grad.reshape(-1).cpu(), u.exp_avg.view(-1), u.exp_avg_sq.view(-1),
                      out=rounded, **u.hyper)
        if u.master.data_ptr() != u.param.data_ptr():
            with torch.no_grad():
                u.param.view(-1).copy_(u.master.view(-1) if rounded is None else rounded)
        torch.autograd.graph.increment_version([u.param])


def _check_adam_state(name: str, tensor: object) -> None:
    """A contiguous fp32 CPU tensor (master weights or moments of an offloaded update)."""
    _check_float_tensor(name, tensor)
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
        raise TypeError(f"{name} is a {tensor.dtype} tensor on {tensor.device}; expected torch.float32 on the CPU")
