"""A 0.5B Llama in bf16 trained some steps on one GPU, in a process of its own (test_gpu.py's budget cases: a
budget and the allocator's cap hold for the whole process, and each case must start on an empty card).

Argument 2: the case as JSON: ``checkpoint``, ``max_gpu_memory``, ``steps``, ``batch``, ``optimizer`` ("adam" or
"auto": ``bmt.optim.auto_adam``) and ``options`` (the optimizer's). Reports the most memory a step took (the
allocator's reserve and the memory outside it, from step 2 on), the blocks ``checkpoint="auto"`` kept, the
optimizer's class and offload fraction, whether wrap offloaded the parameters, the losses and the warnings."""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any, Dict, Optional, Union

import torch
import transformers

import bmtwrap as bmt
from bmtwrap.engine.memory import CudaGauge
from bmtwrap.wrap.convert import wrapped_record
from common import run


def steps(checkpoint: Union[bool, str], max_gpu_memory: Optional[Union[int, str]] = None, steps: int = 6,
          batch: int = 4, optimizer: str = "adam", options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    config = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                                      num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                                      attn_implementation="sdpa")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        model = bmt.materialize(bmt.wrap(model, checkpoint=checkpoint, max_gpu_memory=max_gpu_memory))
    make = bmt.optim.auto_adam if optimizer == "auto" else bmt.optim.AdamOptimizer
    opt = make(model.parameters(), lr=1e-4, **(options or {}))
    ids = torch.randint(0, 32000, (batch, 2048), device="cuda")  # activations of GiBs: compiled blocks save little
    gauge, used, losses = CudaGauge(torch.device("cuda")), [], []
    for _ in range(steps):
        torch.cuda.reset_peak_memory_stats()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        used.append(gauge.reserved_peak() + gauge.outside_allocator())
    record = wrapped_record(model)
    return {"used": max(used[1:]), "kept": sum(not runner.recompute for _, runner in record.runners),
            "optimizer": type(opt).__name__, "offload_params": record.plan.offload.params, "losses": losses,
            "offload_fraction": getattr(opt, "offload_fraction", 0.0),
            "warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)]}


if __name__ == "__main__":
    spec = json.loads(sys.argv[2])
    run({"steps": lambda: steps(**spec)})
