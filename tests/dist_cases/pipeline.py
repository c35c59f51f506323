"""BMTrain's pipeline parallelism (``init_distributed(pipe_size=P)``, ``PipelineTransformerBlockList``) against plain
torch in one process.

Run as ``pipeline.py OUT PIPE [FILE [CASES [TP]]]``. A small BMTrain-style model (an embedding tied to the output,
four pipelined layers that take a batch-cut mask and a shared shift, a final norm) trains a few steps; each
rank takes its share of one global batch, and the plain model trains on the whole batch in one process from
the same initial values. ``FILE``, if given, is a checkpoint another layout wrote, loaded here. fp32 on the
CPU, so within rounding; each case returns the differences for the test to judge.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from torch import nn

import bmtwrap as bmt
from bmtwrap.checkpoint import save_checkpoint
from common import diff, on_device, raised, run, shared_path

H, V, LAYERS, ROWS, SEQ, STEPS = 32, 16, 4, 2, 3, 3


class Layer(bmt.DistributedModule):
    """x + mask * W2 gelu(W1 norm(x + shift)): a mask cut with the batch, a shift every row shares."""

    def __init__(self) -> None:
        super().__init__()
        self.norm_weight = bmt.DistributedParameter(torch.empty(H), init_method=nn.init.ones_)
        self.up = bmt.nn.Linear(H, 2 * H)
        self.down = bmt.nn.Linear(2 * H, H)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x + shift, (H,), self.norm_weight)
        return x + mask * self.down(F.gelu(self.up(h)))


class Model(bmt.DistributedModule):
    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.embed = bmt.DistributedParameter(torch.empty(V, H), init_method=bmt.ParameterInitializer(nn.init.normal_,
                                                                                                       std=0.3))
        self.shift = bmt.DistributedParameter(torch.empty(H), init_method=nn.init.normal_)
        # plain modules and blocks built with the default mode="BLOCK" (as BMTrain's tests give them)
        self.layers = bmt.PipelineTransformerBlockList(
            [bmt.Block(Layer()) if i % 2 else Layer() for i in range(layers)])
        self.norm = bmt.DistributedParameter(torch.empty(H), init_method=nn.init.ones_)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.layers(F.embedding(ids, self.embed), mask, self.shift * 0.1)
        return F.linear(F.layer_norm(h, (H,), self.norm), self.embed)


def reference(p: Dict[str, torch.Tensor], ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The same model in plain torch, from whole tensors under the model's keys."""
    h, shift = F.embedding(ids, p["embed"]), p["shift"] * 0.1
    for i in range(LAYERS):
        pre = f"layers.{i}."
        x = F.layer_norm(h + shift, (H,), p[pre + "norm_weight"])
        x = F.linear(F.gelu(F.linear(x, p[pre + "up.weight"], p[pre + "up.bias"])), p[pre + "down.weight"],
                     p[pre + "down.bias"])
        h = h + mask * x
    return F.linear(F.layer_norm(h, (H,), p["norm"]), p["embed"])


def saved(model: nn.Module, name: str) -> Dict[str, torch.Tensor]:
    path = shared_path(name)
    bmt.save(model, path)
    bmt.synchronize()
    return torch.load(path, map_location="cpu", weights_only=True)


def config() -> Dict[str, Any]:
    c, model = bmt.config, Model()
    remote = [name for name, p in model.named_parameters() if isinstance(p, bmt.bmtrain.pipeline.RemoteParameter)]
    return {"pipe_size": c["pipe_size"], "pipe_rank": c["pipe_rank"], "stage_id": c["topology"].stage_id,
            "micros": c["micros"], "pipe_comm": list(c["pipe_comm"].ranks), "zero_comm": list(c["zero_comm"].ranks),
            "tp_comm": list(c["tp_comm"].ranks), "pp_tp_zero_comm": list(c["pp_tp_zero_comm"].ranks),
            "zero_rank": c["zero_rank"], "layers": list(model.layers.layer_ids),
            "remote": sorted({name.split(".")[1] for name in remote}),
            "remote_numel": sum(p.numel() for name, p in model.named_parameters() if name in remote)}


