"""fp32 masters kept as bf16 weights plus low halves (ops.split_master, ops.join_master, ops.adam_step_split).

The compiled halves (csrc/common.h, used by the CUDA kernel too) are checked bit for bit against the
plain-PyTorch ones on every float32 pattern class: random bits (NaNs included), ties, the largest finite
values, subnormals, zeros and infinities. The fused CUDA step (tests marked `cuda`) must give the same bits
as the CPU's join, update, split.
"""

from __future__ import annotations

import pytest
import torch

from bmtwrap import ops

CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: torch.cuda.is_available() is False"),
]
ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _masters(n: int = 1 << 18, seed: int = 0) -> torch.Tensor:
    """Random bit patterns, ties both ways, the extremes of the range, zeros and infinities."""
    g = torch.Generator().manual_seed(seed)
    random = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    high = torch.randint(0, 1 << 16, (4096,), generator=g, dtype=torch.int64)
    ties = ((high << 16) | 0x8000).to(torch.int64)
    ties = torch.where(ties >= 2**31, ties - 2**32, ties).to(torch.int32).view(torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.3895e38, -3.3895e38,
                            3.4028234663852886e38, 1e-45, -1e-45, 1e-40, 1.0, -1.0, 1.00390625])
    return torch.cat([random, ties, special, torch.randn(n, generator=g)])


def _split(master: torch.Tensor):
    weight = torch.empty(master.shape, dtype=torch.bfloat16, device=master.device)
    low = torch.empty(master.shape, dtype=torch.int16, device=master.device)
    ops.split_master(master, weight, low)
    return weight, low


def test_split_rounds_to_nearest_even_and_matches_the_reference() -> None:
    master = _masters()
    weight, low = _split(master)
    ref_weight, ref_low = torch.empty_like(weight), torch.empty_like(low)
    ops._split_master_reference(master, ref_weight, ref_low)
    assert torch.equal(_bits(weight), _bits(ref_weight)) and torch.equal(low, ref_low)
    finite = ~torch.isnan(master)
    assert torch.equal(_bits(weight[finite]), _bits(master[finite].to(torch.bfloat16)))  # what .to(bf16) gives
    assert torch.isnan(weight[~finite].float()).all() and (low[~finite] == 0).all()


def test_join_gives_the_master_back() -> None:
    master = _masters()
    weight, low = _split(master)
    joined = ops.join_master(weight, low)
    assert torch.equal(_bits(joined), _bits(ops._join_master_reference(weight, low)))
    exact = _bits(joined) == _bits(master)
    nan = torch.isnan(master)
    assert torch.isnan(joined[nan]).all()
    # The documented exceptions, and nothing else: a tie that rounded down (one fp32 ulp toward its weight),
    # a master that rounds to zero or to an infinity (the weight is its own master).
    lost = ~exact & ~nan
    tie_down = (_bits(master).to(torch.int64) & 0xFFFF) == 0x8000
    to_zero_or_inf = (weight.float() == 0) | torch.isinf(weight.float())
    assert (tie_down | to_zero_or_inf)[lost].all()
    one_ulp = (_bits(master)[lost & tie_down].to(torch.int64) - _bits(joined)[lost & tie_down].to(torch.int64))
    assert (one_ulp == 1).all() and (lost & tie_down).sum() > 1000  # the ties were exercised
    assert torch.equal(_bits(joined[lost & tie_down].to(torch.bfloat16)), _bits(weight[lost & tie_down]))
    assert exact[~nan & ~tie_down & ~to_zero_or_inf].all()


def test_a_weight_written_over_another_low_half_keeps_its_value() -> None:
    g = torch.Generator().manual_seed(1)
    weight = torch.cat([torch.randn(1 << 18, generator=g), torch.tensor([0.0, -0.0, float("inf"), -float("inf")])])
    weight = weight.to(torch.bfloat16)
    low = torch.randint(-(2**15), 2**15, weight.shape, generator=g, dtype=torch.int64).to(torch.int16)
    low[:4096] = -(2**15)  # 0x8000: the one low half whose rounding depends on the weight's last bit
    joined = ops.join_master(weight, low)
    assert torch.equal(_bits(joined.to(torch.bfloat16)), _bits(weight))
    assert torch.equal(_bits(joined), _bits(ops._join_master_reference(weight, low)))
    assert torch.equal(_bits(joined[-4:]), _bits(weight[-4:].float()))  # zeros and infinities: themselves


