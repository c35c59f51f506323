"""Checked entry points to the compiled kernels of ``bmtwrap._C``, each with a plain-PyTorch fallback.

One module per kernel family, mirroring ``csrc/``:

- ``_ext``: the only importer of ``bmtwrap._C``: finding it for a device, what it was built for
  (:func:`cuda_archs`), the one-time fallback warning, dtype codes, raw CUDA streams, and the tensor
  checks every op shares (see [Note: tensors crossing into C++] in ``csrc/common.h``: every public op
  checks type, dtype, layout, device and contiguity before a pointer leaves Python);
- ``inf_nan``: :func:`has_inf_nan`, :func:`has_inf_nan_into` (``csrc/{cpu,cuda}/inf_nan``);
- ``adam_cpu``, ``adam_cuda``: :func:`adam_step_cpu`, :func:`adam_step_cuda` (``csrc/cpu/adam.cpp``,
  ``csrc/cuda/adam.cu``);
- ``master_split``: :func:`split_master`, :func:`join_master`, :func:`adam_step_split` (fp32 masters kept as
  bf16 weights plus low halves; ``csrc/common.h``, ``csrc/cuda/adam.cu``);
- ``cross_entropy``: :func:`cross_entropy_forward`, :func:`cross_entropy_backward_`
  (``csrc/cuda/cross_entropy.cu``);
- ``offload``: :class:`OffloadQueue` (``csrc/cpu/offload.cpp``, ``csrc/cuda/offload_link.cu``);
- ``scale``: :func:`scaled_copy_` (``csrc/cuda/scale.cu``).

Every op ``<op>`` has a ``_<op>_reference`` written in plain PyTorch. It is what runs when the extension is
missing (or was built without CUDA and the tensor is on a GPU), with one warning per process, and it is
what ``tests/test_ops.py`` compares the kernels against.
"""

from ._ext import cuda_archs, extension_available
from .adam_cpu import adam_step_cpu
from .adam_cuda import adam_step_cuda
from .cross_entropy import cross_entropy_backward_, cross_entropy_forward
from .inf_nan import has_inf_nan, has_inf_nan_into
from .master_split import adam_step_split, join_master, split_master
from .offload import OffloadQueue, OffloadTicket, OffloadUpdate
from .scale import scaled_copy_

# The plain-PyTorch references and the kernel tests' hooks, under the names tests/ reach them by
# (ops._adam_reference, ...); not part of the public API.
from ._ext import cpu_isas as _cpu_isas
from ._ext import warn_fallback as _warn_fallback
from .adam_cpu import _AdamHyper, _adam_reference, _adam_step_cpu_with
from .adam_cuda import _adam_reference_unless
from .cross_entropy import _cross_entropy_backward_reference, _cross_entropy_forward_reference
from .inf_nan import _has_inf_nan_reference
from .master_split import _join_master_reference, _split_master_reference
from .scale import _scaled_copy_reference

__all__ = [
    "OffloadQueue",
    "OffloadTicket",
    "OffloadUpdate",
    "adam_step_cpu",
    "adam_step_cuda",
    "adam_step_split",
    "cross_entropy_backward_",
    "cross_entropy_forward",
    "cuda_archs",
    "extension_available",
    "has_inf_nan",
    "has_inf_nan_into",
    "join_master",
    "scaled_copy_",
    "split_master",
]
