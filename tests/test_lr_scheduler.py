"""The schedules' rates, checked at chosen iterations against values worked out by hand."""

import math

import pytest
import torch

from bmtwrap import lr_scheduler as S


def optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=123.0)


def rates(scheduler, iterations):
    out = []
    for it in iterations:
        scheduler.step(it)
        out.append(scheduler.current_lr)
    return out


def test_warmup_is_linear_from_zero():
    s = S.NoDecay(optimizer(), start_lr=1.0, warmup_iter=4, end_iter=10)
    assert rates(s, [0, 1, 2, 3, 4, 100]) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]


def test_rate_reaches_the_optimizer():
    opt = optimizer()
    s = S.NoDecay(opt, start_lr=0.5, warmup_iter=0, end_iter=0)
    assert opt.param_groups[0]["lr"] == 0.5 and s.get_last_lr() == [0.5]
    s.step()
    assert s.num_iter == 1 and opt.param_groups[0]["lr"] == 0.5


def test_linear():
    s = S.Linear(optimizer(), start_lr=2.0, warmup_iter=2, end_iter=6)
    assert rates(s, [1, 2, 3, 4, 5, 6, 9]) == [1.0, 2.0, 1.5, 1.0, 0.5, 0.0, 0.0]


def test_cosine():
    s = S.Cosine(optimizer(), start_lr=2.0, warmup_iter=2, end_iter=6)
    got = rates(s, [2, 4, 6, 50])
    assert got == pytest.approx([2.0, 1.0, 0.0, 0.0], abs=1e-12)
    s.step(3)
    assert s.current_lr == pytest.approx(1.0 + math.cos(math.pi / 4))


def test_noam():
    s = S.Noam(optimizer(), start_lr=1.0, warmup_iter=4, end_iter=100)
    assert rates(s, [2, 4, 16]) == pytest.approx([0.25, 0.5, 0.25])


def test_exponential_constructed_past_warmup():
    # BMTrain set gamma after the first step had already used it; here resuming at iteration 7 works.
    s = S.Exponential(optimizer(), start_lr=1.0, warmup_iter=2, end_iter=100, num_iter=7, gamma=0.5)
    assert s.current_lr == pytest.approx(0.5 ** 5)
    assert rates(s, [2, 3]) == pytest.approx([1.0, 0.5])


def test_state_dict_round_trip():
    opt = optimizer()
    a = S.Exponential(opt, start_lr=1.0, warmup_iter=2, end_iter=10, gamma=0.9)
    for _ in range(5):
        a.step()
    b = S.Exponential(optimizer(), start_lr=9.0, warmup_iter=0, end_iter=0, gamma=0.1)
    b.load_state_dict(a.state_dict())
    assert (b.num_iter, b.gamma, b.current_lr) == (5, 0.9, pytest.approx(0.9 ** 3))


@pytest.mark.parametrize("kwargs, message", [
    (dict(start_lr=-1.0, warmup_iter=0, end_iter=0), "start_lr must be >= 0"),
    (dict(start_lr=1.0, warmup_iter=-1, end_iter=0), "warmup_iter and num_iter must be >= 0"),
    (dict(start_lr=1.0, warmup_iter=5, end_iter=2), r"end_iter \(2\) must not be before the end of warmup \(5\)"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        S.Linear(optimizer(), **kwargs)
    with pytest.raises(ValueError, match=r"gamma must be in \(0, 1\]"):
        S.Exponential(optimizer(), 1.0, 0, 0, gamma=0.0)