def training() -> Dict[str, Any]:
    """Adam steps with clipping, against the plain model on the whole batch."""
    torch.manual_seed(4)
    world = bmt.world_size()
    ids = torch.randint(0, V, (4 * ROWS, SEQ))
    mask = torch.rand(4 * ROWS, SEQ, 1)
    target = torch.randint(0, V, (4 * ROWS, SEQ))
    model = Model()
    bmt.init_parameters(model)
    init = saved(model, "init.pt")
    ref = {k: v.clone().requires_grad_() for k, v in init.items()}
    share = slice(bmt.rank() * (4 * ROWS // world), (bmt.rank() + 1) * (4 * ROWS // world))
    # Adam's first steps move each element by about lr * g / (|g| + eps): with a gradient near zero (a unit gelu
    # turns off for every row) rounding would decide the step; an eps of 1e-3 keeps the comparison to rounding.
    optimizer = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2, eps=1e-3)
    manager = bmt.optim.OptimManager(loss_scale=None)
    manager.add_optimizer(optimizer)
    ref_optimizer = torch.optim.Adam(ref.values(), lr=1e-2, eps=1e-3)
    losses, ref_losses, norms, ref_norms = [], [], [], []
    for _ in range(STEPS):
        manager.zero_grad()
        logits = model(ids[share], mask[share])
        loss = F.cross_entropy(logits.reshape(-1, V), target[share].reshape(-1))
        manager.backward(loss)
        norms.append(float(manager.clip_grad_norm(optimizer.param_groups, max_norm=1.0)))
        manager.step()
        losses.append(float(bmt.sum_loss(loss)))
        ref_optimizer.zero_grad()
        ref_loss = F.cross_entropy(reference(ref, ids, mask).reshape(-1, V), target.reshape(-1))
        ref_loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.values(), 1.0)))
        ref_optimizer.step()
        ref_losses.append(float(ref_loss))
    final = saved(model, "trained.pt")
    # bmt.inspect.inspect_model sees every layer's values and gradients, whichever stage holds it; the manager
    # leaves the gradients unclipped (the step applies the factor), torch's clipping scaled the reference's.
    summary = {entry["name"]: entry for entry in bmt.inspect.inspect_model(model, "layers.*")}
    clipped = min(1.0, 1.0 / (ref_norms[-1] + 1e-6))
    inspected = max(max(abs(summary[k]["mean"] - float(ref[k].mean())),
                        abs(summary[k]["grad_mean"] * clipped - float(ref[k].grad.mean())))
                    for k in ref if k.startswith("layers."))
    with torch.no_grad():
        evaluated = model(ids[share], mask[share])
        ref_evaluated = reference(ref, ids, mask)[share]
    return {"losses": [losses, ref_losses], "norms": [norms, ref_norms], "keys": sorted(final) == sorted(ref),
            "init": {k: float(v.double().abs().sum()) for k, v in init.items()},
            "params": max(diff(final[k], ref[k].detach()) / float(ref[k].detach().abs().max()) for k in ref),
            "moved": max(diff(final[k], init[k]) for k in ref), "inspected": [sorted(summary), inspected],
            "no_grad": diff(evaluated, ref_evaluated) / float(ref_evaluated.abs().max())}


