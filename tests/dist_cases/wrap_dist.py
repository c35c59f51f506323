"""wrap() across ranks: generate() with ranks stopping at different lengths; models built on meta;
parameters offloaded to the host. Argument 2 (optional): "cpu" (default) or "cuda" (fp32 on GPUs)."""

from __future__ import annotations

import copy
import functools
import os
import shutil
import sys
from typing import Any, Dict, Tuple

import torch
import transformers

import bmtwrap as bmt
from common import max_abs_diff, run, shared_path

DEVICE = "cuda" if len(sys.argv) > 2 and sys.argv[2] == "cuda" else "cpu"
CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def reference() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(DEVICE)


def generate(**options: Any) -> Dict[str, Any]:
    """Greedy decoding; rank 0's prompt hits the end token early, the others run to the length limit."""
    ref = reference().eval()
    model = bmt.wrap(copy.deepcopy(ref), **options).eval()
    world, rank = bmt.world_size(), bmt.rank()
    prompts = torch.randint(3, 96, (world, 5), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    free_run = ref.generate(prompts, max_new_tokens=10, do_sample=False, pad_token_id=0)
    eos = int(free_run[0, 5 + 2])
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0)
    expect = ref.generate(prompts[rank : rank + 1], **kwargs)
    got = model.generate(prompts[rank : rank + 1], **kwargs)
    lengths = torch.tensor([got.shape[1]], device=DEVICE)
    every = [torch.zeros_like(lengths) for _ in range(world)]
    torch.distributed.all_gather(every, lengths)
    same = torch.tensor([int(torch.equal(expect, got))], device=DEVICE)
    torch.distributed.all_reduce(same, op=torch.distributed.ReduceOp.MIN)
    return {"lengths": [int(x) for x in every], "all_equal": bool(same.item())}


def _grad_gap(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    grads = bmt.full_grad_dict(model)
    return max((grads[n] - p.grad).abs().max().item() / max(p.grad.abs().max().item(), 1e-30)
               for n, p in ref.named_parameters())


def meta_then_load() -> Dict[str, Any]:
    ref = reference()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    bmt.wrap(model)
    bmt.load_state_dict(model, ref.state_dict())
    world, rank = bmt.world_size(), bmt.rank()
    ids = torch.randint(0, 96, (12, 12), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    share = 12 // world  # 12 rows: every world size from 1 to 4 takes equal shares
    ref_loss = ref(ids, labels=ids).loss
    ref_loss.backward()
    mine = ids[rank * share : (rank + 1) * share]
    loss = model(mine, labels=mine).loss
    loss.backward()
    return {"loss_rel": abs(bmt.sum_loss(loss).item() - ref_loss.item()) / ref_loss.item(),
            "grad_rel": _grad_gap(model, ref),
            "inv_freq_equal": torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)}


def meta_then_materialize() -> Dict[str, Any]:
    ref = reference()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    bmt.wrap(model)
    bmt.materialize(model)
    full = bmt.full_state_dict(model)
    # Every rank must hold pieces of the same values: gather rank 0's view and compare.
    digest = torch.stack([v.double().sum() for v in full.values()]).to(DEVICE)
    digests = [torch.zeros_like(digest) for _ in range(bmt.world_size())]
    torch.distributed.all_gather(digests, digest)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    loss = model(ids, labels=ids).loss
    return {
        "ranks_agree": all(torch.equal(d, digests[0]) for d in digests),
        "linear_std": full["model.layers.1.mlp.up_proj.weight"].std().item(),
        "norm_is_one": bool((full["model.layers.0.input_layernorm.weight"] == 1).all()),
        "inv_freq_equal": torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq),
        "loss": loss.item(),
    }


HYPER = dict(lr=1e-3, eps=1e-6, weight_decay=0.01)


