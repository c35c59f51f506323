"""Compiled blocks and the loss without the logits, across ranks, against the unwrapped model.

Each rank trains on its own slice of one batch; the reference runs every slice and averages their
losses, which is what the ranks' averaged gradients are the gradient of. Compilation uses the
``aot_eager`` backend here (the whole of dynamo and AOTAutograd, with eager kernels): the CPU has
no use for inductor's, and generating them takes minutes on two cores; the in-process tests
compile one model with inductor.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List

import torch
import transformers

import bmtwrap as bmt
from common import run

AOT = {"backend": "aot_eager"}
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES: Dict[str, Callable[[], transformers.PreTrainedModel]] = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL)),
    "gemma": lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(**SMALL, head_dim=8)),
    # Gemma 2 soft-caps its logits; the loss applies the cap inside its chunks.
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **SMALL, head_dim=8, final_logit_softcapping=2.0, attn_implementation="eager")),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_embd=32, n_layer=3, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)),
}
BATCH, SEQ = 6, 12


def _batch() -> Dict[str, torch.Tensor]:
    """Left padding on some rows (masked, labels ignored) and ignored labels inside others."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 96, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    for row in range(0, BATCH, 2):
        pad = 1 + row % 4
        mask[row, :pad] = 0
        labels[row, :pad] = -100
        ids[row, :pad] = 0
    labels[1, 5:9] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _mine(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    share = BATCH // bmt.world_size()
    return {k: v[bmt.rank() * share : (bmt.rank() + 1) * share] for k, v in batch.items()}


def _slices(batch: Dict[str, torch.Tensor]) -> List[Dict[str, torch.Tensor]]:
    world = bmt.world_size()
    share = BATCH // world
    return [{k: v[r * share : (r + 1) * share] for k, v in batch.items()} for r in range(world)]


def _compare(ref: torch.nn.Module, model: torch.nn.Module, steps: int = 2, **call: Any) -> Dict[str, Any]:
    """Train both ``steps`` steps with SGD on one batch; the largest loss, gradient and parameter gaps."""
    batch = _batch()
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loss_gap, grad_gap, logits = 0.0, 0.0, []
    for _ in range(steps):
        ref_losses = [ref(**s, **call).loss for s in _slices(batch)]
        ref_loss = torch.stack(ref_losses).mean()
        ref_loss.backward()
        out = model(**_mine(batch), **call)
        logits.append(out.logits is None)
        out.loss.backward()
        mine = ref_losses[bmt.rank()].item()
        loss_gap = max(loss_gap, abs(out.loss.item() - mine) / abs(mine))
        grads = bmt.full_grad_dict(model)
        for name, p in ref.named_parameters():
            if p.grad is not None:
                scale = max(p.grad.abs().max().item(), 1e-30)
                grad_gap = max(grad_gap, (grads[name] - p.grad).abs().max().item() / scale)
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
    full = bmt.full_state_dict(model)
    param_gap = max((full[k].float() - v.float()).abs().max().item() for k, v in ref.state_dict().items())
    return {"loss_rel": loss_gap, "grad_rel": grad_gap, "param_abs": param_gap, "logits_none": logits}


def _reference(family: str = "llama") -> torch.nn.Module:
    torch.manual_seed(0)
    return FAMILIES[family]()


def compiled(**options: Any) -> Dict[str, Any]:
    ref = _reference()
    model = bmt.wrap(copy.deepcopy(ref), compile=AOT, **options)
    return _compare(ref, model)


def compiled_frozen_and_hooked() -> Dict[str, Any]:
    """Frozen parameters (the embedding, one layer's attention) and a forward hook inside every block."""
    ref = _reference()
    for module in (ref.model.embed_tokens, ref.model.layers[1].self_attn):
        module.requires_grad_(False)
    for layer in ref.model.layers:
        layer.mlp.register_forward_hook(lambda module, args, out: out * 0.5)
    model = bmt.wrap(copy.deepcopy(ref), compile=AOT)
    return _compare(ref, model)


def compiled_lora() -> Dict[str, Any]:
    import peft

    base = _reference()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                             init_lora_weights=False)
    ref = peft.get_peft_model(base, config)
    model = bmt.wrap(copy.deepcopy(ref), compile=AOT)
    return _compare(ref, model)


