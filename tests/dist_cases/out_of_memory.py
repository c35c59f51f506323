"""checkpoint="auto" recovering from running out of memory, for tests/test_out_of_memory.py.

The CPU has no memory counters, so ``checkpoint="auto"`` is driven by ``fake_gauge.FakeGauge``: a
card of 24 GiB on which each block's recomputation measures 1 GiB, with room for 2 blocks.
A model of ``LAYERS`` layers (linear, dropout, tanh) trains ``STEPS`` steps with AdamW twice, from
the same seed and data: once as it is, once with an out-of-memory error raised in one kept block's
forward, after its dropout drew its mask, on one rank (``VICTIM``) in the step where
``checkpoint="auto"`` first keeps activations. The second run must recover (a warning on that rank
only, that block and the kept ones after it recomputed, every rank agreeing from the next step on)
and end with the losses and parameters of the first: the rerun draws the same mask, nothing is
updated twice or half.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Dict, List

import torch
from torch import nn

import bmtwrap as bmt
from bmtwrap.engine.schedule import engine
from common import run
from fake_gauge import FakeGauge

auto = importlib.import_module("bmtwrap.wrap.auto")

LAYERS, WIDTH, STEPS = 4, 32, 5
VICTIM, VICTIM_BLOCK = 1, 1
INJECT_STEP = 2  # the first step with activations kept


class Layer(nn.Module):
    def __init__(self, index: int, inject: Dict[str, Any]) -> None:
        super().__init__()
        self.index = index
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.2)
        self.inject = inject

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.lin(x))  # draws a mask: the rerun must draw the same one
        inject = self.inject
        if (inject["on"] and inject["step"] == INJECT_STEP and self.index == VICTIM_BLOCK and bmt.rank() == VICTIM
                and torch.is_grad_enabled() and not inject["fired"]):
            inject["fired"] = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")
        return torch.tanh(h)


class Net(nn.Module):
    def __init__(self, inject: Dict[str, Any]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(i, inject) for i in range(LAYERS))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def train(inject_on: bool) -> Dict[str, Any]:
    inject = {"on": inject_on, "step": 0, "fired": False}
    torch.manual_seed(0)
    model = Net(inject)
    original = auto.gauge_for
    auto.gauge_for = lambda device: FakeGauge()
    try:
        model = bmt.wrap(model, checkpoint="auto")
    finally:
        auto.gauge_for = original
    record = engine().wrapped_record(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(100 + bmt.rank())
    torch.manual_seed(1 + bmt.rank())  # dropout's masks differ by rank, and equal between the runs
    losses: List[float] = []
    kept: List[List[bool]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, STEPS + 1):
            inject["step"] = step
            x = torch.randn(8, WIDTH, generator=data)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(bmt.sum_loss(loss).item())
            kept.append([not runner.recompute for _, runner in record.runners])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    messages = [str(w.message) for w in caught if "ran out of GPU memory" in str(w.message)]
    return dict(losses=losses, kept=kept, state=state, warnings=messages, fired=inject["fired"],
                report=dict(record.auto.report))


def recovers() -> Dict[str, Any]:
    plain = train(False)
    injected = train(True)
    diff = max((injected["state"][k] - v).abs().max().item() for k, v in plain["state"].items())
    gathered: List[Any] = [None] * bmt.world_size()
    torch.distributed.all_gather_object(gathered, dict(warnings=injected["warnings"], fired=injected["fired"],
                                                       kept=injected["kept"], plain_kept=plain["kept"]))
    return dict(plain_losses=plain["losses"], injected_losses=injected["losses"], param_max_abs=diff,
                ranks=gathered, report=plain["report"])


if __name__ == "__main__":
    run({"recovers": recovers})
