"""Where the offload optimizer keeps its state: decided from the card (a fake one here) before any state exists.

``bmtwrap/engine/placement.py`` holds the arithmetic ([Note: automatic offload fraction]); these tests check it
with numbers worked out by hand, then that ``AdamOffloadOptimizer(offload_fraction="auto")`` makes the decision
at its first step before it has made any state, from the card it is given, and trains the same either way; then
that ``bmt.plan`` shows the same choice for a named card, and that ``auto_adam`` takes the offload optimizer on a
GPU only.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bmtwrap as bmt
from bmtwrap.engine.memory import CARDS, parse_bytes
from bmtwrap.engine import placement
from bmtwrap.engine.placement import Candidate, GradsOnGpu, Measured, kept_on_gpu, speculation_share
from bmtwrap.optim import adam_offload
from fake_gauge import GIB, FakeGauge

MIB = 2**20


def _measured(limit: int, peak: int, loss_peak: int) -> Measured:
    return Measured(ceiling=limit + 10, outside=4, margin=6, peak=peak, loss_peak=loss_peak)


def test_gradients_that_leave_free_their_room():
    # Root (state 10, grad 2, not in a block), then four blocks of state 10, grad 2. Limit 60, peak 40 with every
    # gradient, loss peak 30: with the blocks' gradients leaving, the step holds max(30, 40 - 8) = 32 before state.
    c = [Candidate(True, 10, 2, False)] + [Candidate(True, 10, 2, True) for _ in range(4)]
    m = _measured(60, 40, 30)
    # root: 32 + 10 = 42; block 1: max(30, 34) + 20 = 54 (its gradient stays); block 2: max(30, 36) + 30 = 66 > 60.
    assert kept_on_gpu(c, m, GradsOnGpu.LEAVE) == [True, True, False, False, False]
    # Every gradient on the GPU between backward passes: 40 + 10 + 10 = 60 fits, one more does not.
    assert kept_on_gpu(c, m, GradsOnGpu.ACCUMULATE) == [True, True, False, False, False]
    assert kept_on_gpu(c, _measured(90, 40, 30), GradsOnGpu.ACCUMULATE) == [True] * 5
    # Gradients waiting on the GPU for the CPU: 40 + 10 (all of them) = 50, each kept one sparing 2: 58, 66 > 60.
    assert kept_on_gpu(c, m, GradsOnGpu.WAIT) == [True, False, False, False, False]
    # The loss peak bounds it from below: 55 + 10 > 60 keeps nothing, 66 keeps the root (65), not a block (75).
    assert kept_on_gpu(c, _measured(60, 40, 55), GradsOnGpu.LEAVE) == [False] * 5
    assert kept_on_gpu(c, _measured(66, 40, 55), GradsOnGpu.LEAVE) == [True, False, False, False, False]
    # Leaving gradients let more stay than gradients kept on the GPU do, at the same limit.
    assert sum(kept_on_gpu(c, _measured(70, 40, 30), GradsOnGpu.LEAVE)) == 3
    assert sum(kept_on_gpu(c, _measured(70, 40, 30), GradsOnGpu.ACCUMULATE)) == 3
    assert sum(kept_on_gpu(c, _measured(70, 40, 30), GradsOnGpu.WAIT)) == 2


def test_a_shard_on_the_host_keeps_its_state_there_without_ending_the_run():
    c = [Candidate(True, 10, 2, False), Candidate(False, 10, 2, True), Candidate(True, 10, 2, True)]
    assert kept_on_gpu(c, _measured(100, 40, 30), GradsOnGpu.ACCUMULATE) == [True, False, True]


def test_the_speculative_share_goes_to_the_last_blocks_first():
    c = [Candidate(True, 10, 2, False, 12)] + [Candidate(True, 10, 2, True, 12) for _ in range(4)]
    kept = [True, True, False, False, False]
    assert speculation_share(c, kept, 30) == [False, False, False, True, True]
    assert speculation_share(c, kept, 100) == [False, False, True, True, True]  # never a kept one, nor the root
    assert speculation_share(c, kept, 11) == [False] * 5
    no_spare = [Candidate(True, 10, 2, True, 0)] * 3
    assert speculation_share(no_spare, [False] * 3, 100) == [False] * 3


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)  # 4160 parameters: 33,280 bytes of fp32 state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 64)  # 576 parameters
        self.layers = nn.ModuleList(Layer() for _ in range(4))
        self.head = nn.Linear(64, 1)  # 65 parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) if x.shape[-1] == 64 else layer(self.inp(x))
        return self.head(x).pow(2).mean()


class RecordingGauge(FakeGauge):
    """A card of ``card`` bytes whose steps peak at ``peak`` bytes; it records, whenever the optimizer's decision
    reads the peak, how many parameters had optimizer state then."""

    def __init__(self, card: int, peak: int) -> None:
        super().__init__()
        self.card, self.top = card, peak
        self.state_seen = []
        self.optimizer = None

    def peak(self) -> int:
        if self.optimizer is not None:
            self.state_seen.append(sum(1 for s in self.optimizer.state.values() if s))
        return super().peak()


def _train(monkeypatch, gauge, steps=3, mode=False):
    """Train the model with the offload optimizer deciding on ``gauge``'s card, and with AdamOptimizer from the same
    sharded values; whether the parameters came out the same."""
    torch.manual_seed(0)
    model = bmt.wrap(Model())
    torch.manual_seed(0)
    reference = bmt.wrap(Model())
    monkeypatch.setattr(adam_offload, "gauge_for", lambda device: gauge)
    opt = bmt.optim.AdamOffloadOptimizer(model.parameters(), lr=1e-2, offload_fraction="auto", step_in_backward=mode)
    gauge.optimizer = opt
    ref_opt = bmt.optim.AdamOptimizer(reference.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=data)
        for m, o in ((model, opt), (reference, ref_opt)):
            m(x).backward()
            o.step()
            o.zero_grad()
    opt.wait()
    return opt, all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


# The parameters in the order the next forward needs them (the root's first) and what each kept on the device
# costs with gradients waiting there for the CPU (step_in_backward=False): fp32 state, 8 bytes per element, less the
# 4-byte gradient it spares.
FORWARD_ORDER = [512, 64, 64, 1, 4096, 64, 4096, 64, 4096, 64, 4096, 64]  # inp, head, then each layer's fc


@pytest.mark.parametrize("kept", [0, 4, 5, 6, 12])
def test_the_first_step_decides_from_the_card_before_any_state_exists(monkeypatch, kept):
    card = 10 * GIB
    limit = card - int((placement.AUTO_HEADROOM + placement.FIXED_SEGMENTS_HEADROOM) * card)  # nothing outside
    room = 4 * sum(FORWARD_ORDER[:kept])  # exactly the first `kept` parameters fit
    grads = 4 * sum(FORWARD_ORDER)
    gauge = RecordingGauge(card=card, peak=limit - grads - room)
    opt, same = _train(monkeypatch, gauge)
    assert opt.auto_report["params_on_gpu"] == kept, opt.auto_report
    assert opt.offload_fraction == pytest.approx(1 - sum(FORWARD_ORDER[:kept]) / sum(FORWARD_ORDER))
    assert gauge.state_seen and set(gauge.state_seen) == {0}, "the decision read the card after state existed"
    assert same, "the optimizer with part of its state on the device trained otherwise than AdamOptimizer"


def test_a_room_of_one_byte_less_keeps_one_parameter_less(monkeypatch):
    card = 10 * GIB
    limit = card - int((placement.AUTO_HEADROOM + placement.FIXED_SEGMENTS_HEADROOM) * card)
    gauge = RecordingGauge(card=card, peak=limit - 4 * sum(FORWARD_ORDER) - (4 * sum(FORWARD_ORDER[:6]) - 1))
    opt, _ = _train(monkeypatch, gauge)
    assert opt.auto_report["params_on_gpu"] == 5


@pytest.mark.parametrize("kept", [0, 5, 12])
def test_with_speculative_updates_the_gradients_leave_and_the_state_takes_their_room(monkeypatch, kept):
    # The gradients of the state updated on the host leave the device in backward (the fake card's peak is the step
    # with them gone): a kept parameter costs its whole state, 8 bytes per element, and a block's also its gradient,
    # which stays on the device for the device's update (the root's gradients complete with backward: there anyway).
    card = 10 * GIB
    limit = card - int((placement.AUTO_HEADROOM + placement.FIXED_SEGMENTS_HEADROOM) * card)
    room = sum((8 if index < 4 else 12) * numel for index, numel in enumerate(FORWARD_ORDER[:kept]))
    gauge = RecordingGauge(card=card, peak=limit - room)
    opt, same = _train(monkeypatch, gauge, mode="speculative")
    assert opt.auto_report["params_on_gpu"] == kept and opt.auto_report["grads"] == "leave", opt.auto_report
    assert set(gauge.state_seen) == {0}
    assert same


def test_a_named_card_is_its_memory():
    assert parse_bytes("H100") == CARDS["h100"] == parse_bytes("h100")
    with pytest.raises(ValueError, match="or a card \\(a100-40gb, a100-80gb, h100, h200\\)"):
        parse_bytes("H300")


def test_the_plan_shows_what_auto_adam_keeps_on_a_card():
    from test_wrap import tiny_llama

    from bmtwrap.engine.memory import MIN_MARGIN, outside_allocator_estimate
    from bmtwrap.engine.offload import adam_state_bytes

    model = tiny_llama(num_hidden_layers=4)
    roomy = bmt.plan(model, world_size=1, batch_size=2, seq_len=8, max_gpu_memory="H100")
    assert roomy.offload.decided and roomy.offload.fraction == 0.0  # all of the state fits an H100
    # The first step as the optimizer measures it: every block checkpointed, no state on the GPU.
    first = bmt.plan(model, world_size=1, batch_size=2, seq_len=8, checkpoint=True, offload_optimizer=True,
                     step_in_backward=False).memory
    blocks = {id(p) for layer in model.model.layers for p in layer.parameters()}
    order = [p for p in model.parameters() if id(p) not in blocks] + [p for p in model.parameters() if id(p) in blocks]
    candidates = [Candidate(True, p.numel() * adam_state_bytes(p.dtype), p.numel() * p.element_size(), id(p) in blocks)
                  for p in order]
    budget = first.total + MIN_MARGIN + outside_allocator_estimate(1) + sum(c.state for c in candidates) // 2
    measured = Measured(budget, outside_allocator_estimate(1), MIN_MARGIN, first.total, first.loss_peak)
    kept = kept_on_gpu(candidates, measured, GradsOnGpu.LEAVE)
    assert 0 < sum(kept) < len(kept)  # the case is in the middle
    expected = 1 - sum(p.numel() for p, keep in zip(order, kept) if keep) / sum(p.numel() for p in order)
    half = bmt.plan(model, world_size=1, batch_size=2, seq_len=8, max_gpu_memory=budget)
    assert half.offload.decided and half.offload.fraction == pytest.approx(expected)
    assert "auto_adam's choice" in str(half)
    # Without a card nothing is decided: auto_adam's optimizer is planned as it runs where everything fits.
    unknown = bmt.plan(model, world_size=1, batch_size=2, seq_len=8)
    assert not unknown.offload.decided and not unknown.offload.optimizer


def test_auto_adam_takes_the_offload_optimizer_on_a_gpu_only():
    model = bmt.wrap(Model())
    assert type(bmt.optim.auto_adam(model.parameters())) is bmt.optim.AdamOptimizer  # the CPU: nothing to spare


def test_an_optimizer_whose_state_cannot_fit_says_so_before_making_it(monkeypatch):
    model = bmt.wrap(Model())
    opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2)
    gpu = torch.device("cuda", 0)
    # A card with 64 KiB left, less than this model's fp32 state (8 bytes per element); then exactly that.
    monkeypatch.setattr(opt, "_state_device", lambda p: gpu)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (64 * 1024, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    params = list(model.parameters())
    needed = 8 * sum(p.numel() for p in params)
    with pytest.raises(torch.OutOfMemoryError, match=f"AdamOptimizer: its state \\(fp32 master and moments\\) needs "
                       f"{needed / 2**30:.1f} GiB on cuda:0, which has 0.0 GiB left; nothing was made or updated. "
                       "bmtwrap.optim.auto_adam"):
        opt._check_room(params)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (needed, 80 * GIB))
    opt._check_room(params)  # exactly enough: no error


def test_bad_step_in_backward_is_refused():
    model = bmt.wrap(Model())
    with pytest.raises(ValueError, match="step_in_backward must be one of False, True, 'speculative', 'auto', "
                                         "got 'always'"):
        bmt.optim.AdamOffloadOptimizer(model.parameters(), step_in_backward="always")
    with pytest.raises(ValueError, match="offload_optimizer must be True, False or 'auto', got 'yes'"):
        bmt.plan(Model(), offload_optimizer="yes")
