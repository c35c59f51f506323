"""cross_entropy_forward and cross_entropy_backward_: softmax and NLL fused (csrc/cuda/cross_entropy.cu).

These ops also take CPU tensors: there is no CPU kernel, so the torch reference runs on them by design,
without the fallback warning (which means "a kernel you could have is missing").
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from . import _ext


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
    ext = None if logits.device.type == "cpu" else _ext.extension_for(logits.device)
    if ext is None:
        ref_loss, ref_lse = _cross_entropy_forward_reference(
            logits, targets, ignore_index=ignore_index, label_smoothing=label_smoothing
        )
        loss.copy_(ref_loss)
        lse.copy_(ref_lse)
        return loss, lse
    with _ext.launch_context(logits) as stream:
        ext.cross_entropy_forward_cuda(
            logits.data_ptr(), _ext.dtype_code(ext, logits.dtype), targets.data_ptr(), shape.N, shape.V,
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
    _ext.check_no_shared_memory({"logits": logits, "targets": targets, "lse": lse, "grad_rows": grad_rows})
    if shape.N == 0:
        return logits
    ext = None if logits.device.type == "cpu" else _ext.extension_for(logits.device)
    if ext is None:
        logits.copy_(_cross_entropy_backward_reference(
            logits, targets, lse, grad_rows, ignore_index=ignore_index, label_smoothing=label_smoothing
        ))
        return logits
    with _ext.launch_context(logits) as stream:
        ext.cross_entropy_backward_cuda(
            logits.data_ptr(), _ext.dtype_code(ext, logits.dtype), targets.data_ptr(), shape.N, shape.V,
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


class _RowsShape(NamedTuple):
    N: int  # rows
    V: int  # classes


def _check_cross_entropy_inputs(
    logits: object, targets: object, ignore_index: object, label_smoothing: object
) -> _RowsShape:
    _ext.check_float_tensor("logits", logits)
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; expected (N, V) with V >= 1 classes")
    N, V = logits.shape
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    if targets.dtype != torch.int64:
        raise TypeError(f"targets has dtype {targets.dtype}; expected torch.int64 class indices")
    _ext.check_layout_and_device("targets", targets)
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
    _ext.check_layout_and_device(name, tensor)
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
    _ext.check_no_shared_memory({"logits": logits, "targets": targets, names[0]: out[0], names[1]: out[1]})
    return out
