"""adam_step_cuda: one Adam(W) step on CUDA tensors in one fused kernel (csrc/cuda/adam.cu).

The Adam math has one reference, ``adam_cpu._adam_reference``, shared with adam_step_cpu; here it is what
runs when the extension lacks its CUDA kernels (:func:`_adam_reference_unless` adds the ``skip_if`` flag).
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import _ext
from .adam_cpu import _ADAM_COPY_DTYPES, _AdamHyper, _adam_reference, _check_adam_hyper


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
    ext = _ext.extension_for(param.device)
    if ext is None:
        _adam_reference_unless(skip_if, param, grad, exp_avg, exp_avg_sq, hyper, out)
        return
    with _ext.launch_context(param) as stream:
        _launch_adam_cuda(ext, param, grad, exp_avg, exp_avg_sq, hyper, out, skip_if, stream)
    written = [param, exp_avg, exp_avg_sq] + ([] if out is None else [out])
    torch.autograd.graph.increment_version(written)  # raw-pointer writes, as an in-place torch op would count


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
        param.data_ptr(), grad.data_ptr(), _ext.dtype_code(ext, grad.dtype), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        param.numel(), hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, hyper.step,
        hyper.grad_scale, hyper.decoupled, 0 if out is None else out.data_ptr(),
        _ext.dtype_code(ext, torch.float32 if out is None else out.dtype), 0 if skip_if is None else skip_if.data_ptr(),
        stream,
    )


def _check_adam_cuda_tensors(
    param: object, grad: object, exp_avg: object, exp_avg_sq: object, out: object, skip_if: object
) -> None:
    tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if out is not None:
        tensors["out"] = out
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        _ext.check_layout_and_device(name, tensor)
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
    if skip_if is not None:
        _check_skip_flag(skip_if)
        tensors["skip_if"] = skip_if
    if param.device.type != "cuda":
        raise ValueError(f"param is on {param.device}; adam_step_cuda updates CUDA tensors (adam_step_cpu: CPU ones)")
    for name, tensor in tensors.items():
        if tensor.device != param.device:
            raise ValueError(f"{name} is on {tensor.device} but param is on {param.device}; expected one device")
    _ext.check_no_shared_memory(tensors)


def _check_skip_flag(skip_if: object) -> None:
    _ext.check_one_element("skip_if", skip_if, torch.uint8, or_none=True, dtype_note=" (as has_inf_nan_into writes)")