def compiled_graphs_shared() -> Dict[str, Any]:
    """Blocks of one class share their compilation (regional compilation): twice the blocks, as many graphs (one for
    every block, one for the final norm); checkpointed (the CPU's checkpoint="auto"), so the recomputation in
    backward runs the compiled call too."""
    from torch._dynamo.utils import counters

    graphs = {}
    for layers in (3, 6):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**dict(SMALL, num_hidden_layers=layers))
        model = bmt.wrap(transformers.LlamaForCausalLM(config), compile=AOT)
        for _ in range(2):
            model(**_mine(_batch())).loss.backward()
        graphs[layers] = counters["stats"]["unique_graphs"]
    return {"graphs_3_blocks": graphs[3], "graphs_6_blocks": graphs[6]}


def compiled_cross_block() -> Dict[str, Any]:
    """A layer that reads another block's parameter: it cannot compile that way and runs in eager mode, where the
    on-demand gathers give it the full parameter."""
    import warnings

    from robustness import CrossBlock, train_pair

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train_pair(CrossBlock, compile=AOT)
    result["fallbacks"] = sum("did not compile" in str(w.message) for w in caught)
    return result


def compiled_calls_a_root_module() -> Dict[str, Any]:
    """Checkpointed compiled layers that call a module of the root: its full parameters are shown again while they
    recompute in backward, so the recomputation runs the forward's graph and saves the same tensors."""
    from robustness import CallsRootModule, train_pair

    return train_pair(CallsRootModule, compile=AOT, checkpoint=True)


def compiled_checks_when_traced() -> Dict[str, Any]:
    """The check for other blocks' parameters runs when a block's graph is compiled, not each time the compiled code
    runs: in the first step (which compiles) it checks, in the second no check and no torch-function mode of ours
    runs around the blocks compiled whole. Counted by a profile function, which changes nothing dynamo guards on."""
    import sys

    from bmtwrap.wrap import compiled as compiled_module

    torch._dynamo.reset()
    ref = _reference()
    model = bmt.wrap(copy.deepcopy(ref), compile=AOT)
    mode = compiled_module._OwnParametersOnly.__torch_function__.__code__
    check = compiled_module._check_own_parameters.__code__
    counts: Dict[str, List[int]] = {"mode_calls": [], "checks": []}

    def step() -> None:
        calls, checks = [0], [0]

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code is mode:
                calls[0] += 1
            elif event == "call" and frame.f_code is check:
                checks[0] += 1

        sys.setprofile(profile)
        try:
            model(**_mine(_batch())).loss.backward()
        finally:
            sys.setprofile(None)
        counts["mode_calls"].append(calls[0])
        counts["checks"].append(checks[0])

    step()
    step()
    return counts


def head_loss(family: str) -> Dict[str, Any]:
    ref = _reference(family)
    model = bmt.wrap(copy.deepcopy(ref), compile=False)
    return _compare(ref, model)


def head_loss_items_in_batch() -> Dict[str, Any]:
    """The Trainer's num_items_in_batch: a sum over the tokens divided by the count of the whole batch."""
    ref = _reference()
    model = bmt.wrap(copy.deepcopy(ref), compile=False)
    count = torch.tensor(int((_batch()["labels"][:, 1:] != -100).sum()))
    return _compare(ref, model, num_items_in_batch=count)


def head_loss_kept_logits() -> Dict[str, Any]:
    ref = _reference()
    model = bmt.wrap(copy.deepcopy(ref), compile=False, keep_logits=True)
    return _compare(ref, model, steps=1)


CASES = {
    "compiled_checkpointed": lambda: compiled(checkpoint=True),
    "compiled_kept": lambda: compiled(checkpoint=False),
    "compiled_zero2": lambda: compiled(checkpoint=False, zero_level=2),
    "compiled_frozen_and_hooked": compiled_frozen_and_hooked,
    "compiled_lora": compiled_lora,
    "compiled_graphs_shared": compiled_graphs_shared,
    "compiled_cross_block": compiled_cross_block,
    "compiled_checks_when_traced": compiled_checks_when_traced,
    "compiled_calls_a_root_module": compiled_calls_a_root_module,
    **{f"head_loss_{family}": (lambda family=family: head_loss(family)) for family in FAMILIES},
    "head_loss_items_in_batch": head_loss_items_in_batch,
    "head_loss_kept_logits": head_loss_kept_logits,
}

if __name__ == "__main__":
    run(CASES)
