"""Train a small GPT with bmtwrap's building blocks, on a task it can learn in a few steps.

    torchrun --nproc_per_node=2 examples/train_gpt.py     # 2 processes (GPUs, or CPU over gloo)
    python examples/train_gpt.py --steps 5                # a world of one

The task: every sequence follows one fixed random permutation of the vocabulary
(x[t+1] = perm[x[t]]) from a random first token, so the next token is always predictable and the
loss falls from ln(vocab) towards zero. The parameters are sharded over all processes (ZeRO-3):
each transformer layer is a ``bmt.Block`` whose parameters are gathered just before it runs (the
next block's gather overlaps this block's compute) and whose gradients are reduce-scattered and
averaged over ranks in backward. Each rank trains on its own share of every batch.
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import bmtwrap as bmt

# -----------------------------------------------------------------------------
# the model


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class Layer(nn.Module):
    """Pre-norm transformer layer: x + attn(ln(x)), then x + mlp(ln(x)). Plain PyTorch."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))  # (B, T, C)


class GPT(bmt.DistributedModule):
    """Token and position embeddings, ``layers`` blocks, a final norm, an LM head tied to the embedding.

    The parameters outside the blocks are DistributedParameters too: they form the model's root
    group, gathered once per forward, so the tied embedding can be read twice.
    """

    def __init__(self, vocab: int, seq: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        normal = lambda std: (lambda t: nn.init.normal_(t, std=std))  # noqa: E731
        self.tok_emb = bmt.DistributedParameter(torch.empty(vocab, dim), init_method=normal(0.02))
        self.pos_emb = bmt.DistributedParameter(torch.empty(seq, dim), init_method=normal(0.02))
        self.layers = bmt.TransformerBlockList([bmt.Block(Layer(dim, heads)) for _ in range(layers)])
        self.ln_w = bmt.DistributedParameter(torch.ones(dim))
        self.ln_b = bmt.DistributedParameter(torch.zeros(dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        x = F.embedding(ids, self.tok_emb) + self.pos_emb[:T]  # (B, T, C)
        x = self.layers(x)  # (B, T, C)
        x = F.layer_norm(x, (x.shape[-1],), self.ln_w, self.ln_b)
        return x @ self.tok_emb.T  # (B, T, vocab)


# -----------------------------------------------------------------------------
# the data


def make_batch(perm: torch.Tensor, batch: int, seq: int, step: int) -> torch.Tensor:
    """(batch, seq + 1) token ids following ``perm``; the same on every rank for the same step."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.empty(batch, seq + 1, dtype=torch.long)
    ids[:, 0] = torch.randint(0, len(perm), (batch,), generator=g)
    for t in range(seq):
        ids[:, t + 1] = perm[ids[:, t]]
    return ids


# -----------------------------------------------------------------------------
# training


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="global batch, split over the ranks")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                        help="autocast dtype; auto: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    ctx = bmt.init_distributed(seed=args.seed)  # under torchrun: joins the job; alone: a world of one
    device = ctx.device  # cuda:<local rank>, or cpu
    rank, world = bmt.rank(), bmt.world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} processes")
    share = args.batch // world

    precision = args.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]

    model = GPT(args.vocab, args.seq, args.dim, args.heads, args.layers)
    bmt.init_parameters(model)  # fills the DistributedParameters that have an init_method
    n_params = sum(p.numel() for p in model.parameters())  # this rank's shard
    bmt.print_rank(f"{world} process(es) on {device.type}, {precision}; "
                   f"parameters per rank: {n_params:,} (~1/{world} of the model)")

    # Built after the model: the optimizer sees the sharded parameters and keeps 1/world of the state.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    manager = bmt.optim.OptimManager(loss_scale=2.0**15 if amp_dtype == torch.float16 else None)
    manager.add_optimizer(optimizer)

    perm = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(args.seed))
    bmt.print_rank(f"loss of a uniform guess: {math.log(args.vocab):.4f}")
    for step in range(args.steps):
        t0 = time.perf_counter()
        ids = make_batch(perm, args.batch, args.seq, step)[rank * share : (rank + 1) * share].to(device)
        x, y = ids[:, :-1], ids[:, 1:]  # (b, T) each, b = batch / world

        manager.zero_grad()
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(x)  # (b, T, vocab)
        loss = F.cross_entropy(logits.float().view(-1, args.vocab), y.reshape(-1))
        manager.backward(loss)  # gradients arrive reduce-scattered and averaged over ranks
        grad_norm = manager.clip_grad_norm(optimizer.param_groups, max_norm=1.0)
        manager.step()

        global_loss = bmt.sum_loss(loss).item()  # mean over ranks; also waits for this step's work
        dt = time.perf_counter() - t0
        bmt.print_rank(f"step {step:3d} | loss {global_loss:.4f} | grad norm {grad_norm.item():.3f} | "
                       f"{args.batch * args.seq / dt:,.0f} tokens/s")


if __name__ == "__main__":
    main()
