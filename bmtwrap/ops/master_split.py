"""fp32 masters kept as their bf16 weights plus 16-bit low halves (see [Note: split master] in csrc/common.h).

- :func:`split_master` and :func:`join_master` convert between an fp32 master and its two halves;
- :func:`adam_step_split` is one Adam(W) step of a bf16 weight through its split master: on CUDA one fused
  kernel (``adam_split_cuda`` in ``csrc/cuda/adam.cu``), on the CPU the master is joined, updated by
  :func:`adam_step_cpu` and split again.

The low halves are stored as ``torch.int16`` (the bits of an unsigned 16-bit number).
"""

from __future__ import annotations

import torch

from . import _ext
from .adam_cpu import _AdamHyper, _check_adam_hyper, adam_step_cpu
from .adam_cuda import _adam_reference_unless, _check_skip_flag

LOW_DTYPE = torch.int16


def split_master(master: torch.Tensor, weight: torch.Tensor, low: torch.Tensor) -> None:
    """Write ``master`` (fp32) split: ``weight`` (bf16) gets it rounded to nearest even, ``low`` its low halves.

    Raises:
        TypeError, ValueError: the tensors are not fp32, bf16 and int16 contiguous tensors of one size on one
            device.
    """
    _check_halves(weight, low, master)
    if master.numel() == 0:
        return
    ext = _ext.extension_for(master.device) if master.device.type == "cpu" else None
    if ext is None:
        _split_master_reference(master, weight, low)
    else:
        ext.split_master_cpu(master.data_ptr(), weight.data_ptr(), low.data_ptr(), master.numel())
    torch.autograd.graph.increment_version([weight, low])


