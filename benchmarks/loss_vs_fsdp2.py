"""The loss of a bmtwrap run beside FSDP2 runs of the same model, initial weights, data and optimizer.

    torchrun --nproc_per_node=N benchmarks/loss_vs_fsdp2.py --size 1b --batch 8 --seq 2048 --steps 50

Three runs in one process, one after the other, each with full activation checkpointing and Adam
(lr ``--lr``, no weight decay):
- ``bmtwrap``: ``wrap(model)`` of bf16 parameters, ``AdamOptimizer`` (fp32 master and moments);
- ``fsdp2``: ``fully_shard`` per decoder layer and the root, fp32 parameters, bf16 compute, fp32
  gradient reduction, torch's fused AdamW;
- ``fsdp2_eager``: the same FSDP2 run with the attention computed by the eager kernel instead of
  SDPA. Both FSDP2 runs are the same mathematics; their distance is the scale of bf16 rounding noise
  for this model and data, against which bmtwrap's distance from ``fsdp2`` is read.

All start from the same weights (initialised once, rounded to bf16 so that the bf16 model holds
them exactly) and see the same batches: sequences of a fixed random Markov chain over 1,024 of the
vocabulary's tokens, each with 4 possible successors, so the loss falls from about ln(vocabulary)
towards ln(4) during the run. With N processes each takes its slice of every global batch of
``N * --batch`` sequences. Under hybrid sharding (``BMTWRAP_SHARD_SIZE``, or several nodes) the FSDP2 runs
shard in groups of the same size (HSDP). Prints one line, ``RESULT {json}``: every run's loss per step (the mean over
ranks) and the distances.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable, Dict, Iterator, List

import torch
import torch.distributed as dist
import transformers

import bmtwrap as bmt
from fsdp2_peer import hybrid_mesh
from train_llama import SIZES

STATES = 1024  # tokens the Markov chain visits
SUCCESSORS = 4  # possible next tokens of each


def markov_batches(steps: int, rows: int, seq: int, vocab: int, seed: int = 1234) -> Iterator[torch.Tensor]:
    """``steps`` global batches of ``rows`` sequences of token ids, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    token_of_state = torch.randperm(vocab, generator=g)[:STATES]
    successor = torch.randint(0, STATES, (STATES, SUCCESSORS), generator=g)
    for step in range(steps):
        g = torch.Generator().manual_seed(seed + 1 + step)
        choice = torch.randint(0, SUCCESSORS, (rows, seq), generator=g)
        states = torch.empty(rows, seq, dtype=torch.long)
        states[:, 0] = torch.randint(0, STATES, (rows,), generator=g)
        for t in range(1, seq):
            states[:, t] = successor[states[:, t - 1], choice[:, t]]
        yield token_of_state[states]


def reference_weights(config: transformers.LlamaConfig, device: torch.device) -> Dict[str, torch.Tensor]:
    """The initial weights every run starts from: transformers' initialisation under seed 0, rounded to bf16."""
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    weights = {name: t.detach().to(torch.bfloat16).cpu() for name, t in model.state_dict().items()}
    del model
    torch.cuda.empty_cache()
    return weights


def new_model(config: transformers.LlamaConfig, weights: Dict[str, torch.Tensor], dtype: torch.dtype,
              device: torch.device) -> torch.nn.Module:
    # Built where it runs (not on the meta device): the rotary embedding's buffers are computed at build, in
    # fp32, and stay so (as from_pretrained(dtype=torch.bfloat16) leaves them); only the parameters take dtype.
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model.load_state_dict({name: t.float() for name, t in weights.items()})
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model.train()


def train(run: Callable[[torch.Tensor], torch.Tensor], batches: List[torch.Tensor], rank: int,
          world: int, device: torch.device) -> List[float]:
    """The loss of each step, averaged over the ranks."""
    losses = []
    for ids in batches:
        rows = ids.shape[0] // world
        loss = run(ids[rank * rows : (rank + 1) * rows].to(device)).detach().float()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses


def bmtwrap_run(config, weights, batches, lr, rank, world, device) -> List[float]:
    model = bmt.wrap(new_model(config, weights, torch.bfloat16, device), checkpoint=True)  # compiled on GPUs
    optimizer = bmt.optim.AdamOptimizer(model.parameters(), lr=lr, weight_decay=0.0)

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return train(step, batches, rank, world, device)


def fsdp2_run(config, weights, batches, lr, rank, world, device) -> List[float]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = new_model(config, weights, torch.float32, device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = hybrid_mesh(bmt.init_distributed().shard_size, device.type)  # HSDP where bmtwrap shards in groups
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy, mesh=mesh)
    fully_shard(model, mp_policy=policy, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return train(step, batches, rank, world, device)


def distance(a: List[float], b: List[float]) -> Dict[str, float]:
    gaps = [abs(x - y) for x, y in zip(a, b)]
    last = gaps[-10:]
    return dict(max_abs=round(max(gaps), 4), mean_abs_last_10=round(sum(last) / len(last), 4),
                final_rel=round(gaps[-1] / abs(b[-1]), 4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="1b", choices=sorted(SIZES))
    parser.add_argument("--batch", type=int, default=8, help="sequences per GPU and step")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args()

    ctx = bmt.init_distributed(seed=0)
    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    configs = {attention: transformers.LlamaConfig(max_position_embeddings=max(args.seq, 128),
                                                   attn_implementation=attention, **SIZES[args.size])
               for attention in ("sdpa", "eager")}
    weights = reference_weights(configs["sdpa"], device)
    batches = list(markov_batches(args.steps, args.batch * world, args.seq, configs["sdpa"].vocab_size))
    losses, seconds = {}, {}
    for name, run, attention in (("bmtwrap", bmtwrap_run, "sdpa"), ("fsdp2", fsdp2_run, "sdpa"),
                                 ("fsdp2_eager", fsdp2_run, "eager")):
        start = time.perf_counter()
        losses[name] = run(configs[attention], weights, batches, args.lr, rank, world, device)
        seconds[name] = round(time.perf_counter() - start, 1)
        torch.cuda.empty_cache()
    bmt.print_rank("RESULT " + json.dumps(dict(
        size=args.size, world=world, batch=args.batch, seq=args.seq, steps=args.steps, lr=args.lr,
        first_loss={k: round(v[0], 4) for k, v in losses.items()},
        final_loss={k: round(v[-1], 4) for k, v in losses.items()},
        bmtwrap_vs_fsdp2=distance(losses["bmtwrap"], losses["fsdp2"]),
        noise_fsdp2_eager_vs_fsdp2=distance(losses["fsdp2_eager"], losses["fsdp2"]),
        seconds=seconds, losses={k: [round(x, 4) for x in v] for k, v in losses.items()},
    )), flush=True)


if __name__ == "__main__":
    main()