def save_and_load() -> Dict[str, Any]:
    """Whole tensors in a file load at this layout and save back unchanged. ``argv[3]``, if given, is a file
    another layout wrote; this run also writes one of random values for the next (its path comes back)."""
    model = Model()
    bmt.init_parameters(model)
    shapes = saved(model, "shapes.pt")
    torch.manual_seed(6)
    written = shared_path("written.pt")
    if bmt.rank() == 0:
        torch.save({k: torch.randn(v.shape) for k, v in shapes.items()}, written)
    found: Dict[str, Any] = {"written": written}
    for name, source in (("own", written), ("other", sys.argv[3] if len(sys.argv) > 3 else None)):
        if source is None:
            continue
        bmt.synchronize()
        bmt.load(model, source)
        want, back = torch.load(source, weights_only=True), saved(model, "again.pt")
        found[name] = [sorted(back) == sorted(want), max(diff(back[k], want[k]) for k in want)]
        state = model.state_dict()
        found[name + "_state_dict"] = [sorted(state) == sorted(want), max(diff(v, want[k]) for k, v in state.items())]
        model.load_state_dict({k: v + 1 for k, v in want.items()})
        found[name + "_load_state_dict"] = max(diff(v, want[k] + 1) for k, v in model.state_dict().items())
    return found


