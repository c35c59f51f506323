"""bmtwrap.ops.OffloadQueue: Adam updates run by the C++ worker thread, against ops.adam_step_cpu.

The queue runs the same CPU kernel as adam_step_cpu, chunk by chunk, so every result must equal a direct
call on the same inputs bit for bit (the kernel's results depend neither on how a buffer is cut nor on the
thread count). On a GPU the gradient goes to pinned staging and the rounded parameter comes back: still
bit for bit, since the copies are exact.
"""

from __future__ import annotations

import warnings
import weakref

import pytest
import torch

from bmtwrap import ops

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=3, grad_scale=0.5, decoupled=True)


def _state(numel: int, dtype: torch.dtype, device: str, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(numel, generator=gen)
    state = {
        "master": master,
        "grad": torch.randn(numel, generator=gen).to(dtype),
        "exp_avg": torch.randn(numel, generator=gen) * 0.1,
        "exp_avg_sq": torch.rand(numel, generator=gen) * 0.01,
    }
    state["param"] = master.to(dtype)
    return state


def _update(state: dict, device: str, priority: int = 0, **hyper) -> ops.OffloadUpdate:
    own = device == "cpu" and state["param"].dtype == torch.float32
    param = state["master"] if own else state["param"].to(device)
    state["live_param"] = param
    return ops.OffloadUpdate(param, state["grad"].to(device), state["master"], state["exp_avg"],
                             state["exp_avg_sq"], {**HYPER, **hyper}, priority)


def _expected(state: dict, **hyper) -> dict:
    """adam_step_cpu on copies of the inputs."""
    out = {k: v.clone() for k, v in state.items() if k in ("master", "exp_avg", "exp_avg_sq")}
    low = None if state["param"].dtype == torch.float32 else torch.empty(out["master"].numel(), dtype=state["param"].dtype)
    ops.adam_step_cpu(out["master"], state["grad"], out["exp_avg"], out["exp_avg_sq"], out=low, **{**HYPER, **hyper})
    out["param"] = out["master"] if low is None else low
    return out


def _check_equal(state: dict, expected: dict) -> None:
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(state[name], expected[name]), name
    assert torch.equal(state["live_param"].cpu(), expected["param"]), "param"


def _devices() -> list:
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_updates_equal_adam_step_cpu(device, dtype):
    queue = ops.OffloadQueue(torch.device(device), dtypes={dtype}, chunk_numel=1000, slots=3, num_threads=2)
    sizes = [1, 999, 1000, 1001, 3500, 7, 2048]  # chunk edges, several chunks, tiny ones
    states = [_state(n, dtype, device, seed) for seed, n in enumerate(sizes)]
    expected = [_expected(s) for s in states]
    tickets = queue.submit([_update(s, device) for s in states])
    for ticket in tickets:
        ticket.wait()
    assert all(t.done() for t in tickets)
    if device == "cuda":
        torch.cuda.synchronize()
    for state, want in zip(states, expected):
        _check_equal(state, want)


@pytest.mark.parametrize("device", _devices())
def test_many_submissions_then_wait_all(device):
    """Submissions while the worker runs, in several calls, some updating one buffer twice in order."""
    queue = ops.OffloadQueue(torch.device(device), dtypes={torch.bfloat16}, chunk_numel=4096, slots=2)
    states = [_state(10_000 + 37 * i, torch.bfloat16, device, 100 + i) for i in range(12)]
    expected = [_expected(_expected_inputs(s, step=4), step=5) for s in [_clone(s) for s in states]]
    for state in states:
        queue.submit([_update(state, device, step=4)])
    queue.submit([_update(state, device, step=5) for state in states])  # same buffers again: runs after
    queue.wait_all()
    if device == "cuda":
        torch.cuda.synchronize()
    for state, want in zip(states, expected):
        _check_equal(state, want)


def _clone(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def _expected_inputs(state: dict, **hyper) -> dict:
    """The state after one adam_step_cpu, with the same gradient for the next."""
    after = _expected(state, **hyper)
    return {**after, "grad": state["grad"], "param": after["param"]}


def _big_and_small(queue, *, big_priority=0, small_priority=0, submit_together=False):
    """A long update (4 Mi elements on one thread: milliseconds) and a short one; returns their tickets."""
    big = _update(_state(4 << 20, torch.float32, "cpu", 7), "cpu", priority=big_priority)
    small = _update(_state(5000, torch.float32, "cpu", 8), "cpu", priority=small_priority)
    if submit_together:
        return queue.submit([big, small])
    return queue.submit([big])[0], queue.submit([small])[0]


def _one_thread_queue() -> ops.OffloadQueue:
    return ops.OffloadQueue(torch.device("cpu"), dtypes={torch.float32}, chunk_numel=4096, slots=2, num_threads=1)


def test_newest_update_goes_first():
    """Before prioritise(), an update submitted while an older one runs overtakes it (between chunks).

    Seen from this thread: the small update done while the big one is not. Oldest-first can never
    show that (the big one would end before the small one starts). The big update lasts
    milliseconds, so on a loaded machine this thread may be descheduled long enough for it to end
    before the small one is submitted, or before this thread looks again; such a try proves nothing
    either way, and another is made.
    """
    for _ in range(20):
        queue = _one_thread_queue()
        big, small = _big_and_small(queue)
        small.wait()
        overtaken = not big.done()
        queue.wait_all()
        if overtaken:
            return
    raise AssertionError("in 20 tries the small update never finished before the big one: the newest does not go "
                         "first")


def test_prioritise_takes_the_lowest_priority_first():
    queue = _one_thread_queue()
    queue.prioritise()  # as the optimizer's step() does: then it submits
    big, small = _big_and_small(queue, big_priority=0, small_priority=1, submit_together=True)
    small.wait()  # the newest, but of the higher priority: it runs last
    assert big.done()
    queue.wait_all()


def test_updates_of_one_buffer_keep_their_order():
    """Two updates of the same buffers with different learning rates: their order shows in the result, and
    it is the order of submission whatever the priorities and newest-first say."""
    queue = _one_thread_queue()
    shared = _state(50_000, torch.float32, "cpu", 8)
    first, second = dict(lr=1e-2, step=1), dict(lr=3e-3, step=2)
    in_order = _expected(_expected_inputs(shared, **first), **second)
    swapped = _expected(_expected_inputs(shared, **second), **first)
    assert not torch.equal(in_order["master"], swapped["master"])  # the test can tell the two apart
    queue.submit([_update(shared, "cpu", priority=1, **first)])
    queue.submit([_update(shared, "cpu", priority=0, **second)])
    queue.prioritise()
    queue.wait_all()
    _check_equal(shared, in_order)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("numel", [50_001, 3_000_003])  # the larger streams its stores
def test_an_update_written_elsewhere_leaves_its_inputs_and_alternates_in_order(device, numel):
    """master_out, exp_avg_out and exp_avg_sq_out receive what an update in place would write, bit for bit, and the
    inputs stay as they were; two updates that alternate between the two sets of state, under one order key, run
    in the order they were submitted whatever their priorities."""
    queue = ops.OffloadQueue(torch.device(device), dtypes={torch.bfloat16}, chunk_numel=1 << 20, slots=2)
    state = _state(numel, torch.bfloat16, device, 4)
    before = {k: v.clone() for k, v in state.items()}
    first, second = dict(lr=1e-2, step=1), dict(lr=3e-3, step=2)
    after_first = _expected(state, **first)
    expected = _expected(_expected_inputs_from(after_first, state), **second)
    spare = {name: torch.full((numel,), float("nan")) for name in ("master", "exp_avg", "exp_avg_sq")}
    update = _update(state, device, priority=1, **first)
    targets = dict(master_out=spare["master"], exp_avg_out=spare["exp_avg"], exp_avg_sq_out=spare["exp_avg_sq"])
    queue.submit([update._replace(**targets, order=7)])
    # The second reads the spare set and writes back into the first set: it must wait for the first.
    back = ops.OffloadUpdate(update.param, update.grad, spare["master"], spare["exp_avg"], spare["exp_avg_sq"],
                             {**HYPER, **second}, 0, state["master"], state["exp_avg"], state["exp_avg_sq"], 7)
    queue.submit([back])
    queue.prioritise()
    queue.wait_all()
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(spare[name], after_first[name]), name
    _check_equal(state, expected)
    assert torch.equal(state["grad"], before["grad"])


def test_writing_elsewhere_needs_a_separate_master():
    queue = _one_thread_queue()
    state = _state(1000, torch.float32, "cpu", 5)
    update = _update(state, "cpu")  # an fp32 host parameter: its own master
    with pytest.raises(ValueError, match="its own master .* is updated in place; master_out, exp_avg_out and "
                                         "exp_avg_sq_out need a separate master"):
        queue.submit([update._replace(master_out=torch.zeros(1000), exp_avg_out=torch.zeros(1000),
                                      exp_avg_sq_out=torch.zeros(1000))])
    state = _state(1000, torch.bfloat16, "cpu", 5)
    with pytest.raises(ValueError, match="master_out has 999 elements but param has 1000"):
        queue.submit([_update(state, "cpu")._replace(master_out=torch.zeros(999), exp_avg_out=torch.zeros(1000),
                                                     exp_avg_sq_out=torch.zeros(1000))])


def _expected_inputs_from(result: dict, state: dict) -> dict:
    """The inputs of an update that starts from ``result`` (a step's outcome) with ``state``'s gradient."""
    return {"master": result["master"], "exp_avg": result["exp_avg"], "exp_avg_sq": result["exp_avg_sq"],
            "grad": state["grad"], "param": result["param"]}


def test_dropping_the_queue_finishes_its_work():
    queue = ops.OffloadQueue(torch.device("cpu"), dtypes={torch.bfloat16}, chunk_numel=1024, slots=2)
    state = _state(50_000, torch.bfloat16, "cpu", 3)
    expected = _expected(state)
    queue.submit([_update(state, "cpu")])
    del queue
    _check_equal(state, expected)


def test_without_the_extension_updates_run_at_once(monkeypatch):
    monkeypatch.setattr(ops._ext, "extension_for", lambda device: None)
    queue = ops.OffloadQueue(torch.device("cpu"), dtypes={torch.bfloat16, torch.float32}, chunk_numel=100, slots=2)
    states = [_state(321, torch.bfloat16, "cpu", 1), _state(321, torch.float32, "cpu", 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = [_expected(s) for s in states]  # the reference, too
    tickets = queue.submit([_update(s, "cpu") for s in states])
    assert all(t.done() for t in tickets)
    for state, want in zip(states, expected):
        for name in ("master", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[name], want[name], rtol=1e-6, atol=1e-7)


def _bad(name: str):
    """An update of a bf16 CPU parameter with one thing wrong."""
    state = _state(64, torch.bfloat16, "cpu", 5)
    u = _update(state, "cpu")
    if name == "grad_size":
        return u._replace(grad=u.grad[:10])
    if name == "master_dtype":
        return u._replace(master=u.master.double())
    if name == "moments_shared":
        return u._replace(exp_avg_sq=u.exp_avg)
    if name == "own_master_bf16":
        return u._replace(master=u.param)
    if name == "fp32_not_own_master":
        return u._replace(param=u.master.clone())
    if name == "hyper":
        return u._replace(hyper={**HYPER, "beta1": 1.5})
    if name == "not_contiguous":
        return u._replace(grad=torch.zeros(64, 2, dtype=torch.bfloat16)[:, 0])
    if name == "not_an_update":
        return tuple(u)
    raise AssertionError(name)


@pytest.mark.parametrize("name, error, match", [
    ("grad_size", ValueError, "grad has 10 elements but param has 64"),
    ("master_dtype", TypeError, "master has dtype torch.float64"),
    ("moments_shared", ValueError, "share memory"),
    ("own_master_bf16", TypeError, "master is a torch.bfloat16 tensor on cpu"),
    ("fp32_not_own_master", ValueError, "master must be param itself exactly when"),
    ("hyper", ValueError, "beta1 must be finite and in"),
    ("not_contiguous", ValueError, "grad is not contiguous"),
    ("not_an_update", TypeError, "expected an OffloadUpdate"),
])
def test_bad_updates_are_refused_before_anything_is_queued(name, error, match):
    queue = ops.OffloadQueue(torch.device("cpu"), dtypes={torch.bfloat16, torch.float32}, chunk_numel=16, slots=2)
    good = _state(64, torch.bfloat16, "cpu", 6)
    before = good["master"].clone()
    with pytest.raises(error, match=match):
        queue.submit([_update(good, "cpu"), _bad(name)])
    queue.wait_all()
    assert torch.equal(good["master"], before)  # the good one of the call was not queued either


def test_a_wider_dtype_than_declared_is_refused():
    queue = ops.OffloadQueue(torch.device("cpu"), dtypes={torch.bfloat16}, chunk_numel=16, slots=2)
    with pytest.raises(ValueError, match="wider than the dtypes the queue was made for"):
        queue.submit([_update(_state(8, torch.float32, "cpu", 0), "cpu")])


@pytest.mark.parametrize("kwargs, match", [
    (dict(chunk_numel=0, slots=2), "chunk_numel >= 1"),
    (dict(chunk_numel=8, slots=1), "slots >= 2"),
    (dict(chunk_numel=8, slots=2, num_threads=0), "num_threads must be a positive int"),
])
def test_bad_queue_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ops.OffloadQueue(torch.device("cpu"), dtypes={torch.float32}, **kwargs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("side_stream", [False, True], ids=["default_stream", "side_stream"])
def test_gpu_copies_are_ordered_with_the_current_stream(side_stream):
    """Without any synchronisation by the caller: the gradient is read only once the current stream has
    written it (a sleep kernel delays that), and work queued on the current stream after wait() sees the
    new parameter. Both streams matter: torch's default stream has the raw handle 0."""
    state = _state(8 << 20, torch.bfloat16, "cuda", 11)
    expected = _expected(state)
    queue = ops.OffloadQueue(torch.device("cuda"), dtypes={torch.bfloat16}, chunk_numel=1 << 20, slots=3)
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        param = state["param"].cuda()
        source = state["grad"].cuda()
        grad = torch.zeros_like(source)
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # tens of milliseconds before the gradient is written
        grad.copy_(source)
        ticket, = queue.submit([ops.OffloadUpdate(param, grad, state["master"], state["exp_avg"],
                                                  state["exp_avg_sq"], HYPER, 0)])
        ticket.wait()
        seen = param.clone()  # queued right after wait(): must follow the copy back
    torch.cuda.synchronize()
    assert torch.equal(state["master"], expected["master"])
    assert torch.equal(seen.cpu(), expected["param"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_queue_updates_host_shards_after_their_gradient_arrives(dtype):
    """A queue for a GPU takes host parameters (offloaded shards) whose gradient the current stream is
    still copying to pinned memory: it must wait for that copy, then update in place; a device update
    in the same submission is staged as usual."""
    host = _state(4 << 20, dtype, "cpu", 12)
    device = _state(3 << 20, torch.bfloat16, "cuda", 13)
    expected_host, expected_device = _expected(host), _expected(device)
    queue = ops.OffloadQueue(torch.device("cuda"), dtypes={dtype, torch.bfloat16}, chunk_numel=1 << 20, slots=2)
    param = host["master"] if dtype == torch.float32 else host["param"].clone()
    grad = torch.zeros(host["grad"].numel(), dtype=dtype, pin_memory=True)
    source = host["grad"].cuda()
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # the gradient reaches the host tens of milliseconds later
    grad.copy_(source, non_blocking=True)
    updates = [ops.OffloadUpdate(param, grad, host["master"], host["exp_avg"], host["exp_avg_sq"], HYPER, 0),
               _update(device, "cuda")]
    tickets = queue.submit(updates)
    for ticket in tickets:
        ticket.wait()
    torch.cuda.synchronize()
    assert torch.equal(host["master"], expected_host["master"])
    assert torch.equal(param, expected_host["param"])
    _check_equal(device, expected_device)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_shards_with_host_gradients_are_read_after_their_copy(dtype):
    """A GPU shard whose gradient the current stream is still copying to pinned memory: the worker must wait
    for that copy (no fetch of its own), update, and copy the parameter back; bit for bit, several chunks."""
    state = _state(5 << 20, dtype, "cuda", 15)
    expected = _expected(state)
    queue = ops.OffloadQueue(torch.device("cuda"), dtypes={dtype}, chunk_numel=1 << 20, slots=2)
    param = state["param"].cuda()
    grad = torch.zeros(state["grad"].numel(), dtype=dtype, pin_memory=True)
    source = state["grad"].cuda()
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # the gradient reaches the host tens of milliseconds later
    grad.copy_(source, non_blocking=True)
    ticket, = queue.submit([ops.OffloadUpdate(param, grad, state["master"], state["exp_avg"], state["exp_avg_sq"],
                                              HYPER, 0)])
    ticket.wait()
    seen = param.clone()  # queued after wait(): follows the copy back
    torch.cuda.synchronize()
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(state[name], expected[name]), name
    assert torch.equal(seen.cpu(), expected["param"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_parameter_with_a_device_gradient_is_refused():
    state = _state(1000, torch.bfloat16, "cpu", 14)
    queue = ops.OffloadQueue(torch.device("cuda"), dtypes={torch.bfloat16}, chunk_numel=100, slots=2)
    update = ops.OffloadUpdate(state["param"], state["grad"].cuda(), state["master"], state["exp_avg"],
                               state["exp_avg_sq"], HYPER, 0)
    with pytest.raises(ValueError, match="grad where param is or on the CPU"):
        queue.submit([update])


@pytest.mark.parametrize("device", _devices())
def test_a_waited_update_lets_its_gradient_go(device):
    """Once its ticket is waited for, the queue holds none of the update's tensors: a gradient on the GPU is
    freed then, not at the next submit (the next forward needs that memory)."""
    queue = ops.OffloadQueue(torch.device(device), dtypes={torch.bfloat16}, chunk_numel=1000, slots=3, num_threads=2)
    states = [_state(3000, torch.bfloat16, device, seed) for seed in range(2)]
    updates = [_update(s, device)._replace(grad=s["grad"].to(device, copy=True)) for s in states]  # ours alone
    grads = [weakref.ref(u.grad) for u in updates]
    tickets = queue.submit(updates)
    del updates
    tickets[0].wait()
    assert grads[0]() is None, "the queue still holds the gradient of a finished, waited-for update"
    tickets[1].wait()
    tickets[1].wait()  # a second wait is harmless
    assert grads[1]() is None
