"""Worker of tests/test_module_trees.py: trains random module trees wrapped and unwrapped, one spec per request.

Started by tests/worker_group.py (argv: the pytest process's address and a token); every rank
receives each :class:`~module_tree_gen.TreeSpec` (as ``dataclasses.asdict`` JSON) and runs
:func:`check` on it; rank 0 answers with the measurements below, or ``{"error": ...}`` with every
rank's traceback. The pytest side applies the limits.

:func:`check`: the spec's model is built twice from the same seed, the reference and the one
``bmtwrap.wrap`` shards (with the spec's ``checkpoint`` and ``zero_level``). Both train ``STEPS``
steps of ``torch.optim.SGD`` (lr ``LR``) on the same batch: the reference on the whole batch, each
rank on its share. Each step compares the loss averaged over ranks (``bmt.sum_loss``) with the
reference's, and every gradient (``bmt.full_grad_dict``) with the reference's; after the steps,
``model.state_dict()`` (full-shaped tensors, persistent buffers included) with the reference's.

Gradient error of a tensor: ``max |ours - ref| / max(max |ref|, 1)``: absolute for the gradients
these tiny models have (mostly below 1), relative for larger ones. Not relative to every tensor's
own scale: float32 rounds the whole batch's sum and the ranks' mean of their shares' sums
differently, and for a tensor whose entries partly cancel (an embedding's rows, a norm's bias) that
difference reached 1.6e-5 of its largest entry (8.5e-7 absolute) where the others stay below 1e-6.
A parameter without a gradient counts as a zero gradient on either side.

Each spec runs on a fresh engine (the context's engine is dropped after it): a failing spec then
fails the same way replayed alone, whatever ran before it in this job.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, Dict, List

import torch
import torch.distributed as dist

import bmtwrap as bmt
import module_tree_gen as gen
from bmtwrap.engine.dist import current as current_context
from worker_group import serve

STEPS = 3
LR = 0.1  # SGD: a gradient's rounding moves a weight by lr times it, never more (Adam would amplify it)
GRAD_SCALE_FLOOR = 1.0  # see the module docstring


def grad_errors(ours: Dict[str, torch.Tensor], ref: torch.nn.Module) -> Dict[str, Any]:
    """The worst gradient of one step, by the error defined in the module docstring (and, for the
    record, the largest difference relative to a tensor's own scale)."""
    expected = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).double() for n, p in ref.named_parameters()}
    missing = sorted(set(expected) - set(ours))
    if missing:
        return {"grad_err": float("inf"), "grad_worst": f"missing from full_grad_dict: {missing}",
                "grad_worst_diff": float("inf"), "grad_worst_scale": 0.0, "grad_own_rel": float("inf")}
    worst: Dict[str, Any] = {"grad_err": -1.0, "grad_own_rel": 0.0}
    for name, expect in expected.items():
        diff = (ours[name].double() - expect).abs().max().item()
        scale = expect.abs().max().item()
        err = diff / max(scale, GRAD_SCALE_FLOOR)
        if scale > 0 and diff / scale > worst["grad_own_rel"]:
            worst.update(grad_own_rel=diff / scale, grad_own_worst=name, grad_own_scale=scale)
        if err > worst["grad_err"]:
            worst.update(grad_err=err, grad_worst=name, grad_worst_diff=diff, grad_worst_scale=scale)
    return worst


def check(spec: gen.TreeSpec, dtype: torch.dtype, result: Dict[str, Any]) -> None:
    """Train the spec's model wrapped and unwrapped (see the module docstring), filling ``result`` as it goes."""
    rank, world = bmt.rank(), bmt.world_size()
    ref = gen.build(spec).to(dtype)
    model = gen.build(spec).to(dtype)
    wrap_plan = bmt.plan(ref)
    result.update(blocks=wrap_plan.block_names, rule=wrap_plan.rule, shared=list(wrap_plan.shared))
    model = bmt.wrap(model, checkpoint=spec.checkpoint, zero_level=spec.zero_level)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = {k: v.to(dtype) if v.is_floating_point() else v for k, v in gen.batch(spec).items()}
    mine = gen.share(data, rank, world)
    result.update(losses=[], loss_rel=0.0, grad_err=0.0, grad_keys_match=True)
    for step in range(STEPS):
        opt_ref.zero_grad()
        opt.zero_grad()
        ref_loss = gen.loss(ref, data)
        ref_loss.backward()
        loss = gen.loss(model, mine)
        loss.backward()
        mean = bmt.sum_loss(loss).item()
        result["losses"].append([mean, ref_loss.item()])
        result["loss_rel"] = max(result["loss_rel"], abs(mean - ref_loss.item()) / abs(ref_loss.item()))
        grads = bmt.full_grad_dict(model)
        result["grad_keys_match"] &= sorted(grads) == sorted(n for n, _ in ref.named_parameters())
        worst = grad_errors(grads, ref)
        own = {k: result[k] for k in ("grad_own_rel", "grad_own_worst", "grad_own_scale") if k in result}
        if step == 0 or worst["grad_err"] > result["grad_err"]:
            result.update(worst, grad_step=step)
        if own and own["grad_own_rel"] >= result["grad_own_rel"]:
            result.update(own)
        opt.step()
        opt_ref.step()
    ours, theirs = model.state_dict(), ref.state_dict()
    result["keys_match"] = sorted(ours) == sorted(theirs)
    result.update(param_abs=0.0, param_worst="")
    for name, value in theirs.items():
        if name in ours:
            diff = (ours[name].double() - value.double()).abs().max().item()
            if diff > result["param_abs"] or not result["param_worst"]:
                result.update(param_abs=diff, param_worst=name)


def run_spec(request: Dict[str, Any]) -> Dict[str, Any]:
    """One request: ``{"spec": asdict(spec), "dtype": "float32" or "float64"}``; every rank's error,
    if any, in ``result["error"]``."""
    result: Dict[str, Any] = {}
    error = None
    try:
        check(gen.spec_from_dict(request["spec"]), getattr(torch, request["dtype"]), result)
    except Exception:  # reported with the spec; the pytest side fails the example with this text
        error = f"rank {bmt.rank()}: {traceback.format_exc()}"
        print(error, file=sys.stderr, flush=True)
    current_context().engine = None  # a fresh engine for the next spec (see the module docstring)
    errors: List[Any] = [None] * bmt.world_size()
    dist.all_gather_object(errors, error)
    if any(errors):
        result["error"] = "\n".join(e for e in errors if e)
    return result


if __name__ == "__main__":
    bmt.init_distributed(seed=0)
    serve(run_spec)
    # Leaving gloo's threads to interpreter shutdown can abort a process on exit.
    dist.destroy_process_group()
