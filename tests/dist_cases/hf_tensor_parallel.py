"""``wrap(model, tp_size=T)`` of a Hugging Face Llama, against the same model unwrapped in one process.

Run as ``hf_tensor_parallel.py OUT TP [CHECKPOINT]``: the process group is set up with tensor-parallel
groups of TP ranks. Every rank builds the unwrapped reference from the same seed and trains it on the
whole batch; the wrapped model trains on its data-parallel share (``rank // TP`` of ``world // TP``,
the same for every rank of a tensor-parallel group). fp32 on the CPU, so within rounding. CHECKPOINT,
a file ``bmt.save`` wrote (with ``.sd.pt``, that run's ``state_dict()``) in another layout, is loaded
here; each job writes its own for the next. The cases return differences for the test to judge.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, Callable, Dict, List

import torch
import transformers
from torch import nn

import bmtwrap as bmt
from bmtwrap.engine.dist import current
from bmtwrap.engine.full_state import full_grad_dict
from bmtwrap.optim.optim_manager import grad_norm
from bmtwrap.wrap.convert import wrapped_record
from common import max_abs_diff, max_rel, raised, run

TP = int(sys.argv[2])
STEPS, BATCH, SEQ, VOCAB = 3, 4, 8, 64
LR, EPS = 1e-3, 1e-6  # as parity.py: Adam's step amplifies the rounding of tiny gradients less than at eps 1e-8


def config(**changes: Any) -> transformers.LlamaConfig:
    """The tiny Llama: 4 heads, 2 key/value heads (GQA), biases in every projection (so the rowwise bias, added
    once, is checked), a padding id in the second half of the vocabulary (held by tensor-parallel rank 1)."""
    values = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=False, attention_bias=True,
                  mlp_bias=True, pad_token_id=40, attn_implementation="eager")
    values.update(changes)
    return transformers.LlamaConfig(**values)


def llama(**changes: Any) -> nn.Module:
    torch.manual_seed(5)
    return transformers.LlamaForCausalLM(config(**changes))


def batch() -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(11))
    ids[:, -2] = 40  # the padding id's row: no gradient in either model
    return ids


def share(ids: torch.Tensor) -> torch.Tensor:
    """This rank's data-parallel share: the same rows for every rank of a tensor-parallel group."""
    replicas = bmt.world_size() // TP
    rows = BATCH // replicas
    place = bmt.rank() // TP
    return ids[place * rows : (place + 1) * rows]


def diffs(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> List[str]:
    """Keys whose shapes differ, or that one side lacks."""
    return sorted(k for k in set(got) | set(want) if k not in got or k not in want or got[k].shape != want[k].shape)


def qwen3() -> nn.Module:
    """A tiny Qwen3: per-head q_norm and k_norm (replicated_with_grad_allreduce in its plan), and the embedding tied
    to the LM head (kept whole)."""
    torch.manual_seed(5)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=VOCAB, tie_word_embeddings=True, pad_token_id=40, attn_implementation="eager"))


def training(make: Callable[[], nn.Module] = llama, **options: Any) -> Dict[str, Any]:
    """Training, gradients, generate() and the state against the unwrapped model; ``options`` go to wrap (with
    ``compile=True``, whether every block runs compiled: traced as one graph with its layers' collectives, not in
    eager mode after a failed trace)."""
    ref, model = make(), make()
    planned = bmt.plan(model, tp_size=TP).memory.params
    plan_left_it = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    model = bmt.wrap(model, tp_size=TP, **options)
    bodies = [m.forward.compiled_body for m in model.modules() if hasattr(m.forward, "block_runner")]
    ids = batch()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS, weight_decay=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.01)
    losses, grads = [], {}
    for step in range(STEPS):
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        loss = model(input_ids=share(ids), labels=share(ids)).loss
        loss.backward()
        losses.append(max_rel(bmt.sum_loss(loss).item(), ref_loss.item()))
        if step == 0:
            got = full_grad_dict(model)
            want = {k: p.grad for k, p in ref.named_parameters()}
            norm = grad_norm([p for p in model.parameters() if p.grad is not None]).item()
            grads = {"norm": max_rel(norm, torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()),
                     "shapes": diffs(got, want),
                     "max_abs": max(float((got[k] - want[k]).abs().max()) for k in want if k in got),
                     "padding_row": float(got["model.embed_tokens.weight"][40].abs().max())}  # untied only
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    prompt = ids[:, :3]  # greedy, the same on every rank: generate() keeps the group's collectives in step
    generated = [m.eval().generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                                   do_sample=False).tolist() for m in (model, ref)]
    state, want = model.state_dict(), ref.state_dict()
    moved = max(float((want[k] - v).abs().max()) for k, v in make().state_dict().items())
    return {"losses": losses, "grads": grads, "shapes": diffs(state, want), "moved": moved,
            "held": held(model), "plan": [planned, shard_bytes(model), plan_left_it],
            "config": {k: getattr(model.config, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                              "num_key_value_heads", "head_dim", "vocab_size")},
            "generated": generated, "compiled": [body is not None and not body.is_eager() for body in bodies],
            **max_abs_diff(state, want)}