def _batch(seed: int) -> Tuple[int, int, torch.Tensor, int]:
    """World size, rank, a 12 x 12 batch of ids the same on every rank, and the rows each rank takes (12 divides
    among 1 to 4 ranks)."""
    world = bmt.world_size()
    ids = torch.randint(0, 96, (12, 12), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    return world, bmt.rank(), ids, 12 // world


def _sharded_step(model: torch.nn.Module, opt: Any, rows: torch.Tensor) -> torch.Tensor:
    """One training step of the wrapped model on this rank's rows; its loss."""
    opt.zero_grad()
    loss = model(rows, labels=rows).loss
    loss.backward()
    opt.step()
    return loss


def offload_params_training() -> Dict[str, Any]:
    """wrap(offload_params=True) of a model built on meta, loaded, then trained 5 steps with the offload
    optimizer stepping in backward, against the unwrapped model and torch's AdamW."""
    ref = reference()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    bmt.wrap(model, offload_params=True)
    bmt.load_state_dict(model, ref.state_dict())
    opt_ref = torch.optim.AdamW(ref.parameters(), **HYPER)
    opt = bmt.optim.AdamOffloadOptimizer(model.parameters(), step_in_backward=True, chunk_numel=1000, **HYPER)
    world, rank, ids, share = _batch(4)
    rels = []
    for _ in range(5):
        opt_ref.zero_grad()
        ref_loss = ref(ids, labels=ids).loss
        ref_loss.backward()
        opt_ref.step()
        loss = _sharded_step(model, opt, ids[rank * share : (rank + 1) * share])
        rels.append(abs(bmt.sum_loss(loss).item() - ref_loss.item()) / ref_loss.item())
    full, expected = bmt.full_state_dict(model), ref.state_dict()
    return {"loss_max_rel": max(rels),
            "param_max_abs": max((full[k] - expected[k]).abs().max().item() for k in expected),
            "block_params_on_cpu": all(p.device.type == "cpu" for p in model.model.layers.parameters()),
            "root_params_on_device": all(p.device.type == DEVICE for n, p in model.named_parameters()
                                         if ".layers." not in n)}


def fp8_training() -> Dict[str, Any]:
    """wrap(fp8=...) with torchao's emulated float8 (float8 rounding on the CPU) trained 4 AdamW steps against the
    unwrapped model converted the same way, then saved and loaded at this world size and by the plain model.

    Each rank's rows are a micro-batch of the reference's step: float8 scales come from each tensor's own
    maximum, so the reference must see the same rows together to round the same."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    emulated = Float8LinearConfig(emulate=True)
    plain = reference()
    ref = convert_to_float8_training(copy.deepcopy(plain), config=emulated,
                                     module_filter_fn=lambda module, fqn: ".layers." in f".{fqn}")
    model = bmt.wrap(copy.deepcopy(plain), fp8=emulated)
    converted = sorted(n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear")
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), **HYPER), torch.optim.AdamW(model.parameters(), **HYPER)
    world, rank, ids, share = _batch(5)
    rels = []
    for _ in range(4):
        opt_ref.zero_grad()
        ref_losses = []
        for r in range(world):
            rows = ids[r * share : (r + 1) * share]
            ref_losses.append(ref(rows, labels=rows).loss)
            ref_losses[-1].backward()
        for p in ref.parameters():
            p.grad /= world
        opt_ref.step()
        loss = _sharded_step(model, opt, ids[rank * share : (rank + 1) * share])
        rels.append(abs(loss.item() - ref_losses[rank].item()) / ref_losses[rank].item())
    full, expected = bmt.full_state_dict(model), ref.state_dict()
    path = shared_path("fp8.pt")
    bmt.save(model, path)
    saved = torch.load(path, weights_only=True)
    plain.load_state_dict(saved)  # the file holds the unwrapped model's tensors: no float8, no extra keys
    again = bmt.wrap(copy.deepcopy(reference()), fp8=emulated)
    bmt.load(again, path)
    reloaded = bmt.full_state_dict(again)
    bmt.synchronize()
    if rank == 0:
        shutil.rmtree(os.path.dirname(path))
    return {"loss_max_rel": max(rels), **max_abs_diff(full, expected),
            "converted": converted,
            "block_linears": sorted(n for n, m in plain.named_modules() if type(m) is torch.nn.Linear and ".layers." in n),
            "saved_dtypes": sorted({str(v.dtype) for v in saved.values()}),
            "saved_keys_match": sorted(saved) == sorted(reference().state_dict()),
            "reload_equal": all(torch.equal(reloaded[k], full[k]) for k in full),
            "plan": bmt.plan(reference(), fp8=emulated).fp8}


def _storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one shard count once)."""
    seen: Dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def plan_is_exact() -> Dict[str, Any]:
    """The plan's parameter, gradient and optimizer bytes against what the wrapped model really holds.

    A bf16 Llama with a frozen embedding and a frozen first-layer projection (groups with a frozen and a
    trainable buffer); then an fp32 model with the offload optimizer (state on the host).
    """
    out: Dict[str, Any] = {}
    # The offload optimizer updates after backward, as it does on the CPU by default: its gradients stay on .grad.
    offload = functools.partial(bmt.optim.AdamOffloadOptimizer, step_in_backward=False)
    for name, optimizer, dtype in (("adam_bf16", bmt.optim.AdamOptimizer, torch.bfloat16),
                                   ("offload_fp32", offload, torch.float32)):
        model = reference().to(dtype)
        model.model.embed_tokens.weight.requires_grad_(False)
        model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
        planned = bmt.plan(model, world_size=bmt.world_size(), offload_optimizer=optimizer is offload,
                           step_in_backward=False)
        bmt.wrap(model)
        opt = optimizer(p for p in model.parameters() if p.requires_grad)
        ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(bmt.rank())).to(DEVICE)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        state = [v for entry in opt.state.values() for v in entry.values()]
        actual = torch.tensor([_storage_bytes(model.parameters()), _storage_bytes(p.grad for p in model.parameters()),
                               _storage_bytes(state)])
        actual = actual.to(DEVICE)
        torch.distributed.all_reduce(actual, op=torch.distributed.ReduceOp.MAX)
        state_planned = planned.memory.optimizer + dict(planned.memory.host_detail)["optimizer state"]
        out[name] = {"actual": actual.tolist(),
                     "planned": [planned.memory.params, planned.memory.grads, state_planned],
                     "state_on_gpu": planned.memory.optimizer}
    return out


if __name__ == "__main__":
    run({"generate": generate, "generate_offloaded": lambda: generate(offload_params=True),
         "meta_then_load": meta_then_load, "meta_then_materialize": meta_then_materialize,
         "offload_params_training": offload_params_training, "plan_is_exact": plan_is_exact,
         "fp8_training": fp8_training})
