"""AdamW replayed on recorded gradients, rounding as bmtwrap's CPU kernel rounds, and the bounds built on it.

[Note: replaying AdamW exactly]
bmtwrap's CPU Adam (csrc/cpu/adam.cpp, [Note: matching torch bit for bit]) computes, per fp32 element:

    p = p * float(1 - lr*wd)
    m = fma(w, g - m, m)          w = float(1 - beta1) < 0.5
    v = fma(float(1 - beta2) * g, g, v * float(beta2))
    d = sqrt(v) / float(bc2_sqrt) + float(eps)
    p = p + (float(-lr / bc1) * m) / d

every operation correctly rounded (sqrt and division included) or one fused multiply-add. :func:`adamw_step`
computes the same with torch's fp32 multiply, divide, add and subtract, which are correctly rounded on every
CPU and instruction set, plus two operations rounded once by construction: the fused multiply-add from an
exact float64 product and a float64 sum whose error is recovered exactly (TwoSum), and sqrt from float64,
checked against the midpoints around it. So a replay is bit for bit what bmtwrap computes from the same
gradients, on any CPU.

torch.optim.AdamW computes the same formula and rounds differently in places: its sqrt from MKL's vector math
on the single-tensor path, not always correctly rounded; on the fused path, the one plain Trainer uses on the
CPU, ``v * beta2 + ((1 - beta2) * g) * g`` as the compiler contracts it, and lerp unfused in its scalar tail
and without AVX2. :func:`deviation_bound` allows for any such rounding (see [Note: how far apart gradients
take AdamW]).

The fused multiply-add is exact for results in fp32's normal range and zero, as Adam's moments are here; it
asserts that no result is subnormal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

Tensors = Dict[str, torch.Tensor]
U = 2.0**-24  # unit roundoff of fp32 (round to nearest)


@dataclass(frozen=True)
class AdamWGroup:
    """One param group of the optimizer being replayed: its parameters' names and hyper-parameters."""

    names: Tuple[str, ...]
    weight_decay: float
    betas: Tuple[float, float]
    eps: float


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` for fp32 tensors, rounded once to fp32 (to nearest even)."""
    product = a.double() * b.double()  # exact: 24 + 24 significant bits
    c64 = c.double()
    total = product + c64  # rounded to float64; TwoSum recovers what that rounding lost, exactly
    c_part = total - product
    lost = (product - (total - c_part)) + (c64 - c_part)
    # Rounding ``total`` to fp32 rounds the exact sum correctly unless ``total`` lies exactly halfway between
    # two floats and something was lost: then the exact sum lies on the side of ``lost``.
    assert not ((total != 0) & (total.abs() < 2.0**-126)).any(), "a subnormal result: the halfway test is wrong there"
    halfway = (total.view(torch.int64) & 0x1FFFFFFF) == 0x10000000  # the 29 bits below fp32's last are 100...0
    nudged = torch.nextafter(total, lost.sign() * math.inf)  # total + lost would round back to total
    return torch.where(halfway & (lost != 0), nudged, total).float()


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root of a non-negative fp32 tensor, whatever library computes sqrt."""
    root = x.double().sqrt().float()
    up, down = torch.nextafter(root, torch.tensor(math.inf)), torch.nextafter(root, torch.tensor(0.0))
    # The midpoints between neighbouring floats have 25 significant bits: their squares are exact in float64.
    upper, lower = (root.double() + up.double()) / 2, (root.double() + down.double()) / 2
    x64 = x.double()
    root = torch.where(x64 > upper * upper, up, root)
    return torch.where((x64 < lower * lower) & (root > 0), down, root)


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> None:
    """One AdamW step in place, rounding as bmtwrap's CPU kernel does (see [Note: replaying AdamW exactly])."""
    assert 1 - beta1 < 0.5, "the replay covers lerp's small-weight branch only"
    param.mul_(1 - lr * weight_decay)
    exp_avg.copy_(fma(torch.full_like(grad, 1 - beta1), grad - exp_avg, exp_avg))
    exp_avg_sq.copy_(fma(grad * (1 - beta2), grad, exp_avg_sq * beta2))
    denom = sqrt(exp_avg_sq) / (1 - beta2**step) ** 0.5 + eps  # ** 0.5 is C's pow, as bmtwrap's
    param.add_((exp_avg * (-lr / (1 - beta1**step))) / denom)


def replay(start: Tensors, grads: Sequence[Tensors], lrs: Sequence[Sequence[float]],
           groups: Sequence[AdamWGroup]) -> List[Tensors]:
    """AdamW from ``start`` on the given gradients, ``lrs[t][i]`` the learning rate of group i at step t + 1;
    the parameters after every step."""
    params = {name: value.clone() for name, value in start.items()}
    moments = {name: (torch.zeros_like(value), torch.zeros_like(value)) for name, value in start.items()}
    after: List[Tensors] = []
    for step, (grad, lr) in enumerate(zip(grads, lrs), start=1):
        for group, group_lr in zip(groups, lr):
            beta1, beta2 = group.betas
            for name in group.names:
                adamw_step(params[name], grad[name], *moments[name], lr=group_lr, beta1=beta1, beta2=beta2,
                           eps=group.eps, weight_decay=group.weight_decay, step=step)
        after.append({name: value.clone() for name, value in params.items()})
    return after


def gamma(n: int | torch.Tensor) -> float | torch.Tensor:
    """Higham's gamma_n = n u / (1 - n u): a sum or dot product of n fp32 terms, in any order, is off by at most
    gamma_(n-1) times the sum of the terms' absolute values."""
    return n * U / (1 - n * U)


def deviation_bound(start: Tensors, grads: Sequence[Tensors], radius: Sequence[Tensors],
                    lrs: Sequence[Sequence[float]], groups: Sequence[AdamWGroup]) -> Tensors:
    """Per element, how far the parameters of two fp32 AdamW runs from ``start`` may end apart when one is given
    ``grads[t]`` at step t + 1 and the other gradients within ``radius[t]`` of those, elementwise.

    See [Note: how far apart gradients take AdamW]."""
    bounds: Tensors = {}
    for index, group in enumerate(groups):
        beta1, beta2 = group.betas
        for name in group.names:
            bounds[name] = _deviation_bound_one(start[name], [g[name] for g in grads], [r[name] for r in radius],
                                                [lr[index] for lr in lrs], beta1, beta2, group.eps,
                                                group.weight_decay)
    return bounds


# [Note: how far apart gradients take AdamW]
# In exact arithmetic, AdamW's step t on one element is
#     p <- p (1 - lr wd) - lr q,   q = n / D,   n = m / (1 - beta1^t),   D = sqrt(v / (1 - beta2^t)) + eps,
# m and v the running averages of g and g^2. If each gradient g_s lies within r_s of the first run's, then m
# lies within m_rad = beta1 m_rad' + (1 - beta1) r of the first run's (m_rad' that of the step before), and v
# between the running averages of max(|g| - r, 0)^2 and of (|g| + r)^2. So n lies in [n_lo, n_hi] and D in
# [D_lo, D_hi], D > 0, hence q in [min(n_lo / D_lo, n_lo / D_hi), max(n_hi / D_lo, n_hi / D_hi)] -- for both
# runs: the two steps differ by at most that interval's width, times lr, which adds to how far the parameters
# already were apart times (1 - lr wd). The intervals ignore that m and v move together, so they are wider than
# a pair of runs needs; where r is of the order of |g| (a gradient that is rounding noise) they allow q to
# change sign, as Adam does: it divides a gradient by its own magnitude.
#
# Each run also rounds in fp32, u = 2^-24 per operation:
# - m = m' + (1 - beta1)(g - m'), fused or not: at most 2u (1 - beta1)(|g| + |m'|) for the subtraction and
#   the product and u |m| for the addition, plus beta1 times the error m' had: m_err; the intervals of n
#   widen by m_err / (1 - beta1^t);
# - v adds positive terms, so it stays within relative 4u per step of exact (four roundings unfused), 4 t u
#   after t steps; sqrt halves that and rounds once more, the division and eps twice more: D within relative
#   (2 t + 3) u;
# - q = (s m) / D rounds twice: relative 2u, and s = lr / (1 - beta1^t) rounded to fp32 once more;
# - the decay p (1 - lr wd) and the addition of -lr q round once each: u |p| each.
# Both runs' rounding adds to the bound, each term taken at the larger end of its interval.


def _deviation_bound_one(start: torch.Tensor, grads: List[torch.Tensor], radius: List[torch.Tensor],
                         lrs: List[float], beta1: float, beta2: float, eps: float,
                         weight_decay: float) -> torch.Tensor:
    zero = torch.zeros_like(start, dtype=torch.float64)
    m, m_rad, m_err, v_lo, v_hi = zero, zero, zero, zero, zero
    size = start.double().abs()  # at least |p| of either run
    apart = zero
    for step, (g, r, lr) in enumerate(zip(grads, radius, lrs), start=1):
        g, r = g.double(), r.double()
        g_big, m_big = g.abs() + r, m.abs() + m_rad + m_err  # |g| and |m| (before the step) of either run
        m = beta1 * m + (1 - beta1) * g
        m_rad = beta1 * m_rad + (1 - beta1) * r
        m_err = beta1 * m_err + U * (2 * (1 - beta1) * (g_big + m_big) + m.abs() + m_rad)
        v_lo = beta2 * v_lo + (1 - beta2) * (g.abs() - r).clamp_min(0) ** 2
        v_hi = beta2 * v_hi + (1 - beta2) * g_big**2
        bc1, bc2 = 1 - beta1**step, 1 - beta2**step
        d_rel = (2 * step + 3) * U
        d_lo = ((v_lo / bc2).sqrt() + eps) * (1 - d_rel)
        d_hi = ((v_hi / bc2).sqrt() + eps) * (1 + d_rel)
        n_lo, n_hi = (m - m_rad - m_err) / bc1, (m + m_rad + m_err) / bc1
        q_lo = torch.minimum(n_lo / d_lo, n_lo / d_hi)
        q_hi = torch.maximum(n_hi / d_lo, n_hi / d_hi)
        q_big = torch.maximum(q_lo.abs(), q_hi.abs())
        decayed = size * (1 - lr * weight_decay)
        size = decayed + lr * q_big
        rounding = 2 * U * (decayed + size + 3 * lr * q_big)  # both runs
        apart = apart * (1 - lr * weight_decay) + lr * (q_hi - q_lo) + rounding
    return apart