def shard_bytes(model: nn.Module) -> int:
    """What this rank's shards of the model's parameters take."""
    record = wrapped_record(model)
    groups = [runner.group for _, runner in record.runners] + [record.root.group]
    return sum(b.local.numel() * b.local.element_size() for group in groups for b in group.buffers)


def held(model: nn.Module) -> Dict[str, Any]:
    """The shape each parameter has on this rank before ZeRO sharding, and the dimension it is split along."""
    record = wrapped_record(model)
    groups = [runner.group for _, runner in record.runners] + [record.root.group]
    return {slot.name.split("layers.0.")[-1]: [list(slot.shape), slot.tp_split_dim]
            for group in groups for buffer in group.buffers for slot in buffer.slots if "layers.1." not in slot.name}


def checkpoints() -> Dict[str, Any]:
    """Load the other layout's file (a bmtwrap checkpoint, and its state_dict() through load_state_dict), then
    write this layout's, after a training step that moves every value away from the initial ones."""
    out: Dict[str, Any] = {}
    if len(sys.argv) > 3:
        other = torch.load(sys.argv[3] + ".sd.pt", weights_only=True)
        for how in ("load", "load_state_dict", "load_pretrained", "from_pretrained"):
            model = bmt.wrap(llama(), tp_size=TP) if how != "from_pretrained" else None
            if how == "from_pretrained":  # built on the meta device, split, then streamed in
                model = bmt.from_pretrained(sys.argv[3] + ".hf", tp_size=TP)
            elif how == "load":
                bmt.load(model, sys.argv[3])
            elif how == "load_pretrained":  # the Hugging Face folder the other layout wrote
                bmt.load_pretrained(model, sys.argv[3] + ".hf")
            else:
                model.load_state_dict(other)
            state = model.state_dict()
            out[how] = [diffs(state, other), max(float((state[k] - other[k]).abs().max()) for k in other)]
        if TP == 1:  # plain transformers, without bmtwrap, loads what the tensor-parallel ranks wrote
            plain = llama()
            plain.load_state_dict(torch.load(sys.argv[3], weights_only=True))
            out["plain"] = max(float((plain.state_dict()[k] - other[k]).abs().max()) for k in other)
            folder = transformers.LlamaForCausalLM.from_pretrained(sys.argv[3] + ".hf").state_dict()
            out["plain_pretrained"] = [diffs(folder, other), max(float((folder[k] - other[k]).abs().max())
                                                                 for k in other)]
    out.update(materialized())
    model = bmt.wrap(llama(), tp_size=TP)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    ids = share(batch())
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    path = os.path.join(tempfile.mkdtemp() if bmt.rank() == 0 else "", "model.pt")
    written = [path]
    torch.distributed.broadcast_object_list(written, src=0)
    bmt.save(model, written[0])
    bmt.save_pretrained(model, written[0] + ".hf")
    state = model.state_dict()
    if bmt.rank() == 0:
        torch.save(state, written[0] + ".sd.pt")
        torch.save(out.pop("made"), written[0] + ".made.pt")
    out["written"] = written[0]
    return out


