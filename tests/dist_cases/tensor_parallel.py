"""BMTrain's tensor-parallel layers and ``init_distributed(tp_size=T)``, against plain torch in one process.

Run as ``tensor_parallel.py OUT TP``. Every rank builds the plain reference (``nn.Linear``,
``nn.Embedding``, ``F.cross_entropy``, a whole model) from the same seed, gives the parallel layers their
slices of its weights, and compares outputs, gradients, losses and parameters; fp32 on the CPU, so
within rounding. Each case returns the largest differences (and sizes to check) for the test to judge.
"""

from __future__ import annotations

import sys
from typing import Any, Dict

import torch
import torch.nn.functional as F
from torch import nn

import bmtwrap as bmt
from bmtwrap.checkpoint import save_checkpoint
from bmtwrap.engine.dist import current
from bmtwrap.engine.full_state import full_grad_dict
from common import diff, on_device, raised, run, shared_path

H, FF, V, ROWS, SEQ, STEPS = 32, 64, 16, 4, 3, 3


def tp() -> int:
    return bmt.config["tp_size"]


def mine(x: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` in its tensor-parallel group."""
    return x.chunk(tp(), dim=dim)[bmt.config["tp_rank"]].contiguous()


def grads(layer: nn.Module) -> Dict[str, torch.Tensor]:
    """The layer's gradients, whole: gathered over the shards and joined over the tensor-parallel group."""
    return full_grad_dict(layer)


def column() -> Dict[str, Any]:
    torch.manual_seed(1)
    ref, x = nn.Linear(H, FF), torch.randn(ROWS, SEQ, H)
    weights = torch.arange(ROWS * SEQ * FF).view(ROWS, SEQ, FF).cos()  # a loss that weighs every output
    out: Dict[str, Any] = {}
    for gather_output in (False, True):
        layer = bmt.nn.ColumnParallelLinear(H, FF, gather_output=gather_output)
        layer.load_state_dict({"weight": ref.weight, "bias": ref.bias})  # whole tensors, as from a checkpoint
        xr = mine(x, 0).requires_grad_()
        y = layer(xr)
        (y * (weights if gather_output else mine(weights, -1))).sum().backward()
        xf = x.clone().requires_grad_()
        ref.zero_grad()
        yf = ref(xf)
        (yf * weights).sum().backward()
        got = grads(layer)
        out[f"gather_output={gather_output}"] = [
            diff(y, yf if gather_output else mine(yf, -1)), diff(xr.grad, mine(xf.grad, 0)),
            diff(got["weight"], ref.weight.grad), diff(got["bias"], ref.bias.grad)]
    return out


def row() -> Dict[str, Any]:
    torch.manual_seed(2)
    ref, x = nn.Linear(FF, H), torch.randn(ROWS, SEQ, FF)
    weights = torch.arange(ROWS * SEQ * H).view(ROWS, SEQ, H).sin()
    out: Dict[str, Any] = {}
    for split_input, all_reduce_output in ((False, False), (False, True), (True, False), (True, True)):
        layer = bmt.nn.RowParallelLinear(FF, H, split_input=split_input, all_reduce_output=all_reduce_output)
        layer.load_state_dict({"weight": ref.weight, "bias": ref.bias})
        xr = (mine(x, 0) if split_input else mine(x, -1)).requires_grad_()
        y = layer(xr)
        (y * (weights if all_reduce_output else mine(weights, 0))).sum().backward()
        xf = x.clone().requires_grad_()
        ref.zero_grad()
        yf = ref(xf)
        (yf * weights).sum().backward()
        got = grads(layer)
        out[f"split_input={split_input},all_reduce_output={all_reduce_output}"] = [
            diff(y, yf if all_reduce_output else mine(yf, 0)),
            diff(xr.grad, mine(xf.grad, 0) if split_input else mine(xf.grad, -1)),
            diff(got["weight"], ref.weight.grad), diff(got["bias"], ref.bias.grad)]
    return out


def embedding_and_loss() -> Dict[str, Any]:
    torch.manual_seed(3)
    ref = nn.Embedding(V, H)
    ids, target, h = torch.randint(0, V, (ROWS, SEQ)), torch.randint(0, V, (ROWS * SEQ,)), torch.randn(ROWS, SEQ, H)
    target[::5] = -100
    emb = bmt.nn.VPEmbedding(V, H, dtype=torch.float32)
    emb.load_state_dict({"weight": ref.weight})
    looked = emb(ids)
    (mine(looked, 0) * mine(h, 0)).sum().backward()  # cut to rows, as BMTrain's models do
    ref_looked = ref(ids)
    (ref_looked * h).sum().backward()
    found = {"lookup": [diff(looked, ref_looked), diff(grads(emb)["weight"], ref.weight.grad)]}
    for smoothing in (0.0, 0.1):
        emb.weight.grad, ref.weight.grad = None, None
        hr = mine(h, 0).requires_grad_()
        logits = emb(hr, projection=True)  # (ROWS, SEQ, V / T): every row, this rank's classes
        loss = bmt.loss.FusedCrossEntropy(parallel=True, label_smoothing=smoothing)(logits.view(-1, V // tp()), target)
        loss.backward()
        hf = h.clone().requires_grad_()
        ref_logits = F.linear(hf, ref.weight)
        ref_loss = F.cross_entropy(ref_logits.view(-1, V), target, label_smoothing=smoothing)
        ref_loss.backward()
        found[f"projection,smoothing={smoothing}"] = [
            diff(logits, mine(ref_logits, -1)), diff(loss, ref_loss), diff(hr.grad, mine(hf.grad, 0)),
            diff(grads(emb)["weight"], ref.weight.grad)]
    head = bmt.nn.VPProjection(V, H, dtype=torch.float32)  # takes the whole input
    head.load_state_dict({"weight": ref.weight})
    ref.weight.grad = None
    hw, hf = h.clone().requires_grad_(), h.clone().requires_grad_()
    logits = head(hw)
    bmt.loss.FusedCrossEntropy(parallel=True)(logits.view(-1, V // tp()), target).backward()
    ref_logits = F.linear(hf, ref.weight)
    F.cross_entropy(ref_logits.view(-1, V), target).backward()
    found["vp_projection"] = [diff(logits, mine(ref_logits, -1)), diff(hw.grad, hf.grad),
                              diff(grads(head)["weight"], ref.weight.grad)]
    whole = bmt.nn.Projection(V, H, dtype=torch.float32)  # the vocabulary whole, saved and loaded as a slice
    whole.load_state_dict({"weight": ref.weight})
    path = shared_path("projection.pt")
    bmt.save(whole, path)
    sliced = bmt.nn.VPProjection(V, H, dtype=torch.float32)
    bmt.load(sliced, path)
    found["projection_file"] = [diff(whole(h), F.linear(h, ref.weight)), diff(sliced(h), mine(whole(h), -1))]
    rows = bmt.loss.FusedCrossEntropy(parallel=True, reduction="none")(
        mine(F.linear(h, ref.weight).view(-1, V), -1), target)
    found["none"] = [diff(rows, F.cross_entropy(F.linear(h, ref.weight).view(-1, V), target, reduction="none"))]
    return found


class Norm(bmt.DistributedModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = bmt.DistributedParameter(torch.empty(H), init_method=torch.nn.init.ones_)
        self.bias = bmt.DistributedParameter(torch.empty(H), init_method=torch.nn.init.zeros_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (H,), self.weight, self.bias)


class Layer(bmt.DistributedModule):
    """A feed-forward block on this rank's rows: norm, column-parallel up, gelu, row-parallel down, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = Norm()
        self.up = bmt.nn.ColumnParallelLinear(H, FF)
        self.down = bmt.nn.RowParallelLinear(FF, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(bmt.DistributedModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = bmt.nn.VPEmbedding(V, H, dtype=torch.float32, init_std=0.5)
        self.layers = bmt.TransformerBlockList([bmt.Block(Layer()) for _ in range(2)])
        self.norm = Norm()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).chunk(tp(), dim=0)[bmt.config["tp_rank"]]  # this rank's rows
        h = self.norm(self.layers(h))
        return self.embed(h, projection=True)  # every row of the group, this rank's classes


class Reference(nn.Module):
    """The same model in plain torch, whole."""

    def __init__(self, state: Dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.p = nn.ParameterDict({k.replace(".", "/"): nn.Parameter(v.clone()) for k, v in state.items()})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        p = {k.replace("/", "."): v for k, v in self.p.items()}
        h = F.embedding(ids, p["embed.weight"])
        for i in range(2):
            pre = f"layers.{i}."
            x = F.layer_norm(h, (H,), p[pre + "norm.weight"], p[pre + "norm.bias"])
            x = F.gelu(F.linear(x, p[pre + "up.weight"], p[pre + "up.bias"]))
            h = h + F.linear(x, p[pre + "down.weight"], p[pre + "down.bias"])
        h = F.layer_norm(h, (H,), p["norm.weight"], p["norm.bias"])
        return F.linear(h, p["embed.weight"])


def full_state(path: str) -> Dict[str, torch.Tensor]:
    return torch.load(path, map_location=current().device, weights_only=True)


def training() -> Dict[str, Any]:
    """Three steps of Adam with clipping, against the plain model on the whole batch in one process."""
    torch.manual_seed(4)
    ids, target = torch.randint(0, V, (2 * ROWS, SEQ)), torch.randint(0, V, (2 * ROWS, SEQ))
    model = Model()
    bmt.init_parameters(model)
    path = shared_path("init.pt")
    bmt.save(model, path)
    bmt.synchronize()
    init = full_state(path)
    ref = Reference(init)
    groups = bmt.world_size() // tp()  # data-parallel groups; each takes its share of the rows
    share = slice(bmt.rank() // tp() * (2 * ROWS // groups), (bmt.rank() // tp() + 1) * (2 * ROWS // groups))
    optimizer = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2)
    manager = bmt.optim.OptimManager(loss_scale=None)
    manager.add_optimizer(optimizer)
    ref_optimizer = torch.optim.Adam(ref.parameters(), lr=1e-2)
    loss_fn = bmt.loss.FusedCrossEntropy(parallel=True)
    losses, ref_losses, norms, ref_norms = [], [], [], []
    for _ in range(STEPS):
        manager.zero_grad()
        logits = model(ids[share])
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), target[share].reshape(-1))
        manager.backward(loss)
        norms.append(float(manager.clip_grad_norm(optimizer.param_groups, max_norm=0.5)))
        manager.step()
        losses.append(float(bmt.sum_loss(loss)))
        ref_optimizer.zero_grad()
        ref_loss = F.cross_entropy(ref(ids).view(-1, V), target.view(-1))
        ref_loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)))
        ref_optimizer.step()
        ref_losses.append(float(ref_loss))
    path = shared_path("trained.pt")
    bmt.save(model, path)
    bmt.synchronize()
    saved = full_state(path)
    wanted = {k.replace("/", "."): v for k, v in ref.p.items()}
    return {"losses": [losses, ref_losses], "norms": [norms, ref_norms],
            "shapes": sorted(k for k in saved if saved[k].shape != init[k].shape or init[k].shape != wanted[k].shape),
            "params": max(diff(saved[k], wanted[k]) for k in wanted), "keys": sorted(saved) == sorted(wanted),
            "moved": max(diff(saved[k], init[k]) for k in wanted)}


def save_and_load() -> Dict[str, Any]:
    """Whole tensors in a file load at this layout and save back unchanged. ``argv[3]``, if given, is a file
    another layout wrote; this run also writes one of random values for the next (its path comes back)."""
    model = Model()
    bmt.init_parameters(model)
    path = shared_path("shapes.pt")
    bmt.save(model, path)
    bmt.synchronize()
    torch.manual_seed(6)
    written = shared_path("written.pt")
    if bmt.rank() == 0:
        torch.save({k: torch.randn(v.shape) for k, v in full_state(path).items()}, written)
    found: Dict[str, Any] = {"written": written}
    for name, source in (("own", written), ("other", sys.argv[3] if len(sys.argv) > 3 else None)):
        if source is None:
            continue
        bmt.synchronize()
        bmt.load(model, source)
        again = shared_path("again.pt")
        bmt.save(model, again)
        bmt.synchronize()
        want, back = full_state(source), full_state(again)
        found[name] = [sorted(back) == sorted(want), max(diff(back[k], want[k]) for k in want)]
        found[name + "_state_dict"] = max(diff(v, want[k]) for k, v in model.state_dict().items())
    found["errors"] = {
        "tp_split_dim": raised(lambda: bmt.DistributedParameter(torch.zeros(4), tp_mode=True, tp_split_dim=1)),
        "vocab": raised(lambda: bmt.nn.VPEmbedding(V + 1, H)) if tp() > 1 else ["none", ""],
        "wrap": raised(lambda: bmt.wrap(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))) if tp() > 1 else [],
        "sharded": raised(lambda: save_checkpoint(shared_path("sharded"), model)) if tp() > 1 else []}
    return found


def config() -> Dict[str, Any]:
    c = bmt.config
    return {"tp_size": c["tp_size"], "tp_rank": c["tp_rank"], "tp_comm": list(c["tp_comm"].ranks),
            "tp_zero_comm": list(c["tp_zero_comm"].ranks), "zero_comm": list(c["zero_comm"].ranks),
            "tp_zero_size": c["tp_zero_size"], "zero_size": c["zero_size"]}



if __name__ == "__main__":
    cases = {"config": config, "column": column, "row": row, "embedding_and_loss": embedding_and_loss,
             "training": training, "save_and_load": save_and_load}
    only = sys.argv[4].split(",") if len(sys.argv) > 4 else list(cases)
    run({name: on_device(cases[name]) for name in only}, tp_size=int(sys.argv[2]))
