"""The schedule's decisions and the engine's state transitions, on stand-ins (no process group, no collectives).

The multi-process tests check that training with the schedule matches an unwrapped model; these
check the policy itself: what is gathered at each point of a step, and which transitions are refused.
"""

from types import SimpleNamespace

import pytest
import torch

from bmtwrap.engine.schedule import Engine, Schedule, TrainingState, in_backward


class Fake(SimpleNamespace):
    """A stand-in for a runner: attributes as given, and weakly referable, as the engine refers to runners."""


def _block(name):
    return Fake(group=f"group {name}", next_block=None, prev_block=None, backward_done=lambda: None)


class _Root:
    def __init__(self, name):
        self.group = f"group {name}"


def _ran(schedule, *blocks, root=None):
    schedule.order.restart(root)
    for block in blocks:
        schedule.order.record(block)


def test_prefetch_follows_the_first_forward_order():
    schedule = Schedule()
    a, b, c = _block("a"), _block("b"), _block("c")
    root, other = _Root("root"), _Root("other")
    assert schedule.root_gathers(root) == ["group root"]  # nothing ran yet
    assert schedule.forward_gathers(a) == ["group a"]
    _ran(schedule, a, b, c, root=root)
    assert schedule.root_gathers(root) == ["group root", "group a"]
    assert schedule.root_gathers(other) == ["group other"]  # another model's first block is not this one's
    _ran(schedule, c, root=other)
    assert schedule.root_gathers(other) == ["group other", "group c"]
    assert schedule.forward_gathers(a) == ["group a", "group b"]
    assert schedule.forward_gathers(c) == ["group c"]
    assert schedule.backward_gathers(c) == ["group c", "group b"]
    assert schedule.backward_gathers(a) == ["group a"]
    _ran(schedule, c, b, a)  # another order later steers nothing: the links are set once
    assert schedule.forward_gathers(a) == ["group a", "group b"]


def test_a_block_run_twice_in_a_row_does_not_prefetch_itself():
    schedule = Schedule()
    a = _block("a")
    _ran(schedule, a, a)
    assert schedule.forward_gathers(a) == ["group a"] and schedule.backward_gathers(a) == ["group a"]


def test_the_last_block_is_known_only_after_a_whole_step():
    schedule = Schedule()
    a, b = _block("a"), _block("b")
    _ran(schedule, a, b)
    assert not schedule.runs_last(b)
    schedule.order.step_seen()
    assert schedule.runs_last(b) and not schedule.runs_last(a)


def test_engine_state_follows_roots_and_blocks():
    eng = Engine(Fake(rank=0))
    shared, other = object(), object()  # flat buffers, as far as the engine cares
    root = Fake(group=Fake(buffers=[shared]), backward_done=lambda: None)
    nested = Fake(group=Fake(buffers=[other]), backward_done=lambda: None)
    covered = Fake(group=Fake(buffers=[shared]), backward_done=lambda: None)
    assert eng.state is TrainingState.IDLE
    assert eng.enter_root(root) is True
    assert eng.state is TrainingState.FORWARD and eng.root_running(root)
    assert not eng.may_enter_root(root) and not eng.may_enter_root(covered)
    with pytest.raises(AssertionError, match="rank 0: a root entered where it may not"):
        eng.enter_root(root)
    assert eng.enter_root(nested) is False  # a separately wrapped model called inside this forward
    with pytest.raises(AssertionError, match="rank 0: a root left a forward it did not enter last"):
        eng.leave_root(root)
    eng.leave_root(nested)
    eng.enter_block()
    assert not eng.may_enter_root(nested)  # a block gathers what it runs
    eng.leave_block()
    eng.leave_root(root)
    assert eng.state is TrainingState.IDLE and not eng.root_running(root)
    eng.enter_block()
    assert eng.state is TrainingState.FORWARD
    eng.leave_block()
    with pytest.raises(AssertionError, match="rank 0: a block left more often than blocks entered"):
        eng.leave_block()
    assert [eng.next_block_number() for _ in range(3)] == [0, 1, 2]


def test_in_backward_is_true_only_while_autograd_runs_a_backward():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(in_backward())
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(in_backward())
            return grad

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [False, True] and not in_backward()
