"""Sharded training of the test GPT against the same model unwrapped, in one process group.

Each case trains both models for ``STEPS`` steps on the same batch: the reference on the whole batch,
each rank of the sharded model on its share. Four steps are enough: a missed or doubled gradient shows
from the first, a stale gather or optimizer state from the second, and a resume is checked halfway.
Argument 2 (optional): "cpu" (default, fp32) or "cuda-bf16" for the GPU run.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List

import torch

import bmtwrap as bmt
from common import max_abs_diff, max_rel, run
from gpt_model import GPT, ShardedGPT

MODE = sys.argv[2] if len(sys.argv) > 2 else "cpu"
DEVICE = "cuda" if MODE.startswith("cuda") else "cpu"
DTYPE = torch.bfloat16 if MODE.endswith("bf16") else torch.float32
STEPS = 4
LR, EPS = 1e-3, 1e-6  # see test_parity.py for why these


def build(dtype: torch.dtype, **kwargs: Any):
    """The reference and the sharded model, with identical initial values in ``dtype``."""
    torch.manual_seed(1234)
    ref = GPT(dtype=dtype, device=DEVICE, **{k: v for k, v in kwargs.items() if k in ("triple", "frozen_first_layer")})
    torch.manual_seed(1234)
    model = ShardedGPT(dtype=dtype, device=DEVICE, **kwargs)
    return ref, model


OPTIMIZERS = {
    "torch": lambda params: torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.01),
    "adam": lambda params: bmt.optim.AdamOptimizer(params, lr=LR, eps=EPS, weight_decay=0.01),
    "offload": lambda params: bmt.optim.AdamOffloadOptimizer(params, lr=LR, eps=EPS, weight_decay=0.01),
    # Small chunks and two slots so that the tiny model's parameters still span several chunks.
    "offload_in_backward": lambda params: bmt.optim.AdamOffloadOptimizer(
        params, lr=LR, eps=EPS, weight_decay=0.01, step_in_backward=True, chunk_numel=100, staging_slots=2),
    # GPU only: the root and the first block keep their state on the GPU.
    "offload_half_in_backward": lambda params: bmt.optim.AdamOffloadOptimizer(
        params, lr=LR, eps=EPS, weight_decay=0.01, step_in_backward=True, offload_fraction=0.5),
    # GPU only: after the first step, the state that fits moves to the GPU (all of this small model's).
    "offload_auto_in_backward": lambda params: bmt.optim.AdamOffloadOptimizer(
        params, lr=LR, eps=EPS, weight_decay=0.01, step_in_backward=True, offload_fraction="auto"),
}


def train(*, dtype: torch.dtype = DTYPE, batch: int = 12, micro: int = 1, manager: str = "",
          optimizer: str = "torch", **kwargs: Any) -> Dict[str, Any]:
    """Both models ``STEPS`` steps; rank 0 alone trains the reference (the one whose result is reported: the
    same whole-batch run on every rank would multiply the work by the world size)."""
    ref, model = build(dtype, **kwargs)
    rank, world = bmt.rank(), bmt.world_size()
    reporting = rank == 0
    data = torch.randint(0, 64, (batch, 17), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    opt_ref, opt = OPTIMIZERS["torch"](ref.parameters()), OPTIMIZERS[optimizer](model.parameters())
    mgr = None
    if manager:
        mgr = bmt.optim.OptimManager(loss_scale=1024.0 if manager == "scaled" else None)
        mgr.add_optimizer(opt)
    per_micro = batch // micro
    share = per_micro // world
    rels = []
    for _ in range(STEPS):
        opt_ref.zero_grad()
        (mgr or opt).zero_grad()
        ref_loss = 0.0
        ours = torch.zeros((), dtype=torch.float64, device=DEVICE)
        for m in range(micro):
            chunk = data[m * per_micro : (m + 1) * per_micro]
            if reporting:
                loss = ref.loss(chunk) / micro
                loss.backward()
                ref_loss += loss.item()
            mine = model.loss(chunk[rank * share : (rank + 1) * share]) / micro
            if mgr is not None:
                mgr.backward(mine)
            else:
                mine.backward()
            ours += bmt.sum_loss(mine).double()
        if mgr is not None:
            if reporting:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            mgr.clip_grad_norm(opt.param_groups, 0.05)
            mgr.step()
        else:
            opt.step()
        if reporting:
            opt_ref.step()
            rels.append(max_rel(ours.item(), ref_loss))
    full = bmt.full_state_dict(model)
    if not reporting:
        return {}
    result = max_abs_diff(full, {k: v for k, v in ref.state_dict().items()})
    result["loss_max_rel"] = max(rels)
    return result


def run_steps(model: torch.nn.Module, opt: Any, share: torch.Tensor, n: int) -> List[float]:
    """``n`` training steps on this rank's ``share`` of the batch; each step's loss, averaged over the ranks."""
    losses = []
    for _ in range(n):
        opt.zero_grad()
        loss = model.loss(share)
        loss.backward()
        opt.step()
        losses.append(bmt.sum_loss(loss).item())
    return losses


def resume(optimizer: str, dtype: torch.dtype = DTYPE, **kwargs: Any) -> Dict[str, Any]:
    """``STEPS // 2`` steps, state_dict, a fresh model and optimizer loaded from it, as many more == ``STEPS``
    straight steps."""
    rank, world = bmt.rank(), bmt.world_size()
    data = torch.randint(0, 64, (12, 17), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    share = data[rank * (12 // world) : (rank + 1) * (12 // world)]

    def fresh():
        _, model = build(dtype, **kwargs)
        return model, OPTIMIZERS[optimizer](model.parameters())

    straight, opt = fresh()
    expected = run_steps(straight, opt, share, STEPS)
    first, opt1 = fresh()
    got = run_steps(first, opt1, share, STEPS // 2)
    model_state, opt_state = bmt.full_state_dict(first), opt1.state_dict()
    masters_fp32 = all(entry["master"].dtype == torch.float32 for entry in opt_state["state"].values()
                       if "master" in entry)
    second, opt2 = fresh()
    bmt.load_state_dict(second, model_state)
    opt2.load_state_dict(opt_state)
    got += run_steps(second, opt2, share, STEPS - STEPS // 2)
    a, b = bmt.full_state_dict(straight), bmt.full_state_dict(second)
    return {"losses_equal": got == expected, "params_equal": all(torch.equal(a[k], b[k]) for k in a),
            "masters": sum("master" in entry for entry in opt_state["state"].values()), "masters_fp32": masters_fp32}


def offload_matches_adam(other: str, offload_params: bool = False, dtype: torch.dtype = DTYPE) -> Dict[str, Any]:
    """GPU: AdamOffloadOptimizer (CPU kernel, copy streams, a worker thread, gathers waiting on
    write-backs) against AdamOptimizer (fused CUDA kernel): the same math, so the same training.
    With ``offload_params`` the offloading run keeps its blocks' shards in host memory. On the CPU in
    bf16: AdamOptimizer's masters split with their parameters against the offloading one's whole ones."""
    rank, world = bmt.rank(), bmt.world_size()
    data = torch.randint(0, 64, (12, 17), generator=torch.Generator().manual_seed(9)).to(DEVICE)
    share = data[rank * (12 // world) : (rank + 1) * (12 // world)]
    results = []
    split = []  # per run, the parameters whose master is split with them
    host_elements = []  # elements of optimizer state made in host memory
    import bmtwrap.optim.adam_offload as adam_module
    made_on_host = adam_module.host_zeros

    def counted(numel: int) -> torch.Tensor:
        host_elements.append(numel)
        return made_on_host(numel)

    adam_module.host_zeros = counted
    try:
        for name in ("adam", other):
            _, model = build(dtype, offload_params=offload_params and name == other)
            opt = OPTIMIZERS[name](model.parameters())
            losses = run_steps(model, opt, share, STEPS)
            if name != "adam":
                opt.wait()
            saved = opt.state_dict()["state"]  # split masters joined (see [Note: mixed precision])
            masters = torch.cat([saved[i]["master"].float().cpu().view(-1) for i in sorted(saved)
                                 if "master" in saved[i]])
            results.append((losses, bmt.full_state_dict(model), masters))
            split.append(sum("master_low" in opt.state[p] for p in model.parameters() if p in opt.state))
    finally:
        adam_module.host_zeros = made_on_host
    on_gpu = [opt.state[p]["exp_avg"].is_cuda for p in model.parameters() if p in opt.state]
    sizes = [p.numel() for p in model.parameters() if p in opt.state]
    (l1, s1, m1), (l2, s2, m2) = results
    return {"gpu_state_fraction": sum(n for n, g in zip(sizes, on_gpu) if g) / sum(sizes),
            "host_state_elements": sum(host_elements),
            "loss_max_rel": max(abs(a - b) / abs(a) for a, b in zip(l1, l2)),
            "param_max_abs": max((s1[k].float() - s2[k].float()).abs().max().item() for k in s1),
            "params_differing": sum(int((s1[k] != s2[k]).sum()) for k in s1),
            "split_masters": split,
            "master_max_rel": ((m1 - m2).abs().max() / m1.abs().max()).item()}


def offload_updates_in_backward() -> Dict[str, Any]:
    """step_in_backward: blocks are updated by the end of backward (their .grad handed over), the root
    parameters only by step(); the errors for clipping and loss scaling."""
    rank, world = bmt.rank(), bmt.world_size()
    _, model = build(DTYPE)
    opt = OPTIMIZERS["offload_in_backward"](model.parameters())
    data = torch.randint(0, 64, (12, 17), generator=torch.Generator().manual_seed(10)).to(DEVICE)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.loss(data[rank * (12 // world) : (rank + 1) * (12 // world)]).backward()
    opt.wait()
    in_blocks = {name: "layers" in name for name, _ in model.named_parameters()}
    moved = {name: not torch.equal(before[name], p.detach()) for name, p in model.named_parameters() if p.numel()}
    grads = {name: p.grad is not None for name, p in model.named_parameters() if p.numel()}
    opt.step()
    opt.wait()
    root_moved = all(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters()
                     if p.numel() and not in_blocks[n])
    errors = {}
    manager = bmt.optim.OptimManager()
    manager.add_optimizer(opt)
    for label, call in (("clip", lambda: manager.clip_grad_norm(opt.param_groups, 1.0)),
                        ("scale", lambda: bmt.optim.OptimManager(loss_scale=1024.0).add_optimizer(opt)),
                        ("grad_scale", lambda: opt.step(grad_scale=0.5))):
        try:
            call()
        except ValueError as error:
            errors[label] = str(error)
    return {"blocks_moved_in_backward": all(moved[n] for n in moved if in_blocks[n]),
            "root_waited_for_step": not any(moved[n] for n in moved if not in_blocks[n]),
            "block_grads_handed_over": not any(grads[n] for n in grads if in_blocks[n]),
            "root_moved_after_step": root_moved, "errors": errors}


def hidden_states() -> Dict[str, Any]:
    """return_hidden_states=True: the stacked inputs of every block, and the output."""
    ref, model = build(DTYPE)
    h = torch.randn(4, 9, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE, DTYPE)
    mask = torch.ones(9, 9, dtype=torch.bool, device=DEVICE).tril()
    out, stacked = model.layers(h, mask=mask, scale=0.9, return_hidden_states=True)
    inputs, x = [], h
    for layer in ref.layers:
        inputs.append(x)
        x = layer(x, mask=mask, scale=0.9)
    return {"out_max_abs": (out - x).abs().max().item(),
            "stacked_max_abs": (stacked - torch.stack(inputs)).abs().max().item(),
            "stacked_shape": list(stacked.shape)}


def eval_no_grad() -> Dict[str, Any]:
    ref, model = build(DTYPE)
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with torch.no_grad():
        diff = (model(ids) - ref(ids)).abs().max().item()
    return {"logits_max_abs": diff}


def offload_params_pinned_exactly() -> Dict[str, Any]:
    """wrap(offload_params=True) on a GPU: every offloaded shard is page-locked host memory of its exact size,
    and the gradients' host memory is reused from step to step (the pool stops growing after the first steps)."""
    from bmtwrap.engine.offload import PINNED
    before = PINNED.bytes_in_use()
    _, model = build(DTYPE, offload_params=True)
    built = PINNED.bytes_in_use() - before
    opt = OPTIMIZERS["offload_in_backward"](model.parameters())
    offloaded = [p for p in model.parameters() if p.device.type == "cpu"]
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in offloaded}
    data = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(9)).to(DEVICE)
    grown = []
    for _ in range(4):
        opt.zero_grad()
        model.loss(data).backward()
        opt.step()
        opt.wait()
        grown.append(PINNED.registered_bytes)
    torch.cuda.synchronize()
    return {"offloaded_params": len(offloaded), "all_pinned": all(p.is_pinned() for p in offloaded),
            "shard_bytes": sum(storages.values()), "pool_bytes_after_build": built, "registered_after_step": grown}


