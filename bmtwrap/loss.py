"""Cross-entropy losses that spend little memory on large vocabularies.

:class:`FusedCrossEntropy` computes softmax and NLL in one kernel from bf16/fp16 logits, returns
an fp32 loss, and can write the gradient into the logits' own buffer. :func:`linear_cross_entropy`
goes further: it never materialises the (tokens x vocab) logits at all. With a 128k vocabulary the
logits of 8 x 2048 tokens take 4 GiB in bf16 (8 GiB more for an fp32 copy), more than a layer's
activations; chunking them keeps a few hundred MiB alive instead.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .engine.tp import parallel_cross_entropy

__all__ = ["FusedCrossEntropy", "linear_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")
# Rows of the weight gradient accumulated per matmul in linear_cross_entropy where the matmul cannot
# accumulate in fp32 itself (bounds a temporary).
_VOCAB_SLICE = 16384


def _check(reduction: str, label_smoothing: float) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")


def _row_weights(targets: torch.Tensor, ignore_index: int, reduction: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-row factor of the reduction (1/count for mean, 1 for sum; 0 on ignored rows) and the count."""
    valid = (targets != ignore_index).float()
    count = valid.sum()
    if reduction == "mean":
        return valid / count.clamp(min=1), count
    return valid, count


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, label_smoothing: float,
                reduction: str, inplace: bool) -> torch.Tensor:
        rows, lse = ops.cross_entropy_forward(logits, targets, ignore_index=ignore_index,
                                              label_smoothing=label_smoothing)
        weights, _ = _row_weights(targets, ignore_index, reduction)
        ctx.save_for_backward(logits, targets, lse, weights)
        ctx.options = (ignore_index, label_smoothing, reduction, inplace)
        if reduction == "none":
            return rows
        return (rows * weights).sum()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, targets, lse, weights = ctx.saved_tensors
        ignore_index, label_smoothing, reduction, inplace = ctx.options
        grad_rows = (grad_out.float() * weights).contiguous() if reduction == "none" else (weights * grad_out.float())
        # In place, the logits' buffer becomes their gradient: no second (tokens x vocab) tensor.
        grad = logits if inplace else logits.clone()
        ops.cross_entropy_backward_(grad, targets, lse, grad_rows.contiguous(), ignore_index=ignore_index,
                                    label_smoothing=label_smoothing)
        return grad, None, None, None, None, None