def materialized() -> Dict[str, Any]:
    """A Llama built on the meta device, wrapped, then given values by bmt.materialize: the same values in every
    layout (against the file of the job before), and split parameters whose slices differ."""
    torch.manual_seed(7)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config())
    made = bmt.materialize(bmt.wrap(meta, tp_size=TP)).state_dict()
    q = made["model.layers.0.self_attn.q_proj.weight"]
    found = {"made": made, "padding_row": float(made["model.embed_tokens.weight"][40].abs().max()),
             "halves_differ": not torch.allclose(q[: len(q) // 2], q[len(q) // 2 :])}
    if len(sys.argv) > 3:
        other = torch.load(sys.argv[3] + ".made.pt", weights_only=True)
        found["same_as_before"] = [diffs(made, other), max(float((made[k] - other[k]).abs().max()) for k in other)]
    return found


def input_copies() -> Dict[str, Any]:
    """How many times backward all-reduces a colwise input's gradient over the group: the copy_whole nodes of the
    graph (blocks not checkpointed, so that the whole graph is there to count)."""
    model = bmt.wrap(llama(), tp_size=TP, checkpoint=False)
    ids = share(batch())
    loss = model(input_ids=ids, labels=ids).loss
    seen, todo, copies = set(), [loss.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        copies += "CopyWhole" in type(node).__name__
        todo.extend(next_node for next_node, _ in node.next_functions)
    loss.backward()
    return {"copies": copies, "layers": model.config.num_hidden_layers}


def renamed() -> nn.Module:
    """The Llama inside a wrapper, as peft's PeftModel holds it: the plan's names no longer match its modules."""
    wrapper = nn.Module()
    wrapper.inner = llama()
    wrapper.tp_plan = wrapper.inner.tp_plan
    return wrapper


def errors() -> Dict[str, Any]:
    if TP == 1:
        return {}
    return {
        "not_dividing_world": raised(lambda: bmt.wrap(llama(), tp_size=3)),
        "other_than_the_group": raised(lambda: bmt.wrap(llama(), tp_size=bmt.world_size() // TP * 2 if
                                                        bmt.world_size() > TP else 1)),
        "heads": raised(lambda: bmt.wrap(llama(num_attention_heads=2, num_key_value_heads=1, head_dim=16),
                                         tp_size=TP)),
        "wrapped_inside": raised(lambda: bmt.wrap(nn.Sequential(bmt.wrap(llama(), tp_size=TP)), tp_size=TP)),
        "plan_names_nothing": raised(lambda: bmt.wrap(renamed(), tp_size=TP)),
        "no_plan": raised(lambda: bmt.wrap(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), tp_size=TP)),
    }


def set_up_by_wrap(model: nn.Module) -> Dict[str, Any]:
    """The process group wrap(tp_size=TP) started (no init_distributed before it), and the model it wrapped then
    against the unwrapped one."""
    ctx = current()
    ref, ids = llama(), share(batch())
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return {"tp_size": ctx.tp_size, "shard_size": ctx.shard_size,
            "tp_group": torch.distributed.get_process_group_ranks(ctx.tp_group), "shard_group": list(ctx.shard_peers),
            "loss": max_rel(loss.item(), ref(input_ids=ids, labels=ids).loss.item())}


if __name__ == "__main__":
    cases = {"training": training, "checkpoints": checkpoints, "errors": errors, "qwen3": lambda: training(qwen3),
             "input_copies": input_copies}
    if TP > 1 and int(os.environ["WORLD_SIZE"]) == TP:  # one job compiles: on two cores that takes a while
        cases["compiled"] = lambda: training(compile=True)
    if TP > 1 and int(os.environ["WORLD_SIZE"]) > TP:  # wrap sets up the process group and its groups itself
        first = bmt.wrap(llama(), tp_size=TP)
        cases["set_up_by_wrap"] = lambda: set_up_by_wrap(first)
    run(cases if TP > 1 else {"checkpoints": checkpoints}, tp_size=TP)
