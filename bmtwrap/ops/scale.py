"""scaled_copy_: ``out = src * scale`` in one pass, the scale a tensor on the device (csrc/cuda/scale.cu)."""

from __future__ import annotations

import torch

from . import _ext


def scaled_copy_(out: torch.Tensor, src: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Write ``src * scale`` into ``out``, computed in fp32 and rounded to nearest even into ``out``'s dtype.

    What ``src.float().mul(scale).to(out.dtype)`` gives, in one pass over memory on a GPU, where torch's multiply by
    a 0-dim tensor on the device is a second, unvectorised pass (see [Note: scaled copy] in csrc/cuda/scale.cu).
    The scale is read by the kernel: a value still being computed on the GPU (a loss's upstream gradient) costs the
    host no wait. CPU tensors run the plain-PyTorch reference, without a warning: there is no CPU kernel.

    Args:
        out: contiguous, float32, float16 or bfloat16, as many elements as ``src``; may be ``src`` itself.
        src: contiguous, float32, float16 or bfloat16, on the same device.
        scale: a one-element float32 tensor on the same device.

    Returns:
        ``out``.

    Raises:
        TypeError: a tensor is not a tensor or has another dtype.
        ValueError: the element counts differ, a tensor is not contiguous, the tensors are on different devices,
            ``scale`` does not have one element, or ``out`` overlaps ``src`` without being it.
        NotImplementedError: a tensor is sparse, or on a device other than cpu and cuda.

    Example::

        >>> grad_bf16 = torch.empty_like(grad_fp32, dtype=torch.bfloat16)
        >>> ops.scaled_copy_(grad_bf16, grad_fp32, grad_out.float())
    """
    _ext.check_float_tensor("out", out)
    _ext.check_float_tensor("src", src)
    _check_scale(scale, src.device)
    if out.numel() != src.numel():
        raise ValueError(f"out has {out.numel()} elements but src {src.numel()}; expected as many")
    if out.device != src.device:
        raise ValueError(f"out is on {out.device} but src is on {src.device}; expected one device")
    same = out.data_ptr() == src.data_ptr() and out.dtype == src.dtype
    if not same:
        _ext.check_no_shared_memory({"out": out, "src": src})
    if src.numel() == 0:
        return out
    ext = None if src.device.type == "cpu" else _ext.extension_for(src.device)
    if ext is None:
        return out.copy_(_scaled_copy_reference(src, scale).view(out.shape))
    with _ext.launch_context(src) as stream:
        ext.scaled_copy_cuda(src.data_ptr(), _ext.dtype_code(ext, src.dtype), out.data_ptr(),
                             _ext.dtype_code(ext, out.dtype), src.numel(), scale.data_ptr(), stream)
    torch.autograd.graph.increment_version([out])
    return out


def _scaled_copy_reference(src: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch scaled_copy_: the fp32 product (rounded by the caller's copy into the output)."""
    return src.float() * scale.reshape(())


def _check_scale(scale: object, device: torch.device) -> None:
    _ext.check_one_element("scale", scale, torch.float32)
    if scale.device != device:
        raise ValueError(f"scale is on {scale.device} but src is on {device}; expected one device")