def init_parameters() -> Dict[str, Any]:
    """BMTrain's tests/test_init_parameters_multi_gpu.py under a pipeline layout: blocks outside a pipelined list
    (every stage holds them) start as the plain layers of one process with the same seed."""
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(nn.init.xavier_normal_(torch.empty(5, 3)))
            self.bias = nn.Parameter(nn.init.zeros_(torch.empty(5)))

    class Initialised(bmt.DistributedModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = bmt.DistributedParameter(torch.empty(5, 3), init_method=nn.init.xavier_normal_)
            self.bias = bmt.DistributedParameter(torch.empty(5), init_method=nn.init.zeros_)

    torch.manual_seed(33)
    want = nn.ModuleList([Plain(), Plain()]).state_dict()
    found = {}
    for name, make in (("block_list", lambda: bmt.TransformerBlockList([Initialised(), Initialised()])),
                       ("checkpoint_blocks", lambda: nn.ModuleList([bmt.CheckpointBlock(Initialised()) for _ in "ab"]))):
        torch.manual_seed(33)
        model = make()
        bmt.init_parameters(model)
        got = saved(model, name + ".pt")
        found[name] = [sorted(got) == sorted(want), max(diff(got[k], want[k]) for k in want)]
    return found


def send_recv() -> Dict[str, Any]:
    """BMTrain's tests/test_send_recv.py: stage 0 sends along the pipe group, stage 1 receives; what each rank got."""
    topology, comm = bmt.config["topology"], bmt.config["pipe_comm"]
    sent = torch.ones(2, 1) * (topology.pp_zero_id + 1)
    if topology.pipe_rank == 0:
        bmt.distributed.send_activations(sent, 1, comm)
        mine = None
    else:
        mine = diff(bmt.distributed.recv_activations(0, comm), sent)
    every: List[Any] = [None] * bmt.world_size()
    torch.distributed.all_gather_object(every, mine)
    return {"received": every}


class Recording(Layer):
    def forward(self, x: torch.Tensor, mask: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        bmt.inspect.record_tensor(x, "inside")
        return super().forward(x, mask, shift)


def inspector() -> Dict[str, Any]:
    """Tensors recorded outside the pipelined layers and inside them, against the same layers in plain torch on the
    whole batch: each rank's records are its rows, a loss built from them back-propagates, their gradients count
    the later layers too; a record that does not lead with the rows is refused on every rank."""
    model, x, mask = Model(), torch.randn(2, SEQ, H, requires_grad=True), torch.ones(2, SEQ, 1)
    bmt.init_parameters(model)
    with bmt.inspect.inspect_tensor() as outside:
        h = model.layers(x * 2, mask, torch.zeros(H))
        bmt.inspect.record_tensor(h, "after")
    h.sum().backward()

    torch.manual_seed(6)
    world, rows = bmt.world_size(), 2
    recording = bmt.PipelineTransformerBlockList([Recording() for _ in range(LAYERS)])
    bmt.init_parameters(recording)
    whole = saved(recording, "recording.pt")
    xs, ws = torch.randn(world * rows, SEQ, H), torch.randn(LAYERS, world * rows, SEQ, H)
    masks, shift = torch.rand(world * rows, SEQ, 1), torch.randn(H)
    mine = slice(bmt.rank() * rows, (bmt.rank() + 1) * rows)
    x = xs[mine].clone().requires_grad_()
    with bmt.inspect.inspect_tensor() as inspector:
        out = recording(x, masks[mine], shift)
    records = [entry["tensor"] for entry in inspector.summary]
    (sum((r * w[mine]).sum() for r, w in zip(records, ws)) + out.pow(2).sum()).backward()
    summary = {entry["name"]: entry for entry in inspector.get_summary()}

    ref = {k: v.clone().requires_grad_() for k, v in whole.items()}
    h, ref_records = xs.clone().requires_grad_(), []
    for i in range(LAYERS):
        h.retain_grad()
        ref_records.append(h)
        pre = f"{i}."
        y = F.layer_norm(h + shift, (H,), ref[pre + "norm_weight"])
        y = F.linear(F.gelu(F.linear(y, ref[pre + "up.weight"], ref[pre + "up.bias"])), ref[pre + "down.weight"],
                     ref[pre + "down.bias"])
        h = h + masks * y
    (sum((r * w).sum() for r, w in zip(ref_records, ws)) + h.pow(2).sum()).backward()
    grads = {e["name"]: e for e in bmt.inspect.inspect_model(recording, "*")}  # every stage's layers
    with bmt.inspect.inspect_tensor():
        tiny = bmt.PipelineTransformerBlockList([Scalar() for _ in range(2)])
        refused = raised(lambda: tiny(x, masks[mine], shift))
    return {"outside": [s["name"] for s in outside.get_summary()],
            "names": [entry["name"] for entry in inspector.summary], "summary_names": sorted(summary),
            "values": max(diff(r, ref_r[mine]) for r, ref_r in zip(records, ref_records)),
            "record_grads": max(diff(r.grad, ref_r.grad[mine]) for r, ref_r in zip(records, ref_records)),
            "grad_stats": max(abs(summary[f"{i}.inside"]["grad_mean"] - float(ref_r.grad.mean()))
                              for i, ref_r in enumerate(ref_records)),
            "input_grad": diff(x.grad, ref_records[0].grad[mine]),  # the first record is the reference's input
            "param_grads": max(abs(grads[k]["grad_mean"] * world - float(ref[k].grad.mean())) for k in ref),
            "refused": refused}


class Scalar(Layer):
    def forward(self, x: torch.Tensor, mask: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        bmt.inspect.record_tensor(x.sum(), "total")  # not a tensor of the rows: a pipeline cannot hand it on
        return super().forward(x, mask, shift)


def errors() -> Dict[str, Any]:
    pipe = bmt.config["pipe_size"]
    model = Model()
    bmt.init_parameters(model)
    micros = bmt.config["micros"]
    return {"few_layers": raised(lambda: Model(layers=pipe - 1)) if pipe > 1 else [],
            "micro_batches": raised(lambda: model(torch.zeros(1, SEQ, dtype=torch.long), torch.ones(1, SEQ, 1)))
            if pipe % micros else [],
            "hidden_states": raised(lambda: model.layers(torch.zeros(2, SEQ, H), torch.ones(2, SEQ, 1), torch.zeros(H),
                                                         return_hidden_states=True)) if pipe > 1 else [],
            "sharded": raised(lambda: save_checkpoint(shared_path("sharded"), model)) if pipe > 1 else [],
            "wrap": raised(lambda: bmt.wrap(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))(torch.ones(2, 4)).sum()
                           .backward())}


if __name__ == "__main__":
    cases = {"config": config, "training": training, "save_and_load": save_and_load, "send_recv": send_recv,
             "init_parameters": init_parameters, "inspector": inspector, "errors": errors}
    only = sys.argv[4].split(",") if len(sys.argv) > 4 else list(cases)
    pipe, tp = int(sys.argv[2]), int(sys.argv[5]) if len(sys.argv) > 5 else 1
    run({name: on_device(cases[name]) for name in only}, pipe_size=pipe, tp_size=tp,
        num_micro_batches=2 * pipe if pipe > 1 else None)
