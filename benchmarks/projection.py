"""A model (not a measurement) of a training step's time at 8, 64 and 512 GPUs, flat and hybrid sharding.

    python benchmarks/projection.py [--measured RESULT.json] [--inter-gbs 45] [--gpus-per-node 8]

Its inputs are measured on 2 GPUs by ``train_llama.py --profile`` (the defaults below are the 8B at 2 x 4096
tokens per GPU on two H100s, compiled blocks, ``checkpoint="auto"``: ``benchmarks/RESULTS.md``, "Hybrid
sharding"): the step time, the communication kernels' time and the share of it compute hid, and the bytes each
collective sent per step (``traffic_per_step``). From those:

- the bytes a step gathers and reduces at full size: each rank of a ring of g ranks sends ``(g - 1) / g`` of
  a buffer, so at 2 GPUs the full size is twice what was sent;
- the compute alone: the step less the communication compute did not hide;
- the bandwidth inside a node: what the measured kernels achieved (bytes sent / kernel time, which counts
  waiting too: a floor). Between nodes an assumed ``--inter-gbs`` per GPU (400 Gb/s InfiniBand per GPU
  gives about 45 GB/s of ring bandwidth).

Flat sharding over N GPUs on several nodes runs every gather and reduce-scatter as a ring across the nodes,
at the inter-node rate. Hybrid sharding (one node's GPUs per shard group) gathers and reduce-scatters inside
the node and all-reduces each rank's gradient shard (``1 / gpus_per_node`` of the gradient) across the nodes.
The step is the compute plus the communication that compute does not hide: the measured share ``h`` of it
while it is shorter than the compute, and everything beyond the compute when it is longer. Prints a Markdown
table and ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict

# 8B, 2 x 4096 tokens per GPU, 2 x H100 80 GB HBM3, compiled blocks, checkpoint="auto" (12 of 32 blocks kept).
MEASURED_8B_2XH100 = {
    "world": 2, "tokens_per_gpu": 8192, "step_s": 0.8952,
    "traffic_per_step": {"all-gather": {"calls": 64, "gb": 14.792}, "reduce-scatter": {"calls": 33, "gb": 8.03}},
    "comm_s": 0.2022, "comm_hidden_pct": 93.8,
    "comm_by_kind": {"AllGather": {"s": 0.0855}, "ReduceScatter": {"s": 0.1166}},
}


def project(measured: Dict[str, Any], gpus: int, per_node: int, inter_gbs: float, hybrid: bool) -> Dict[str, Any]:
    world = measured["world"]
    ring = (world - 1) / world
    gather_gb = measured["traffic_per_step"]["all-gather"]["gb"] / ring  # full-size bytes gathered per step
    reduce_gb = measured["traffic_per_step"]["reduce-scatter"]["gb"] / ring
    intra_ag = measured["traffic_per_step"]["all-gather"]["gb"] / measured["comm_by_kind"]["AllGather"]["s"]
    intra_rs = measured["traffic_per_step"]["reduce-scatter"]["gb"] / measured["comm_by_kind"]["ReduceScatter"]["s"]
    hidden = measured["comm_hidden_pct"] / 100
    compute = measured["step_s"] - (1 - hidden) * measured["comm_s"]
    nodes = max(1, gpus // per_node)
    if hybrid or nodes == 1:
        shard = min(gpus, per_node)
        inside = (shard - 1) / shard
        comm = gather_gb * inside / intra_ag + reduce_gb * inside / intra_rs
        replicas = gpus // shard
        across_gb = 2 * (replicas - 1) / replicas * reduce_gb / shard  # all-reduce of the gradient shard
        comm += across_gb / inter_gbs
        sent_inter = across_gb
    else:  # every ring crosses the nodes: the slowest link sets the pace
        sent_inter = (gather_gb + reduce_gb) * (gpus - 1) / gpus
        comm = sent_inter / inter_gbs
    exposed = (1 - hidden) * comm if comm <= compute else comm - hidden * compute
    step = compute + exposed
    return {"gpus": gpus, "layout": "hybrid" if hybrid else "flat", "inter_node_gb_per_gpu": round(sent_inter, 2),
            "comm_s": round(comm, 3), "compute_s": round(compute, 3), "step_s": round(step, 3),
            "tok_s_gpu": round(measured["tokens_per_gpu"] / step), "vs_2_gpus": round(measured["step_s"] / step, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measured", help="a train_llama.py RESULT line's JSON (2 GPUs, --profile); default: the "
                                           "8B on two H100s")
    parser.add_argument("--inter-gbs", type=float, default=45.0, help="ring bandwidth between nodes per GPU, GB/s")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    args = parser.parse_args()
    measured = MEASURED_8B_2XH100
    if args.measured:
        with open(args.measured) as f:
            measured = json.loads(f.read().removeprefix("RESULT "))
        measured.setdefault("tokens_per_gpu", measured["batch"] * measured["seq"])
    rows = [project(measured, gpus, args.gpus_per_node, args.inter_gbs, hybrid)
            for gpus in (8, 64, 512) for hybrid in ((False,) if gpus <= args.gpus_per_node else (False, True))]
    print("| GPUs | layout | bytes between nodes per GPU and step | communication | compute | step | tokens/s/GPU |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['gpus']} | {r['layout']} | {r['inter_node_gb_per_gpu']} GB | {r['comm_s']} s | {r['compute_s']} s | "
              f"{r['step_s']} s | {r['tok_s_gpu']:,} |")
    print("RESULT " + json.dumps({"inter_gbs": args.inter_gbs, "gpus_per_node": args.gpus_per_node, "rows": rows}))


if __name__ == "__main__":
    main()
