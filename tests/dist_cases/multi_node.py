"""Training across "nodes": the same program under one torchrun agent or several (a c10d rendezvous).

Writes, from global rank 0, the losses of a few AdamW steps of a wrapped Llama (each rank on its own
slice of every batch) and a digest of every parameter after them; the same of ``bmtwrap.hf.Trainer``
(which joins the job itself, as a Trainer program does: it runs first); and what each rank saw of its
place (global rank, local rank, node). The pytest side runs it as 1 agent x 4 processes and as 2
agents x 2 processes and compares.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any, Dict

import torch
import transformers

import bmtwrap as bmt

from bmtwrap.hf import Trainer

STEPS = 4
CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def digest(model: torch.nn.Module) -> Dict[str, Any]:
    return {name: [value.double().sum().item(), value.double().abs().sum().item()]
            for name, value in bmt.full_state_dict(model).items()}


def trainer(out: Path) -> Dict[str, Any]:
    """``bmtwrap.hf.Trainer`` for a few steps of 2 sequences per rank: the losses it logs, and the digest."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    ids = torch.randint(0, 96, (32, 16), generator=torch.Generator().manual_seed(2))
    args = transformers.TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, max_steps=STEPS,
                                          logging_steps=1, learning_rate=1e-2, seed=3, use_cpu=True, report_to=[],
                                          disable_tqdm=True, save_strategy="no")
    run = Trainer(model=model, args=args, train_dataset=[{"input_ids": row, "labels": row} for row in ids])
    run.train()
    return {"losses": [entry["loss"] for entry in run.state.log_history if "loss" in entry],
            "digest": digest(run.model)}


def train() -> Dict[str, Any]:
    torch.manual_seed(0)
    model = bmt.wrap(transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)))
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
    return {"losses": losses, "digest": digest(model)}


def where() -> Dict[str, Any]:
    """Every rank's (global rank, local rank, node rank as torchrun gives it, host)."""
    mine = [bmt.rank(), int(os.environ["LOCAL_RANK"]), int(os.environ.get("GROUP_RANK", -1)), socket.gethostname()]
    every = [None] * bmt.world_size()
    torch.distributed.all_gather_object(every, mine)
    ctx = bmt.init_distributed()
    return {"ranks": every, "shard_size": ctx.shard_size, "zero_rank": bmt.config["zero_rank"]}


if __name__ == "__main__":
    transformers.logging.set_verbosity_error()
    results = {"trainer": trainer(Path(sys.argv[1]).with_suffix(".trainer"))}
    results.update(train=train(), where=where())
    if bmt.rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    torch.distributed.destroy_process_group()
    gc.freeze()  # the exit need not collect garbage over every loaded object (2 s a rank on two cores)
