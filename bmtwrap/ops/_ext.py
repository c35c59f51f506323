"""The compiled extension ``bmtwrap._C``: finding it, and what every op checks before calling it.

This is the only module that imports ``bmtwrap._C``. The extension does not link against torch, so tensors
reach it as raw data pointers, element counts and dtype codes (see [Note: tensors crossing into C++] in
``csrc/common.h``); every public op of ``bmtwrap.ops`` therefore checks type, dtype, layout, device and
contiguity (with the checks here) before a pointer leaves Python.

An op asks :func:`extension_for` for the extension of its tensor's device; when there is none it runs its
plain-PyTorch reference instead, and :func:`warn_fallback` has warned once per process and reason.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType

import torch

_C: ModuleType | None
_C_IMPORT_ERROR: ImportError | None = None
try:
    from .. import _C
except ImportError as error:  # never built, or built for another Python
    _C = None
    _C_IMPORT_ERROR = error

BUILD_COMMAND = "pip install --no-build-isolation -e ."
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
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


def cuda_archs() -> list[str]:
    """The GPU architectures the CUDA kernels of ``bmtwrap._C`` were compiled for, e.g. ``["sm_80", "sm_90"]``.

    The build takes them from ``BMTWRAP_CUDA_ARCH`` (default ``80;90``, see setup.py); the highest
    also ships as PTX, which the driver compiles on first use for a newer GPU.

    Returns:
        An empty list if there are no CUDA kernels: ``bmtwrap._C`` is missing, or was built without
        nvcc (or with ``BMTWRAP_NO_CUDA=1``).

    Example::

        >>> from bmtwrap import ops
        >>> ops.cuda_archs()
        ['sm_80', 'sm_90']
    """
    if _C is None or not _C.has_cuda():
        return []
    return [f"sm_{arch}" for arch in _C.cuda_archs().split(";") if arch]


def build_summary() -> str:
    """One line on the compiled kernels and the GPU this process sees (what scripts/install.sh prints)."""
    if _C is None:
        return "WITHOUT compiled kernels: every op runs its plain-PyTorch reference"
    archs = cuda_archs()
    cuda = f"CUDA for {', '.join(archs)}" if archs else "no CUDA: built without nvcc or with BMTWRAP_NO_CUDA=1"
    return f"with compiled kernels: CPU ({cpu_isas()[-1].upper()}), {cuda} ({_gpu_note(archs)})"


def _gpu_note(archs: list[str]) -> str:
    if not torch.cuda.is_available():
        return "no GPU visible: the CPU kernels and torch run here"
    major, minor = torch.cuda.get_device_capability()
    here = f"GPU visible: {torch.cuda.get_device_name()}, sm_{major}{minor}"
    plain = [int(a.removeprefix("sm_")) for a in archs if a.removeprefix("sm_").isdigit()]
    if not archs:
        return f"{here}; its ops run their plain-PyTorch references"
    if f"sm_{major}{minor}" in {a.rstrip("af") for a in archs}:  # sm_90a: features of the sm_90 GPUs alone
        return here
    if plain and major * 10 + minor > max(plain):
        return f"{here}: the kernels run from the sm_{max(plain)} PTX, compiled by the driver on first use"
    return f"{here}, which has no kernel image among them: rebuild with BMTWRAP_CUDA_ARCH={major}{minor}"


def extension_for(device: torch.device) -> ModuleType | None:
    """The extension if it has kernels for ``device``; otherwise None, after warning once."""
    if _C is None:
        cause = f" ({_C_IMPORT_ERROR})" if _C_IMPORT_ERROR is not None else ""
        warn_fallback(f"the compiled extension bmtwrap._C is missing{cause}")
        return None
    if device.type == "cuda" and not _C.has_cuda():
        warn_fallback(
            "the compiled extension bmtwrap._C was built without CUDA kernels "
            "(nvcc was not found at build time, or BMTWRAP_NO_CUDA was set)"
        )
        return None
    return _C


def require_extension() -> ModuleType:
    """The extension, for callers that have no fallback (tests and benchmarks of one kernel).

    Raises:
        RuntimeError: ``bmtwrap._C`` is missing.
    """
    if _C is None:
        raise RuntimeError(f"bmtwrap._C is missing ({_C_IMPORT_ERROR}); build it with `{BUILD_COMMAND}`")
    return _C


def cpu_isas() -> tuple[str, ...]:
    """Names of the instruction sets this CPU can run the kernels for, "scalar" first; () without _C."""
    return tuple(isa.name for isa in _C.cpu_supported_isas()) if _C is not None else ()


@functools.cache
def warn_fallback(reason: str) -> None:
    """Warns once per process and reason (functools.cache remembers which reasons were given)."""
    warnings.warn(
        f"{reason}; bmtwrap.ops falls back to slower plain-PyTorch implementations. "
        f"Build it with `{BUILD_COMMAND}` in the bmtwrap source tree.",
        RuntimeWarning,
        stacklevel=4,  # the caller of the public op: warn_fallback <- extension_for <- op <- caller
    )


def dtype_code(ext: ModuleType, dtype: torch.dtype) -> object:
    """The ``_C.DType`` member of a dtype already checked to be in FLOAT_DTYPES (names match torch's)."""
    return getattr(ext.DType, str(dtype).removeprefix("torch."))


def current_raw_stream(index: int) -> int:
    """The cudaStream_t of device ``index``'s current stream, as an integer.

    torch.cuda.current_stream() builds a Stream object (about 6 us, more than the kernel launch); the raw
    getter that torch's own generated kernels use costs 0.2 us. It is private, hence the public fallback.
    """
    if _GET_RAW_STREAM is not None:
        return _GET_RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


@contextlib.contextmanager
def launch_context(tensor: torch.Tensor) -> Iterator[int]:
    """Makes ``tensor``'s device current and yields its current stream (a raw cudaStream_t): kernels launch on
    the current device, which must own the stream and the buffers."""
    index = tensor.device.index
    if index == torch.cuda.current_device():
        yield current_raw_stream(index)
    else:
        with torch.cuda.device(index):
            yield current_raw_stream(index)


# ------------------------------------------------------------------------------------------- shared checks


def check_float_tensor(name: str, tensor: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {tensor.dtype}; expected one of {dtype_names(FLOAT_DTYPES)}")
    check_layout_and_device(name, tensor)
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is not contiguous; call .contiguous() first")


def check_one_element(name: str, tensor: object, dtype: torch.dtype, *, or_none: bool = False, dtype_note: str = "",
                      example: str = "") -> None:
    """A one-element tensor of ``dtype`` (a flag, a scale): the type, dtype, layout, device type and size checked,
    each failure naming ``name``; ``or_none``, ``dtype_note`` and ``example`` add to the messages."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' or None' if or_none else ''}, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise TypeError(f"{name} has dtype {tensor.dtype}; expected {dtype}{dtype_note}")
    check_layout_and_device(name, tensor)
    if tensor.numel() != 1:
        raise ValueError(f"{name} has {tensor.numel()} elements; expected 1{example}")


def check_layout_and_device(name: str, tensor: torch.Tensor) -> None:
    if tensor.layout != torch.strided:
        raise NotImplementedError(f"{name} has layout {tensor.layout}; bmtwrap.ops supports torch.strided only")
    if tensor.device.type not in _DEVICE_TYPES:
        raise NotImplementedError(f"{name} is on device {tensor.device}; bmtwrap.ops supports cpu and cuda tensors")


def check_no_shared_memory(tensors: dict[str, torch.Tensor]) -> None:
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name) for name, t in tensors.items() if t.numel()
    )
    for (_, end, name), (start, _, next_name) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{name} and {next_name} share memory; expected a separate buffer for each")


def dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d) for d in dtypes)
