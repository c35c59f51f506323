"""has_inf_nan and has_inf_nan_into: whether tensors hold an inf or a nan (csrc/cpu/inf_nan.cpp,
csrc/cuda/inf_nan.cu)."""

from __future__ import annotations

from types import ModuleType

import torch

from . import _ext


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
    _ext.check_float_tensor("tensor", tensor)
    if tensor.numel() == 0:
        return False
    ext = _ext.extension_for(tensor.device)
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
    _ext.check_float_tensor("tensor", tensor)
    _check_flag(flag, tensor.device)
    if tensor.numel() == 0:
        return
    ext = _ext.extension_for(tensor.device)
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
        ext.has_inf_nan(tensor.data_ptr(), tensor.numel(), _ext.dtype_code(ext, tensor.dtype),
                        torch.get_num_threads())
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
    code = _ext.dtype_code(ext, tensor.dtype)
    ext.has_inf_nan_cuda(tensor.data_ptr(), tensor.numel(), code, flag.data_ptr(), _ext.current_raw_stream(index))


def _check_flag(flag: object, device: torch.device) -> None:
    _ext.check_one_element("flag", flag, torch.uint8, example=", e.g. torch.zeros(1, dtype=torch.uint8, device=...)")
    if flag.device != device:
        raise ValueError(f"flag is on {flag.device} but tensor is on {device}; expected both on the same device")
