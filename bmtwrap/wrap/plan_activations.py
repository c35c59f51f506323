"""The plan's model of a transformer layer's activations and of the LM head's loss, from the model's config.

See [Note: memory estimate] in ``plan.py``, which sums these with the exact parts (parameters, gradients and
optimizer state) into the peak of a training step.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from ..loss import CHUNK_SIZE
from .adapters import adapter_for

__all__ = ["LayerBytes", "layer_bytes", "loss_bytes"]

# Values per token that one transformer layer saves for backward (16-bit), in units of the
# hidden size h and the MLP width i: norm outputs, q/k/v, attention output and its projection,
# residuals (~10 h), and the MLP's gate, up, activation and product (4 i).
LAYER_SAVED_H, LAYER_SAVED_I = 10, 4
# fp32 values per token a layer's norms keep (input and output upcast, two norms), in units of h.
LAYER_FP32_H = 4
# What a compiled layer saves, per token (inductor recomputes the norms' fp32 values and the activation function):
# 16-bit values in units of h (the layer's input, the two norms' outputs, q, and the attention's output in two
# layouts), of the key/value width (k and v, grouped heads not repeated) and of i (gate, up and their product);
# fp32 values per attention head (the attention's log-sum-exp) and per norm (its reciprocal RMS). Each block's saved
# tensors counted on an H200 at the 1B, 3B and 8B shapes: exactly this.
COMPILED_SAVED_H, COMPILED_SAVED_KV, COMPILED_SAVED_I, COMPILED_FP32_NORMS = 6, 2, 3, 2
# The same for a compiled block whose linear layers compute in float8 (``wrap(fp8=...)``, tensorwise or rowwise): the
# compiler saves neither the float8 casts nor the 16-bit inputs of the output and down projections, which it
# recomputes with the casts; counted the same way at the 1B and 8B shapes.
FLOAT8_SAVED_H, FLOAT8_SAVED_I = 4, 2
# Cross-entropy bytes per token and vocabulary entry at the peak of the loss's backward (see the Note).
LOSS_BYTES = 12


def _config_int(model: nn.Module, *names: str) -> Optional[int]:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for attr in names:
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    return None


def _vocab_size(model: nn.Module) -> Optional[int]:
    """Rows of the output embedding (the logits' width) of a language model, else ``None``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


class LayerBytes(NamedTuple):
    """One layer's activations in bytes, for a number of tokens."""

    hidden: int  # the hidden size
    kept: int  # what the layer saves for backward
    kept_float8: int  # the same with its linear layers in float8
    running: int  # its recomputation and backward, at their peak


def layer_bytes(model: nn.Module, tokens: int, size: int, compiled: bool) -> Optional[LayerBytes]:
    """One layer's activations for ``tokens`` tokens of ``size``-byte values (see [Note: memory estimate] in
    ``plan.py``); ``None`` when the config names no hidden size."""
    hidden = _config_int(model, "hidden_size", "d_model", "n_embd", "dim")
    if hidden is None:
        return None
    inner = _config_int(model, "intermediate_size", "ffn_dim", "d_ff", "n_inner") or 4 * hidden
    if not compiled:
        kept = tokens * size * (LAYER_SAVED_H * hidden + LAYER_SAVED_I * inner)
        # While it runs, also its norms' fp32 values; twice (the activations and their gradients).
        return LayerBytes(hidden, kept, kept, 2 * (kept + tokens * 4 * LAYER_FP32_H * hidden))
    heads = _config_int(model, "num_attention_heads", "n_head", "num_heads") or 0
    kv_width = hidden
    if heads:
        head_dim = _config_int(model, "head_dim") or hidden // heads
        kv_width = (_config_int(model, "num_key_value_heads") or heads) * head_dim
    fp32 = tokens * 4 * (heads + COMPILED_FP32_NORMS)
    kept = tokens * size * (COMPILED_SAVED_H * hidden + COMPILED_SAVED_KV * kv_width + COMPILED_SAVED_I * inner) + fp32
    float8 = tokens * size * (FLOAT8_SAVED_H * hidden + COMPILED_SAVED_KV * kv_width + FLOAT8_SAVED_I * inner) + fp32
    return LayerBytes(hidden, kept, float8, kept)


def loss_bytes(model: nn.Module, tokens: int, hidden: int, size: int, fused_loss: bool) -> int:
    """The LM head's loss at its peak (see [Note: memory estimate]); 0 for a model without an output embedding."""
    vocab = _vocab_size(model)
    if not vocab:
        return 0
    head = adapter_for(model).loss_head(model) if fused_loss else None
    if head is None:
        return LOSS_BYTES * tokens * vocab
    weight_grad = head.weight.numel() * 4 if head.weight.requires_grad else 0
    return min(tokens, CHUNK_SIZE) * vocab * size + weight_grad + tokens * hidden * size
