"""Hybrid sharding (``BMTWRAP_SHARD_SIZE`` set by the test): the layout, replicas that stay identical, the
gradient's norm and the non-finite check over every shard once, and a wrapped Llama against the unwrapped one."""

from __future__ import annotations

import copy
import math
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import transformers

import bmtwrap as bmt
from bmtwrap.optim.nonfinite import any_nonfinite
from bmtwrap.optim.optim_manager import grad_norm
from common import flat_buffers, max_abs_diff, max_rel, run
from gpt_model import GPT, ShardedGPT

CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def every_rank(value: Any) -> List[Any]:
    out: List[Any] = [None] * bmt.world_size()
    dist.all_gather_object(out, value)
    return out


def topology() -> Dict[str, Any]:
    ctx = bmt.init_distributed()
    model = ShardedGPT()
    layouts = {buffer.layout.world_size for buffer in flat_buffers(model)}
    zero = bmt.config["zero_comm"]
    total = torch.tensor([ctx.rank + 1.0])
    bmt.nccl.allReduce(total.storage(), total.storage(), "sum", zero)  # BMTrain's ZeRO group: the shard group
    return {"zero_comm": every_rank([list(zero.ranks), zero.rank, total.item()]),"world": ctx.world_size, "shard_size": ctx.shard_size, "replicas": ctx.replicas,
            "ranks": every_rank([ctx.rank, ctx.shard_rank, bmt.config["zero_rank"], bmt.rank(), bmt.world_size()]),
            "layout_shards": sorted(layouts)}


def _shares(batch: torch.Tensor) -> torch.Tensor:
    share = batch.shape[0] // bmt.world_size()
    return batch[bmt.rank() * share : (bmt.rank() + 1) * share]


OPTIMIZERS = {
    "torch": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adam": lambda params: bmt.optim.AdamOptimizer(params, lr=1e-3),
    "offload": lambda params: bmt.optim.AdamOffloadOptimizer(params, lr=1e-3),
    "offload_in_backward": lambda params: bmt.optim.AdamOffloadOptimizer(params, lr=1e-3, step_in_backward=True),
}


def replicas_identical(optimizer: str, offload_params: bool = False) -> Dict[str, Any]:
    """After 3 steps on different data per rank, the ranks of one replica group hold the same shards, the same
    gradient shards and the same optimizer state, bit for bit."""
    torch.manual_seed(1234)
    model = ShardedGPT(offload_params=offload_params)
    opt = OPTIMIZERS[optimizer](model.parameters())
    data = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(7))
    for _ in range(3):
        opt.zero_grad()
        model.loss(_shares(data)).backward()
        opt.step()
    model.loss(_shares(data)).backward()  # gradients to compare too
    ctx = bmt.init_distributed()
    buffers = flat_buffers(model)
    for buffer in buffers:
        buffer.wait_writes()  # step_in_backward: the last backward's updates may still be on their way
    mine = [buffer.local.detach().clone().cpu() for buffer in buffers]
    mine += [p.grad.detach().clone().cpu() for p in model.parameters() if p.grad is not None]
    for state in opt.state_dict()["state"].values():
        mine += [v.detach().clone().cpu() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    everyone = every_rank(mine)
    groups = [[r for r in range(ctx.world_size) if r % ctx.shard_size == s] for s in range(ctx.shard_size)]
    same = all(len(everyone[r]) == len(everyone[g[0]]) and all(torch.equal(a, b) for a, b in
                                                                 zip(everyone[r], everyone[g[0]]))
               for g in groups for r in g)
    # Pieces of different ranks of one shard group differ (the test would not notice a missing shard otherwise).
    distinct = ctx.shard_size == 1 or not all(torch.equal(a, b) for a, b in zip(everyone[0], everyone[1]))
    return {"replicas_equal": same, "tensors": len(mine), "shards_distinct": distinct}


def norms_and_nonfinite() -> Dict[str, Any]:
    """grad_norm (2 and inf) against torch's over the unwrapped model's full gradient; a NaN in one rank's
    gradient is seen by every rank."""
    torch.manual_seed(1234)
    ref = GPT()
    torch.manual_seed(1234)
    model = ShardedGPT()
    data = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(7))
    ref.loss(data).backward()
    model.loss(_shares(data)).backward()
    out: Dict[str, Any] = {}
    for p in (2.0, math.inf):
        want = torch.nn.utils.get_total_norm([q.grad for q in ref.parameters()], p).item()
        got = grad_norm(list(model.parameters()), p).item()
        out[f"norm_{p}_rel"] = max_rel(got, want)
    clean = any_nonfinite(list(model.parameters()))
    if bmt.rank() == bmt.world_size() - 1:
        next(p for p in model.parameters() if p.grad is not None and p.grad.numel()).grad.view(-1)[0] = math.nan
    out["nonfinite_seen"] = every_rank(any_nonfinite(list(model.parameters())))
    out["clean_seen"] = clean
    return out


def wrapped_llama() -> Dict[str, Any]:
    """A wrapped HF Llama trains like the unwrapped one (5 steps, torch AdamW), and generates the same tokens."""
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model = bmt.wrap(copy.deepcopy(ref))
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=1e-3), torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 96, (8, 12), generator=torch.Generator().manual_seed(3))
    rels = []
    for _ in range(5):
        opt_ref.zero_grad()
        opt.zero_grad()
        want = ref(data, labels=data).loss
        want.backward()
        mine = _shares(data)
        got = model(mine, labels=mine).loss
        got.backward()
        opt_ref.step()
        opt.step()
        rels.append(max_rel(bmt.sum_loss(got).item(), want.item()))
    result = max_abs_diff(bmt.full_state_dict(model), ref.state_dict())
    prompt = data[:1, :4]
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    result.update(loss_max_rel=max(rels),
                  generate_equal=torch.equal(model.eval().generate(prompt, **kwargs), ref.eval().generate(prompt, **kwargs)))
    return result


if __name__ == "__main__":
    run({
        "topology": topology,
        "replicas_torch": lambda: replicas_identical("torch"),
        "replicas_adam": lambda: replicas_identical("adam"),
        "replicas_offload": lambda: replicas_identical("offload"),
        "replicas_offload_params_in_backward": lambda: replicas_identical("offload_in_backward", offload_params=True),
        "norms_and_nonfinite": norms_and_nonfinite,
        "wrapped_llama": wrapped_llama,
    })
