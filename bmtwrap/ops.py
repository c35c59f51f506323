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

import functools
import warnings
from collections.abc import Callable
from types import ModuleType

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