class FusedCrossEntropy(nn.Module):
    """Softmax + NLL in one kernel: bf16/fp16/fp32 logits in, fp32 loss out (BMTrain's class).

    Args:
        weight: a weight per class (V,), as ``torch.nn.functional.cross_entropy``'s; "mean" then
            divides by the summed weights of the counted rows. With it, the loss is computed by
            torch in fp32 rather than by the fused kernel (same result, more memory).
        ignore_index: targets equal to it contribute nothing (and are not counted by "mean").
        reduction: "mean" (over non-ignored rows), "sum" or "none".
        label_smoothing: as ``torch.nn.functional.cross_entropy``.
        parallel: BMTrain's vocabulary-parallel loss (``init_distributed(tp_size=T)``): the logits are
            this rank's slice of the vocabulary (``bmt.nn.VPEmbedding(..., projection=True)``'s), the
            target the whole one, the same on every rank of the tensor-parallel group; so is the loss.
        inplace: write the gradient into the logits' buffer in backward (saves one logits-sized
            tensor; the logits must not be used after backward).

    Raises:
        ValueError: an unknown ``reduction``, ``label_smoothing`` outside [0, 1), a ``weight`` that
            is not 1-D.
        NotImplementedError: ``parallel=True`` with a ``weight``.

    Shapes: ``logits`` (N, V) or (..., V), ``target`` with the leading shape of ``logits``.

    Example::

        loss = bmt.loss.FusedCrossEntropy(ignore_index=-100)(logits.view(-1, V), labels.view(-1))
    """

    def __init__(self, weight: Optional[torch.Tensor] = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, parallel: bool = False, *, inplace: bool = False) -> None:
        super().__init__()
        _check(reduction, label_smoothing)
        if parallel and weight is not None:
            raise NotImplementedError("FusedCrossEntropy(parallel=True) takes no class weight: give weight=None, "
                                      "or gather the logits and use parallel=False")
        if weight is not None and (not isinstance(weight, torch.Tensor) or weight.dim() != 1):
            raise ValueError(f"weight must be a 1-D tensor with one weight per class, got "
                             f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
        self.weight = weight
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.inplace = inplace
        self.parallel = parallel

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of ``logits`` against the class indices ``target``.

        Args:
            logits: (..., V) scores, fp32, bf16 or fp16.
            target: class indices with the shape of ``logits`` without its last dimension.

        Returns:
            An fp32 scalar ("mean", "sum"), or a loss per row with the shape of ``target`` ("none").

        Raises:
            ValueError: ``target``'s shape is not ``logits``' without the last dimension.
        """
        if logits.shape[:-1] != target.shape:
            raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree: the target "
                             "needs the logits' shape without the last (vocabulary) dimension")
        vocab = logits.shape[-1]
        if self.parallel:
            rows = parallel_cross_entropy(logits.reshape(-1, vocab), target.reshape(-1).long(), self.ignore_index,
                                          self.label_smoothing)
            if self.reduction == "none":
                return rows.view(target.shape)
            total = rows.sum()
            return total if self.reduction == "sum" else total / (target != self.ignore_index).sum().clamp(min=1)
        if self.weight is not None:
            if self.weight.numel() != vocab:
                raise ValueError(f"weight has {self.weight.numel()} entries but the logits {vocab} classes")
            out = F.cross_entropy(logits.reshape(-1, vocab).float(), target.reshape(-1).long(),
                                  weight=self.weight.to(device=logits.device, dtype=torch.float32),
                                  ignore_index=self.ignore_index, reduction=self.reduction,
                                  label_smoothing=self.label_smoothing)
            return out.view(target.shape) if self.reduction == "none" else out
        flat, flat_target = logits.reshape(-1, vocab).contiguous(), target.reshape(-1).long().contiguous()
        out = _FusedCrossEntropy.apply(flat, flat_target, self.ignore_index, self.label_smoothing, self.reduction,
                                       self.inplace)
        return out.view(target.shape) if self.reduction == "none" else out


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss of ``hidden @ weight.T``, chunk by chunk, with both gradients computed on the way."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                label_smoothing: float, reduction: str, chunk: int, softcap: Optional[float]) -> torch.Tensor:
        weights, _ = _row_weights(targets, ignore_index, reduction)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # Written whole by the first chunk's product; zeros only when there is none.
        grad_weight = (torch.empty if hidden.shape[0] else torch.zeros)(
            weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk]
            t = targets[start : start + chunk]
            w = weights[start : start + chunk].contiguous()
            logits = h @ weight.T  # (chunk, V): the only logits alive at a time
            tanh = None
            if softcap is not None:  # cap * tanh(logits / cap), in the logits' dtype as transformers does it
                tanh = torch.tanh(logits.div_(softcap))
                logits = tanh * softcap
            rows, lse = ops.cross_entropy_forward(logits, t, ignore_index=ignore_index,
                                                  label_smoothing=label_smoothing)
            total += (rows * w).sum()
            if need_grad:
                ops.cross_entropy_backward_(logits, t, lse, w, ignore_index=ignore_index,
                                            label_smoothing=label_smoothing)
                if tanh is not None:  # d(cap * tanh(x / cap))/dx = 1 - tanh(x / cap)^2
                    logits.mul_(tanh.square_().neg_().add_(1))
                if grad_hidden is not None:
                    grad_hidden[start : start + chunk] = logits @ weight
                if grad_weight is not None:
                    _accumulate_product(grad_weight, logits.T, h, first=start == 0)
            # Freed before the next chunk's product allocates its logits: else two chunks are alive at once.
            del logits, tanh
        ctx.grads = (grad_hidden, grad_weight)  # consumed (scaled) by the one backward
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy's backward runs once; retain_graph is not supported")
        (grad_hidden, grad_weight), ctx.grads = ctx.grads, None
        scale = grad_out.float().contiguous()
        # The hidden state's gradient scaled in place; the fp32 weight gradient scaled and rounded into the weight's
        # dtype in the same pass (ops.scaled_copy_: the scale stays on the device).
        gh = ops.scaled_copy_(grad_hidden, grad_hidden, scale) if grad_hidden is not None else None
        gw = None
        if grad_weight is not None:
            gw = ops.scaled_copy_(torch.empty_like(grad_weight, dtype=ctx.weight_dtype), grad_weight, scale)
        return gh, gw, None, None, None, None, None, None


def _accumulate_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``out += a @ b`` for an fp32 ``out`` and low-precision ``a``, ``b``; ``out = a @ b`` when ``first`` (what
    ``out`` held is then never read, so it need not be zeroed).

    On a GPU the matmul accumulates into ``out`` in its own fp32 epilogue (``addmm`` with
    ``out_dtype``): no temporary, no second pass over ``out``. Elsewhere (and where that form is
    missing) the low-precision product is added a slice of rows at a time, which bounds the
    temporary to ``_VOCAB_SLICE`` rows.
    """
    if out.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and a.dtype == b.dtype:
        # beta=0: torch's addmm ignores the input then, nan and inf included.
        torch.addmm(out, a, b, beta=0 if first else 1, out_dtype=torch.float32, out=out)
        return
    for v in range(0, a.shape[0], _VOCAB_SLICE):
        if first:
            out[v : v + _VOCAB_SLICE].copy_(a[v : v + _VOCAB_SLICE] @ b)
        else:
            out[v : v + _VOCAB_SLICE].add_(a[v : v + _VOCAB_SLICE] @ b)


# Rows per chunk of linear_cross_entropy by default (see its docstring); the plan counts one chunk of logits.
CHUNK_SIZE = 8192


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         chunk_size: int = CHUNK_SIZE, softcap: Optional[float] = None) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``target`` without materialising the logits.

    Rows are processed ``chunk_size`` at a time: each chunk's logits are computed, reduced to its
    losses, turned into their gradient in place and multiplied back into the gradients of
    ``hidden`` and ``weight``, then freed. Backward only scales those gradients. Peak extra memory:
    one chunk of logits plus an fp32 gradient of ``weight``.

    Every chunk reads and writes the whole fp32 weight gradient once, so fewer, larger chunks are
    faster: at a 128k vocabulary and 16k rows of 4096 on an H100, the default 8192 rows took 79-80 ms
    with 4.9 GiB extra, torch's ``F.cross_entropy(hidden @ weight.T)`` 81-84 ms with 10.6 GiB, and
    2048 rows 83-84 ms with 2.0 GiB (``benchmarks/cross_entropy.py``). Lower ``chunk_size`` when
    memory is scarcer than time.

    Args:
        hidden: (N, H) final hidden states (any float dtype; bf16 in training).
        weight: (V, H) output projection (an LM head's weight; tied embeddings work).
        target: (N,) class indices.
        reduction: "mean" (over non-ignored rows) or "sum".
        chunk_size: rows per chunk (see above).
        softcap: the logits are ``softcap * tanh(logits / softcap)`` (Gemma 2's ``final_logit_softcapping``).

    Raises:
        ValueError: shapes that do not fit, or ``reduction="none"``.

    Example::

        loss = bmt.loss.linear_cross_entropy(h.view(-1, H), model.lm_head.weight, labels.view(-1))
    """
    _check(reduction, label_smoothing)
    if reduction == "none":
        raise ValueError("linear_cross_entropy reduces: use reduction='mean' or 'sum'")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden (N, H) and weight (V, H), got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if target.shape != hidden.shape[:1]:
        raise ValueError(f"target must have shape ({hidden.shape[0]},), got {tuple(target.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    return _LinearCrossEntropy.apply(hidden.contiguous(), weight, target.long().contiguous(), ignore_index,
                                     label_smoothing, reduction, chunk_size, softcap)
