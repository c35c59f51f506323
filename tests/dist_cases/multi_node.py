"""Training across "nodes": the same program under one torchrun agent or several (a c10d rendezvous).

Writes, from global rank 0, the losses of a few AdamW steps of a wrapped Llama (each rank on its own
slice of every batch), a digest of every parameter after them, and what each rank saw of its place
(global rank, local rank, node). The pytest side runs it as 1 agent x 4 processes and as 2 agents x 2
processes and compares.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any, Dict

import torch
import transformers

import bmtwrap as bmt

STEPS = 4


def train() -> Dict[str, Any]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = bmt.wrap(transformers.LlamaForCausalLM(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    world, rank = bmt.world_size(), bmt.rank()
    data = torch.randint(0, 96, (STEPS, 2 * world, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(STEPS):
        batch = data[step, 2 * rank : 2 * rank + 2]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(bmt.sum_loss(loss).item())
    full = bmt.full_state_dict(model)
    digest = {name: [value.double().sum().item(), value.double().abs().sum().item()] for name, value in full.items()}
    return {"losses": losses, "digest": digest}


def where() -> Dict[str, Any]:
    """Every rank's (global rank, local rank, node rank as torchrun gives it, host)."""
    mine = [bmt.rank(), int(os.environ["LOCAL_RANK"]), int(os.environ.get("GROUP_RANK", -1)), socket.gethostname()]
    every = [None] * bmt.world_size()
    torch.distributed.all_gather_object(every, mine)
    ctx = bmt.init_distributed()
    return {"ranks": every, "shard_size": ctx.shard_size, "zero_rank": bmt.config["zero_rank"]}


if __name__ == "__main__":
    bmt.init_distributed(seed=0)
    results = {"train": train(), "where": where()}
    if bmt.rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    torch.distributed.destroy_process_group()
