"""Which kernel computes the blocks' attention on CUDA: cuDNN's first where it measures faster.

[Note: the attention kernel]
``F.scaled_dot_product_attention`` (what a Hugging Face model loaded with ``attn_implementation="sdpa"``
calls, transformers' default) picks the first backend in torch's priority order that takes the call:
flash attention, then memory-efficient, math, and cuDNN last. On Hopper cards (compute capability 9.0)
cuDNN's fused attention is the faster one for training shapes (causal, bf16, head size 64 or 128, grouped
key/value heads): 1.6x to 1.8x flash attention's speed forward and backward on an H200 (``benchmarks/
attention_backends.py``; the figures are in ``benchmarks/RESULTS.md``, "Two H200s"). A compiled
block already gets it there: torch's compiler chose cuDNN's kernels under either order in the same
measurement (torch 2.11), so the 8B step is the same with and without this. A block run eagerly
(``wrap(compile=False)``, or one that did not compile) would take flash attention; so each block's
forward, and its recomputation in backward, runs with cuDNN moved to the front of the priority order on
such cards (``preferred_backends``), and both kinds of block compute attention alike. Only the order
changes: a backend the user switched off (``torch.backends.cuda.enable_flash_sdp(False)`` and the like)
stays off, and a call cuDNN does not take (a mask it cannot read, a head size it lacks) goes on to the
next backend as before.

``PREFERENCE`` chooses, for the process: ``"auto"`` (the rule above), ``"torch"`` (torch's own order,
untouched) or a backend's name (``"cudnn"``, ``"flash"``, ``"efficient"``, ``"math"``) to put first on
any CUDA card.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.nn.attention import SDPBackend

__all__ = ["PREFERENCE", "attention_order", "preferred_backends", "with_attention_order"]

PREFERENCE = "auto"

_NAMES = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
# torch's own order of the four, cuDNN last.
_TORCH_ORDER = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
                SDPBackend.CUDNN_ATTENTION)


def preferred_backends(preference: str, device: torch.device,
                       capability: Optional[Tuple[int, int]] = None) -> Optional[List[SDPBackend]]:
    """The priority order the blocks' attention runs under on ``device`` (of compute ``capability``), or
    ``None`` for torch's own.

    Raises:
        ValueError: ``preference`` is not ``"auto"``, ``"torch"`` or a backend's name.
    """
    if preference not in ("auto", "torch", *_NAMES):
        raise ValueError(f"the attention preference must be 'auto', 'torch' or one of {sorted(_NAMES)}, got "
                         f"{preference!r}")
    if device.type != "cuda" or preference == "torch":
        return None
    if preference == "auto":
        if capability is None:
            capability = torch.cuda.get_device_capability(device)
        if capability[0] != 9 or not torch.backends.cudnn.is_available():
            return None
        preference = "cudnn"
    first = _NAMES[preference]
    return [first, *(b for b in _TORCH_ORDER if b != first)]


@contextlib.contextmanager
def attention_order(order: Sequence[SDPBackend]) -> Iterator[None]:
    """Attention tries the backends in ``order`` first inside, then the others in torch's order; which backends
    are switched on is left as it is, and torch's order is back as it was after.

    Only the priority order is set (torch's ``sdpa_kernel(..., set_priority=True)`` would also switch on the
    backends it lists, and leave a switched-off one last in the order after).
    """
    saved = torch._C._get_sdp_priority_order()
    first = [int(b) for b in order]
    torch._C._set_sdp_priority_order(first + [b for b in saved if b not in first])
    try:
        yield
    finally:
        torch._C._set_sdp_priority_order(saved)


def with_attention_order(body: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """``body`` run under the preferred attention order on ``device`` (``body`` itself where torch's order
    stands)."""
    order = preferred_backends(PREFERENCE, device)
    if order is None:
        return body

    @functools.wraps(body)
    def run(*args: Any, **kwargs: Any) -> Any:
        with attention_order(order):
            return body(*args, **kwargs)

    return run
