"""tests/adamw_replay.py, the replay the Trainer test holds bmtwrap's updates to: its fused multiply-add and sqrt
against exact rational arithmetic, and its AdamW step against bmtwrap's CPU kernel, bit for bit."""

from __future__ import annotations

import struct
from fractions import Fraction

import pytest
import torch

import adamw_replay as R
from bmtwrap import ops


def _nearest_float(exact: Fraction) -> float:
    """``exact`` rounded to the nearest fp32, ties to even (the fp32 value, as a Python float)."""
    guess = torch.tensor(float(exact), dtype=torch.float32)
    candidates = [torch.nextafter(guess, torch.tensor(-1e30)), guess, torch.nextafter(guess, torch.tensor(1e30))]
    best = min(candidates, key=lambda c: (abs(Fraction(c.item()) - exact),
                                          struct.unpack("<I", struct.pack("<f", c.item()))[0] & 1))
    return best.item()


def _floats(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    exponent = torch.randint(-20, 20, (n,), generator=generator).float()
    return torch.randn(n, generator=generator) * torch.exp2(exponent) * scale


def test_fma_rounds_once():
    a, b, c = _floats(500, 0), _floats(500, 1), _floats(500, 2)
    # Exact sums that lie within 2^-70 of halfway between two floats round to a float64 exactly halfway, and
    # from there to even, wrongly: 1 + 2^-23 + 2^-24 - 2^-70 (below halfway, to even above), 1 + 2^-24 + 2^-70
    # (above halfway, to even below), and the first negated.
    one_ulp, halfway = 1 + 2.0**-23, 2.0**-24 * (1 - 2.0**-23)
    a = torch.cat([a, torch.tensor([one_ulp, -one_ulp, -one_ulp])])
    b = torch.cat([b, torch.tensor([halfway] * 3)])
    c = torch.cat([c, torch.tensor([one_ulp, one_ulp, -one_ulp])])
    got = R.fma(a, b, c)
    expected = [_nearest_float(Fraction(x) * Fraction(y) + Fraction(z)) for x, y, z in zip(a.tolist(), b.tolist(),
                                                                                       c.tolist())]
    assert got.tolist() == expected
    assert got[-3:].tolist() == [one_ulp, one_ulp, -one_ulp], "the sums near halfway"


def test_sqrt_is_correctly_rounded():
    x = torch.cat([_floats(500, 3).abs(), torch.tensor([0.0, 2.0**-149, 2.0**-126, 2.0, 3.0, 3.4e38])])
    got = R.sqrt(x)
    for value, root in zip(x.tolist(), got.tolist()):
        exact = Fraction(value)
        up = torch.nextafter(torch.tensor(root), torch.tensor(1e30)).item()
        down = torch.nextafter(torch.tensor(root), torch.tensor(0.0)).item()
        assert (Fraction(root) + Fraction(down)) ** 2 / 4 <= exact <= (Fraction(root) + Fraction(up)) ** 2 / 4, value


@pytest.mark.skipif(not ops.extension_available(), reason="bmtwrap._C is not built")
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_adamw_step_is_bmtwraps_kernel_bit_for_bit(isa):
    if isa not in ops._cpu_isas():
        pytest.skip(f"this CPU lacks {isa}")
    numel = 4099
    generator = torch.Generator().manual_seed(4)
    param = torch.randn(numel, generator=generator)
    mine = [param.clone(), torch.zeros(numel), torch.zeros(numel)]
    theirs = [param.clone(), torch.zeros(numel), torch.zeros(numel)]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    for step in range(1, 21):
        # Gradients over many magnitudes, some near eps and some zero, as a model's are.
        grad = torch.randn(numel, generator=generator) * torch.exp2(torch.randint(-40, 0, (numel,),
                                                                                generator=generator).float())
        grad[::97] = 0
        R.adamw_step(mine[0], grad, mine[1], mine[2], **hyper, step=step)
        ops._adam_step_cpu_with(theirs[0], grad, theirs[1], theirs[2], **hyper, step=step, grad_scale=1.0,
                                decoupled=True, out=None, isa=isa, num_threads=1)
        for ours, kernel, what in zip(mine, theirs, ("param", "exp_avg", "exp_avg_sq")):
            assert torch.equal(ours.view(torch.int32), kernel.view(torch.int32)), f"step {step}: {what} differs"