def test_adam_step_split_is_adam_on_the_master() -> None:
    """Five steps through the split master end where five steps of an fp32 master end (up to the one-ulp
    tie rule), and the weights are that master rounded."""
    g = torch.Generator().manual_seed(2)
    n = 100_003
    master = torch.randn(n, generator=g)
    weight, low = _split(master)
    master = ops.join_master(weight, low)  # start from what the halves hold
    m, v = torch.zeros(n), torch.zeros(n)
    m2, v2 = torch.zeros(n), torch.zeros(n)
    for step in range(1, 6):
        grad = torch.randn(n, generator=g).to(torch.bfloat16)
        ops.adam_step_cpu(master, grad, m, v, step=step, **ADAM)
        ops.adam_step_split(weight, low, grad, m2, v2, step=step, **ADAM)
    joined = ops.join_master(weight, low)
    assert torch.equal(m, m2) and torch.equal(v, v2)
    assert (joined - master).abs().max() <= 4 * torch.finfo(torch.float32).eps * master.abs().max()
    assert torch.equal(_bits(weight), _bits(joined.to(torch.bfloat16)))
    assert not torch.equal(_bits(weight), _bits(torch.randn(n, generator=g).to(torch.bfloat16)))


@pytest.mark.parametrize("bad, message", [
    (dict(weight=torch.zeros(4)), "weight has dtype torch.float32; expected torch.bfloat16"),
    (dict(low=torch.zeros(4, dtype=torch.int32)), "low has dtype torch.int32; expected torch.int16"),
    (dict(exp_avg=torch.zeros(5)), "exp_avg has 5 elements but weight has 4"),
    (dict(grad=torch.zeros(4, dtype=torch.int64)), "grad has dtype torch.int64"),
])
def test_adam_step_split_argument_errors(bad: dict, message: str) -> None:
    args = dict(weight=torch.zeros(4, dtype=torch.bfloat16), low=torch.zeros(4, dtype=torch.int16),
                grad=torch.zeros(4), exp_avg=torch.zeros(4), exp_avg_sq=torch.zeros(4))
    args.update(bad)
    with pytest.raises((TypeError, ValueError), match=message):
        ops.adam_step_split(**args, step=1, **ADAM)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_fused_cuda_step_matches_the_cpu(device: str, offset: int, grad_dtype: torch.dtype) -> None:
    """The kernel's join, Adam and split give the CPU's bits (Adam to an ulp: see test_cuda_kernels.py), on
    views that start anywhere; a set skip flag writes nothing."""
    g = torch.Generator().manual_seed(3)
    n = 1_000_003
    master = torch.cat([torch.randn(n, generator=g), _masters(4096, seed=4)])
    master = master[master.abs() < 1e38]  # no NaN, nothing whose weight rounds to an infinity
    weight, low = _split(master)
    m = torch.rand(master.numel(), generator=g)
    v = torch.rand(master.numel(), generator=g)
    grad = torch.randn(master.numel(), generator=g).to(grad_dtype)

    def on_gpu(t: torch.Tensor) -> torch.Tensor:
        room = torch.empty(t.numel() + offset, dtype=t.dtype, device=device)
        room[offset:].copy_(t)
        return room[offset:]

    gw, gl, gm, gv, gg = (on_gpu(t) for t in (weight, low, m, v, grad))
    skip = torch.ones(1, dtype=torch.uint8, device=device)
    ops.adam_step_split(gw, gl, gg, gm, gv, step=3, skip_if=skip, **ADAM)
    assert torch.equal(_bits(gw.cpu()), _bits(weight)) and torch.equal(gl.cpu(), low)
    ops.adam_step_split(gw, gl, gg, gm, gv, step=3, **ADAM)
    ops.adam_step_split(weight, low, grad, m, v, step=3, **ADAM)
    cpu, gpu = ops.join_master(weight, low), ops.join_master(gw.cpu(), gl.cpu())
    assert ((gpu - cpu).abs() <= 4e-6 * cpu.abs() + 1e-6 * cpu.abs().max()).all()
    assert torch.equal(_bits(gw.cpu()), _bits(gpu.to(torch.bfloat16)))
    assert torch.allclose(gm.cpu(), m, rtol=4e-6, atol=1e-7) and torch.allclose(gv.cpu(), v, rtol=4e-6, atol=1e-9)