def offload_grads_wait_on_host() -> Dict[str, Any]:
    """GPU, step_in_backward: a block's gradient handed to the CPU waits in page-locked host memory, not on
    the GPU; the host memory is reused from step to step; training equals the fused optimizer's (the
    ``offload_in_backward_matches_adam`` case)."""
    from bmtwrap.engine.offload import PINNED
    _, model = build(DTYPE)
    opt = OPTIMIZERS["offload_in_backward"](model.parameters())
    data = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(9)).to(DEVICE)
    held_devices, registered = set(), []
    before = PINNED.registered_bytes
    for _ in range(4):
        opt.zero_grad()
        model.loss(data).backward()
        # The updates handed over last in backward are still queued (nothing waited for them yet).
        held_devices |= {tensors[1].device.type for _, tensors in opt._offload._held.values()}
        opt.step()
        opt.wait()
        registered.append(PINNED.registered_bytes)
    torch.cuda.synchronize()
    # How many gradients wait at once depends on the CPU's pace, so the pool may still grow a little
    # after the first step; without reuse it would grow by a whole step's gradients every step.
    step_grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"held_grad_devices": sorted(held_devices), "pool_growth": [r - before for r in registered],
            "step_grad_bytes": step_grad_bytes}


def gpu_updates_beside_forward() -> Dict[str, Any]:
    """GPU: auto_adam's updates of the state kept on the GPU run on a side stream beside the next forward (see
    [Note: GPU updates beside the next forward]); the same training, bit for bit, as on the computing stream,
    with gradients freed or zeroed in place by ``zero_grad`` and the state read between steps."""
    import bmtwrap.optim.gpu_updates as gpu_updates
    rank, world = bmt.rank(), bmt.world_size()
    data = torch.randint(0, 64, (12, 17), generator=torch.Generator().manual_seed(11)).to(DEVICE)
    share = data[rank * (12 // world) : (rank + 1) * (12 // world)]
    runs = []
    for beside in (False, True):
        gpu_updates.BESIDE_FORWARD = beside
        try:
            _, model = build(DTYPE)
            opt = bmt.optim.auto_adam(model.parameters(), lr=LR, eps=EPS, weight_decay=0.01)
            losses, states = [], []
            for i in range(STEPS):
                opt.zero_grad(set_to_none=i % 2 == 0)
                loss = model.loss(share)
                loss.backward()
                opt.step()
                losses.append(bmt.sum_loss(loss).item())
                if i == 1:  # read right after a step: waits for its updates
                    states.append({k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()})
            runs.append((losses, bmt.full_state_dict(model), states[0], opt.offload_fraction))
        finally:
            gpu_updates.BESIDE_FORWARD = True
    (l1, s1, m1, f1), (l2, s2, m2, f2) = runs
    return {"losses_equal": l1 == l2, "params_differing": sum(int((s1[k] != s2[k]).sum()) for k in s1),
            "moments_equal": all(torch.equal(m1[k], m2[k]) for k in m1), "offload_fraction": [f1, f2]}


CASES = {
    "zero3_checkpoint": lambda: train(),
    "zero3_no_checkpoint": lambda: train(use_checkpoint=False),
    "zero2_checkpoint": lambda: train(zero_level=2),
    "zero2_no_checkpoint": lambda: train(zero_level=2, use_checkpoint=False),
    "accumulate_2": lambda: train(batch=24, micro=2),
    "accumulate_2_zero2_no_checkpoint": lambda: train(batch=24, micro=2, zero_level=2, use_checkpoint=False),
    "frozen_layer": lambda: train(frozen_first_layer=True),
    "three_hidden": lambda: train(triple=True),
    "optim_manager": lambda: train(manager="plain"),
    "optim_manager_loss_scale": lambda: train(manager="scaled"),
    "adam_optimizer": lambda: train(optimizer="adam"),
    "adam_offload_optimizer": lambda: train(optimizer="offload"),
    "adam_offload_in_backward": lambda: train(optimizer="offload_in_backward"),
    "adam_offload_in_backward_no_checkpoint": lambda: train(optimizer="offload_in_backward", use_checkpoint=False),
    "adam_optimizer_manager_scaled": lambda: train(optimizer="adam", manager="scaled"),
    "offload_params": lambda: train(offload_params=True),
    "offload_params_accumulate_2_zero2": lambda: train(batch=24, micro=2, zero_level=2, offload_params=True),
    "offload_params_adam_offload_in_backward": lambda: train(optimizer="offload_in_backward", offload_params=True),
    "offload_params_adam_offload_scaled": lambda: train(optimizer="offload", manager="scaled", offload_params=True),
    "resume_adam": lambda: resume("adam"),
    "resume_offload": lambda: resume("offload"),
    "resume_offload_in_backward": lambda: resume("offload_in_backward"),
    "resume_offload_params": lambda: resume("offload_in_backward", offload_params=True),
    "offload_updates_in_backward": offload_updates_in_backward,
    "hidden_states": hidden_states,
    "eval_no_grad": eval_no_grad,
}
if DTYPE == torch.float32:
    CASES["float64"] = lambda: train(dtype=torch.float64)
if DEVICE == "cpu":
    CASES["split_master_matches_whole"] = lambda: offload_matches_adam("offload", dtype=torch.bfloat16)
    CASES["resume_adam_bf16"] = lambda: resume("adam", dtype=torch.bfloat16)
if DEVICE == "cuda":
    # A bf16 reference trained by torch's AdamW keeps no fp32 master, so it is no reference for ours.
    for name in [n for n in CASES if "adam" in n or ("offload" in n and not n.startswith("offload_params"))]:
        del CASES[name]
    CASES["offload_matches_adam"] = lambda: offload_matches_adam("offload")
    CASES["offload_in_backward_matches_adam"] = lambda: offload_matches_adam("offload_in_backward")
    # The blocks' shards on the host, the root's on the GPU: one optimizer over both.
    CASES["offload_params_matches_adam"] = lambda: offload_matches_adam("offload", offload_params=True)
    CASES["resume_offload_params_gpu"] = lambda: resume("offload_in_backward", offload_params=True)
    CASES["resume_offload_half_gpu"] = lambda: resume("offload_half_in_backward")
    CASES["offload_half_matches_adam"] = lambda: offload_matches_adam("offload_half_in_backward")
    CASES["offload_params_in_backward_matches_adam"] = lambda: offload_matches_adam("offload_in_backward",
                                                                                    offload_params=True)
    CASES["offload_auto_matches_adam"] = lambda: offload_matches_adam("offload_auto_in_backward")
    CASES["offload_params_pinned_exactly"] = offload_params_pinned_exactly
    CASES["offload_grads_wait_on_host"] = offload_grads_wait_on_host
    CASES["gpu_updates_beside_forward"] = gpu_updates_beside_forward

if __name__ == "__main__":
    # Argument 3 (optional): a comma-separated list of the cases to run.
    chosen = sys.argv[3].split(",") if len(sys.argv) > 3 else list(CASES)
    run({name: CASES[name] for name in chosen})