def join_master(weight: torch.Tensor, low: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 masters that ``weight`` (bf16) and ``low`` (int16) hold, written to ``out`` if given."""
    if out is None:
        out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    _check_halves(weight, low, out)
    if out.numel() == 0:
        return out
    ext = _ext.extension_for(out.device) if out.device.type == "cpu" else None
    if ext is None:
        out.copy_(_join_master_reference(weight, low))
    else:
        ext.join_master_cpu(weight.data_ptr(), low.data_ptr(), out.data_ptr(), out.numel())
        torch.autograd.graph.increment_version([out])
    return out


def adam_step_split(
    weight: torch.Tensor,
    low: torch.Tensor,
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
    skip_if: torch.Tensor | None = None,
) -> None:
    """One Adam(W) step, as :func:`adam_step_cuda`, of a bf16 ``weight`` whose fp32 master is split.

    The master is ``join_master(weight, low)``; it is updated in fp32 and written back split, so that
    ``weight`` ends as the new master rounded to nearest even. ``skip_if`` as in :func:`adam_step_cuda`
    (CUDA only).

    Raises:
        TypeError, ValueError: as :func:`adam_step_cuda`; ``weight`` must be bf16 and ``low`` int16.
    """
    hyper = _check_adam_hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale, decoupled)
    _check_split_tensors(weight, low, grad, exp_avg, exp_avg_sq, skip_if)
    if weight.numel() == 0:
        return
    ext = _ext.extension_for(weight.device) if weight.is_cuda else None
    if ext is None:
        _adam_split_unfused(weight, low, grad, exp_avg, exp_avg_sq, hyper, skip_if)
        return
    with _ext.launch_context(weight) as stream:
        ext.adam_split_cuda(
            weight.data_ptr(), low.data_ptr(), grad.data_ptr(), _ext.dtype_code(ext, grad.dtype), exp_avg.data_ptr(),
            exp_avg_sq.data_ptr(), weight.numel(), hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay,
            hyper.step, hyper.grad_scale, hyper.decoupled, 0 if skip_if is None else skip_if.data_ptr(), stream,
        )
    torch.autograd.graph.increment_version([weight, low, exp_avg, exp_avg_sq])


def _adam_split_unfused(weight: torch.Tensor, low: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                        exp_avg_sq: torch.Tensor, hyper: _AdamHyper, skip_if: torch.Tensor | None) -> None:
    """Join, update and split again, through an fp32 master made for the step (the CPU, or no CUDA kernels)."""
    master = join_master(weight, low)
    if weight.is_cuda:
        _adam_reference_unless(skip_if, master, grad, exp_avg, exp_avg_sq, hyper, None)
    else:
        adam_step_cpu(master, grad, exp_avg, exp_avg_sq, **hyper._asdict())
    split_master(master, weight, low)


# ------------------------------------------------------------------------------------ plain-PyTorch halves


def _to_int(bits: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Unsigned ``width``-bit values held in int64 as the signed ``dtype`` with the same bits."""
    return torch.where(bits >= 1 << (width - 1), bits - (1 << width), bits).to(dtype)


def _split_master_reference(master: torch.Tensor, weight: torch.Tensor, low: torch.Tensor) -> None:
    bits = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    high, lows = bits >> 16, bits & 0xFFFF
    up = (lows > 0x8000) | ((lows == 0x8000) & ((high & 1) == 1))
    lows = torch.where((lows == 0x8000) & ~up, 0x7FFF, lows)
    weights = high + up.to(torch.int64)
    nan = torch.isnan(master)
    weights = torch.where(nan, (high & 0x8000) | 0x7FC0, weights)
    lows = torch.where(nan, 0, lows)
    weight.view(torch.int16).copy_(_to_int(weights, 16, torch.int16).view(weight.shape))
    low.copy_(_to_int(lows, 16, torch.int16).view(low.shape))


def _join_master_reference(weight: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    weights = weight.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    lows = low.to(torch.int64) & 0xFFFF
    own = ((weights & 0x7F80) == 0x7F80) | ((weights & 0x7FFF) == 0)  # inf, NaN, zero: their own master
    high = (weights - (lows >= 0x8000).to(torch.int64)) & 0xFFFF
    bits = torch.where(own, weights << 16, (high << 16) | lows)
    odd_tie = ~own & (lows == 0x8000) & ((weights & 1) == 1)  # never split so: a written weight, kept
    bits = torch.where(odd_tie, (weights << 16) | 0x7FFF, bits)
    return _to_int(bits, 32, torch.int32).view(torch.float32)


# -------------------------------------------------------------------------------------------------- checks


def _check_halves(weight: object, low: object, master: object) -> None:
    tensors = {"weight": weight, "low": low, "master": master}
    dtypes = {"weight": torch.bfloat16, "low": LOW_DTYPE, "master": torch.float32}
    _check_tensors(tensors, dtypes)


def _check_split_tensors(weight: object, low: object, grad: object, exp_avg: object, exp_avg_sq: object,
                         skip_if: object) -> None:
    tensors = {"weight": weight, "low": low, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    dtypes = {"weight": torch.bfloat16, "low": LOW_DTYPE, "grad": None, "exp_avg": torch.float32,
              "exp_avg_sq": torch.float32}
    _check_tensors(tensors, dtypes)
    if skip_if is not None:
        _check_skip_flag(skip_if)
        if skip_if.device != weight.device:
            raise ValueError(f"skip_if is on {skip_if.device} but weight is on {weight.device}; expected one device")


def _check_tensors(tensors: dict[str, object], dtypes: dict[str, torch.dtype | None]) -> None:
    for name, tensor in tensors.items():
        if dtypes[name] is None:
            _ext.check_float_tensor(name, tensor)
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != dtypes[name]:
            raise TypeError(f"{name} has dtype {tensor.dtype}; expected {dtypes[name]} (see bmtwrap.ops.master_split)")
        _ext.check_layout_and_device(name, tensor)
        if not tensor.is_contiguous():
            raise ValueError(f"{name} is not contiguous; call .contiguous() first")
    first_name, first = next(iter(tensors.items()))
    for name, tensor in tensors.items():
        if tensor.numel() != first.numel():
            raise ValueError(f"{name} has {tensor.numel()} elements but {first_name} has {first.numel()}; "
                             "expected the same")
        if tensor.device != first.device:
            raise ValueError(f"{name} is on {tensor.device} but {first_name} is on {first.device}; expected one device")
    _ext.check_no_shared_memory(tensors)
