"""Does communication overlap computation? A profiler trace of bmtwrap blocks on CUDA GPUs.

    torchrun --nproc_per_node=2 benchmarks/overlap_trace.py --out trace_dir

Trains a stack of ``nn.TransformerEncoderLayer`` blocks (bf16, checkpointed, ZeRO-3) for a few
steps, profiles two of them on rank 0 and reads the trace: every NCCL kernel is attributed to
the bmtwrap collective that launched it (through the ``bmtwrap.all_gather:<block>`` ranges),
and the time it shares with compute kernels on other streams is measured. The same model is then
timed under FSDP2 (``fully_shard`` per layer, the same checkpointing) in the same run.

Prints ``RESULT {json}`` lines: the overlap summary, and the step times of both systems.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from bisect import bisect_right
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import bmtwrap as bmt


class Model(nn.Module):
    """Embedding → ``layers`` encoder layers (causal) → tied LM head."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, *, sharded: bool) -> None:
        super().__init__()
        stack = [nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True,
                                            device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        embed = torch.randn(vocab, dim, device="cuda", dtype=torch.bfloat16) * 0.02
        if sharded:
            self.embed = bmt.DistributedParameter(embed)
            self.layers = bmt.TransformerBlockList([bmt.Block(layer) for layer in stack])
        else:
            self.embed = nn.Parameter(embed)
            self.layers = nn.ModuleList(stack)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = F.embedding(ids, self.embed)  # (B, T, C)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device, dtype=h.dtype)
        if isinstance(self.layers, bmt.TransformerBlockList):
            h = self.layers(h, src_mask=mask, is_causal=True)
        else:
            for layer in self.layers:
                h = layer(h, src_mask=mask, is_causal=True)
        logits = h @ self.embed.T  # (B, T, vocab)
        return F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())


class ShardedModel(Model, bmt.DistributedModule):
    pass


def step_times(model: nn.Module, ids: torch.Tensor, steps: int, warmup: int = 2) -> List[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def overlap(intervals: List[Tuple[float, float]], busy: List[Tuple[float, float]]) -> float:
    """Time of ``intervals`` covered by the union of ``busy`` (both lists of (start, end))."""
    merged: List[List[float]] = []
    for s, e in sorted(busy):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    starts = [m[0] for m in merged]
    total = 0.0
    for s, e in intervals:
        i = max(0, bisect_right(starts, s) - 1)
        while i < len(merged) and merged[i][0] < e:
            total += max(0.0, min(e, merged[i][1]) - max(s, merged[i][0]))
            i += 1
    return total


def analyse(trace: Dict[str, Any]) -> Dict[str, Any]:
    events = trace["traceEvents"]
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith("bmtwrap.")]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    kernels = [e for e in events if e.get("cat") == "kernel"]

    def enclosing(launch: Dict[str, Any], prefix: str) -> str:
        inside = [r for r in ranges if r["name"].startswith(prefix) and r["tid"] == launch["tid"]
                  and r["ts"] <= launch["ts"] <= r["ts"] + r["dur"]]
        return min(inside, key=lambda r: r["dur"])["name"].split(":", 1)[1] if inside else ""

    compute, collectives = [], []
    for k in kernels:
        span = (k["ts"], k["ts"] + k["dur"])
        if "nccl" in k["name"].lower():
            launch = launches.get(k["args"].get("correlation"))
            kind = "all_gather" if "allgather" in k["name"].lower() else (
                "reduce_scatter" if "reducescatter" in k["name"].lower() else "other")
            group = enclosing(launch, f"bmtwrap.{kind}:") if launch else ""
            collectives.append({"kind": kind, "group": group, "span": span})
        else:
            launch = launches.get(k["args"].get("correlation"))
            block = enclosing(launch, "bmtwrap.forward:") if launch else ""
            compute.append((span, block))

    busy = [span for span, _ in compute]
    summary: Dict[str, Any] = {}
    for kind in ("all_gather", "reduce_scatter"):
        spans = [c["span"] for c in collectives if c["kind"] == kind]
        total = sum(e - s for s, e in spans)
        summary[kind] = {"count": len(spans), "total_ms": total / 1e3,
                         "overlapped_fraction": overlap(spans, busy) / total if total else 0.0}
    # Forward: which block computed while each block's parameters were gathered.
    forward_pairs = []
    for c in collectives:
        if c["kind"] != "all_gather" or not c["group"]:
            continue
        s, e = c["span"]
        during = {}
        for (cs, ce), block in compute:
            if block and cs < e and ce > s:
                during[block] = during.get(block, 0.0) + min(e, ce) - max(s, cs)
        busiest = max(during, key=during.get) if during else ""
        forward_pairs.append({"gather": c["group"], "ms": (e - s) / 1e3,
                              "overlapped_by": busiest, "overlap_ms": during.get(busiest, 0.0) / 1e3})
    summary["gathers"] = forward_pairs
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    bmt.init_distributed(seed=0)
    rank, world = bmt.rank(), bmt.world_size()
    vocab = 32000
    ids = torch.randint(0, vocab, (args.batch, args.seq), device="cuda")
    tokens = args.batch * args.seq

    model = ShardedModel(vocab, args.dim, args.layers, heads=args.dim // 128, sharded=True)
    ours = step_times(model, ids, args.steps)
    torch.cuda.reset_peak_memory_stats()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(2):
            model(ids).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
    peak_ours = torch.cuda.max_memory_allocated() / 2**30
    if rank == 0:
        path = os.path.join(args.out, "trace_rank0.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            summary = analyse(json.load(f))
        gathers = summary.pop("gathers")
        for g in gathers[: 2 * args.layers + 2]:
            print(f"all_gather[{g['gather']}] {g['ms']:.2f} ms, overlapped by forward of "
                  f"{g['overlapped_by'] or '-'} for {g['overlap_ms']:.2f} ms")
        print("RESULT " + json.dumps({"what": "overlap", "world": world, **summary}))
    del model, opt
    torch.cuda.empty_cache()

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    ref = Model(vocab, args.dim, args.layers, heads=args.dim // 128, sharded=False)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for i, layer in enumerate(ref.layers):
        ref.layers[i] = fully_shard(checkpoint_wrapper(layer), mp_policy=policy)
    fully_shard(ref, mp_policy=policy)
    torch.cuda.reset_peak_memory_stats()
    theirs = step_times(ref, ids, args.steps)
    peak_fsdp = torch.cuda.max_memory_allocated() / 2**30
    if rank == 0:
        for name, times, peak in (("bmtwrap", ours, peak_ours), ("fsdp2", theirs, peak_fsdp)):
            median = statistics.median(times)
            print("RESULT " + json.dumps({"what": "step", "system": name, "world": world, "dim": args.dim,
                                          "layers": args.layers, "tokens_per_s_per_gpu": tokens / median,
                                          "step_s": median, "peak_gib": peak}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
