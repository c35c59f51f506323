"""A small GPT written with bmtwrap's building blocks, buildable sharded or as plain torch.

The same class gives the reference (``sharded=False``: nn.Parameter, nn.ModuleList, no bmtwrap at
all) and the model under test (``sharded=True``: DistributedParameter, Block,
TransformerBlockList), with identical initial values for the same seed.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import bmtwrap as bmt


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # a key bias has zero gradient: Adam would amplify its rounding noise
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class Layer(nn.Module):
    """Pre-norm transformer layer; ``scale`` and ``mask`` arrive as keyword arguments."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, *, mask: Optional[torch.Tensor] = None, scale: float = 1.0) -> torch.Tensor:
        x = x + scale * self.attn(self.ln1(x), mask)
        return x + scale * self.mlp(self.ln2(x))


class TripleLayer(nn.Module):
    """A layer with three hidden streams (``num_hidden=3``): mixes them and returns all three."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.layer = Layer(dim, heads)
        self.mix = nn.Linear(dim, dim, bias=False)

    def forward(self, x, y, z, mask=None):
        x = self.layer(x, mask=mask)
        return x, y + torch.tanh(self.mix(x)), z * 0.5 + x


class GPT(nn.Module):
    """Token + position embeddings, ``layers`` blocks, final norm, LM head tied to the embedding."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 3, seq: int = 16, *,
                 sharded: bool = False, use_checkpoint: bool = True, zero_level: int = 3,
                 triple: bool = False, frozen_first_layer: bool = False, dtype: Optional[torch.dtype] = None,
                 device: Optional[str] = None, offload_params: bool = False) -> None:
        super().__init__()
        self.triple = triple
        # Values are drawn in fp32 on the CPU, then cast and moved: the same numbers for every dtype and
        # device, before anything is sharded.
        embed = (torch.randn(vocab, dim) * 0.02).to(device, dtype)
        pos = (torch.randn(seq, dim) * 0.02).to(device, dtype)
        gate = torch.ones(1).to(device, dtype)  # one element: smaller than the world, so some ranks own none of it
        layer_cls = TripleLayer if triple else Layer
        stack = [layer_cls(dim, heads).to(device, dtype) for _ in range(layers)]
        if frozen_first_layer:
            stack[0].requires_grad_(False)
        self.ln_f = nn.LayerNorm(dim).to(device, dtype)
        if sharded:
            self.embed = bmt.DistributedParameter(embed)
            self.pos = bmt.DistributedParameter(pos)
            self.gate = bmt.DistributedParameter(gate)
            blocks = [bmt.Block(layer, use_checkpoint=use_checkpoint, zero_level=zero_level,
                                offload_params=offload_params) for layer in stack]
            self.layers = bmt.TransformerBlockList(blocks, num_hidden=3 if triple else 1)
        else:
            self.embed = nn.Parameter(embed)
            self.pos = nn.Parameter(pos)
            self.gate = nn.Parameter(gate)
            self.layers = nn.ModuleList(stack)
        self.sharded = sharded

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        h = (F.embedding(ids, self.embed) + self.pos[:t]) * self.gate  # (B, T, C)
        if self.triple:
            hidden = (h, torch.zeros_like(h), h * 0.1)
            if self.sharded:
                hidden = self.layers(*hidden, mask)
            else:
                for layer in self.layers:
                    hidden = layer(*hidden, mask)
            h = hidden[0] + hidden[1] + hidden[2]
        elif self.sharded:
            h = self.layers(h, mask=mask, scale=0.9)
        else:
            for layer in self.layers:
                h = layer(h, mask=mask, scale=0.9)
        return self.ln_f(h) @ self.embed.T  # (B, T, vocab), tied head

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class ShardedGPT(GPT, bmt.DistributedModule):
    """The same model as a DistributedModule, so that its root parameters are gathered per forward."""

    def __init__(self, **kwargs) -> None:
        super().__init__(sharded=True, **kwargs)
