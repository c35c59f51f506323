"""A GPT trained by a program written only against BMTrain's documented API (its README and quick start).

It imports ``bmtrain``, never ``bmtwrap``: run it as ``torchrun -m bmtwrap.bmtrain bmtrain_program.py
OUT.json CHECKPOINT``. Each rank trains on its share of one global batch; rank 0 writes the losses, the
gradient norms and what loading the saved checkpoint gave. The test compares world sizes 1, 2, 3.
"""

import json
import sys

import torch
import torch.nn.functional as F

import bmtrain as bmt

VOCAB, DIM, HEADS, FF, LAYERS, SEQ, BATCH, STEPS = 96, 32, 4, 64, 3, 12, 6, 8


class LayerNorm(bmt.DistributedModule):
    def __init__(self, dim):
        super().__init__()
        self.weight = bmt.DistributedParameter(torch.empty(dim), init_method=torch.nn.init.ones_)
        self.bias = bmt.DistributedParameter(torch.empty(dim), init_method=torch.nn.init.zeros_)

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias)


class Attention(bmt.DistributedModule):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.project_qkv = bmt.nn.Linear(dim, 3 * dim)
        self.project_out = bmt.nn.Linear(dim, dim)

    def forward(self, x, mask):
        b, t, c = x.shape
        q, k, v = self.project_qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        score = torch.matmul(q, k.transpose(-1, -2)) / (c // self.heads) ** 0.5
        score = torch.where(mask, score, torch.full_like(score, float("-inf")))
        out = torch.matmul(torch.softmax(score, dim=-1), v)
        return self.project_out(out.transpose(1, 2).reshape(b, t, c))


class Feedforward(bmt.DistributedModule):
    def __init__(self, dim, ff):
        super().__init__()
        init = bmt.ParameterInitializer(torch.nn.init.normal_, mean=0.0, std=0.02)
        self.w_in = bmt.DistributedParameter(torch.empty(ff, dim), init_method=init)
        self.w_out = bmt.DistributedParameter(torch.empty(dim, ff), init_method=init)

    def forward(self, x):
        return F.linear(F.gelu(F.linear(x, self.w_in)), self.w_out)


class TransformerLayer(bmt.DistributedModule):
    def __init__(self, dim, heads, ff):
        super().__init__()
        self.ln_attn = LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln_ff = LayerNorm(dim)
        self.ff = Feedforward(dim, ff)

    def forward(self, hidden, mask):
        hidden = hidden + self.attn(self.ln_attn(hidden), mask)
        return hidden + self.ff(self.ln_ff(hidden))


class GPT(bmt.DistributedModule):
    def __init__(self):
        super().__init__()
        init = bmt.ParameterInitializer(torch.nn.init.normal_, std=0.02)
        self.word_emb = bmt.DistributedParameter(torch.empty(VOCAB, DIM), init_method=init)
        self.pos_emb = bmt.DistributedParameter(torch.empty(SEQ, DIM), init_method=init)
        self.layers = bmt.TransformerBlockList([
            bmt.CheckpointBlock(TransformerLayer(DIM, HEADS, FF)) for _ in range(LAYERS)
        ])
        self.norm = LayerNorm(DIM)

    def forward(self, ids, pos, mask):
        hidden = F.embedding(ids, self.word_emb) + F.embedding(pos, self.pos_emb)
        hidden = self.layers(hidden, mask)
        return F.linear(self.norm(hidden), self.word_emb)


def main():
    out_path, checkpoint = sys.argv[1], sys.argv[2]
    bmt.init_distributed(seed=0)
    model = GPT()
    bmt.init_parameters(model)

    loss_func = bmt.loss.FusedCrossEntropy(ignore_index=-100)
    optimizer = bmt.optim.AdamOptimizer(model.parameters(), weight_decay=1e-2)
    lr_scheduler = bmt.lr_scheduler.Noam(optimizer, start_lr=1e-2, warmup_iter=2, end_iter=100, num_iter=0)
    optim_manager = bmt.optim.OptimManager(loss_scale=2**10)
    optim_manager.add_optimizer(optimizer, lr_scheduler)

    # One global batch; each rank trains on its share of the sequences.
    torch.manual_seed(1234)
    sent = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    share = BATCH // bmt.world_size()
    mine = sent[bmt.rank() * share : (bmt.rank() + 1) * share]
    enc_input, targets = mine[:, :-1], mine[:, 1:]
    pos = torch.arange(SEQ).repeat(share, 1)
    mask = (pos[:, None, :] <= pos[:, :, None])[:, None]  # (batch, 1, seq, seq), causal

    losses, norms = [], []
    for iteration in range(STEPS):
        optim_manager.zero_grad()
        logits = model(enc_input, pos, mask)
        loss = loss_func(logits.view(-1, VOCAB), targets.reshape(-1))
        global_loss = bmt.sum_loss(loss).item()
        optim_manager.backward(loss)
        grad_norm = optim_manager.clip_grad_norm(optimizer.param_groups, max_norm=1.0)
        optim_manager.step()
        bmt.print_rank(f"| Iter: {iteration:4d} | loss: {global_loss:.4f} | lr: {lr_scheduler.current_lr:.4e} "
                       f"| scale: {optim_manager.loss_scale:.1f} | grad_norm: {float(grad_norm):.4f} |")
        losses.append(global_loss)
        norms.append(float(grad_norm))

    bmt.save(model, checkpoint)
    reloaded = GPT()
    bmt.load(reloaded, checkpoint)
    before = bmt.inspect.inspect_model(model, "*")
    after = bmt.inspect.inspect_model(reloaded, "*")
    same = [(a["name"], a["max"], a["min"], a["mean"]) == (b["name"], b["max"], b["min"], b["mean"])
            for a, b in zip(before, after)]
    bmt.synchronize()
    if bmt.rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "grad_norms": norms, "reloaded_equal": all(same) and len(same) == len(before),
                       "parameters": len(before)}, f)


if __name__ == "__main__":
    main()
