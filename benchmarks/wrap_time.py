"""How long do ``bmtwrap.plan`` and ``bmtwrap.wrap`` take on a Llama-3-8B-shaped model?

    python benchmarks/wrap_time.py              # a world of one, on this machine's device
    torchrun --nproc_per_node=2 benchmarks/wrap_time.py

The model is built on the meta device (no weights), as one would before loading a checkpoint.
Prints ``RESULT {json}`` with the seconds of each phase (target: under 2 s each).
"""

from __future__ import annotations

import json
import time

import torch
import transformers

import bmtwrap as bmt


def llama_8b() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        tie_word_embeddings=False,
    )


def main() -> None:
    bmt.init_distributed(seed=0)
    config = llama_8b()
    start = time.perf_counter()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    built = time.perf_counter()
    plan = bmt.plan(model)
    planned = time.perf_counter()
    bmt.wrap(model)
    bmt.synchronize()
    wrapped = time.perf_counter()
    bmt.print_rank("RESULT " + json.dumps({
        "what": "wrap_time", "model": "llama-8b", "world": bmt.world_size(),
        "device": str(bmt.engine.dist.current().device),
        "params": sum(g.params for g in (plan.root, *plan.blocks)), "blocks": len(plan.blocks),
        "build_meta_s": round(built - start, 3), "plan_s": round(planned - built, 3),
        "wrap_s": round(wrapped - planned, 3),
    }))


if __name__ == "__main__":
    main()
