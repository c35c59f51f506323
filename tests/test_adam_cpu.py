"""bmtwrap.ops.adam_step_cpu against torch.optim.AdamW / Adam, against its plain-PyTorch reference, across the
ISA paths (scalar, AVX2, AVX-512) and thread counts, and every user-facing error."""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterator
from typing import NamedTuple

import pytest
import torch

from bmtwrap import ops

SIZES = [1, 17, 1000, 1_000_003]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
COPY_DTYPES = [None, torch.bfloat16, torch.float16]
ISAS = ["scalar", "avx2", "avx512"]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
# Integer views of the same width, to compare floats bit for bit (nan included).
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}

needs_extension = pytest.mark.skipif(not ops.extension_available(), reason="bmtwrap._C is not built")


class State(NamedTuple):
    param: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    def clone(self) -> State:
        return State(*(t.clone() for t in self))


def make_state(numel: int, seed: int = 0) -> State:
    generator = torch.Generator().manual_seed(seed)
    param = torch.randn(numel, generator=generator)
    # Non-zero moments, as after some steps, so that every term of the update matters from the first step.
    exp_avg = torch.randn(numel, generator=generator) * 0.1
    exp_avg_sq = torch.rand(numel, generator=generator) * 0.01
    return State(param, exp_avg, exp_avg_sq)


def make_grads(numel: int, steps: int, dtype: torch.dtype, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=generator).to(dtype) for _ in range(steps)]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(BITS[tensor.dtype])


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    mismatches = int((bits(actual) != bits(expected)).sum())
    assert mismatches == 0, f"{what}: {mismatches} of {actual.numel()} elements differ"


def assert_close_normwise(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = 1e-6) -> None:
    """max |actual - expected| <= rtol * max |expected|: relative error at fp32 rounding level, measured on the
    scale of the tensor, because elements that pass through zero have no meaningful elementwise relative error."""
    error = float((actual - expected).abs().max()) / max(float(expected.abs().max()), 1e-30)
    assert error <= rtol, f"{what}: normwise relative error {error:.3g} > {rtol:.0e}"


def run_steps(
    state: State,
    grads: list[torch.Tensor],
    *,
    out: torch.Tensor | None = None,
    weight_decay: float = 0.1,
    decoupled: bool = True,
    grad_scale: float = 1.0,
    isa: str | None = None,
    num_threads: int | None = None,
    reference: bool = False,
) -> None:
    for step, grad in enumerate(grads, start=1):
        kwargs = dict(HYPER, weight_decay=weight_decay, step=step, grad_scale=grad_scale, decoupled=decoupled, out=out)
        if reference:
            ops._adam_reference(*state[:1], grad, *state[1:], **kwargs)
        elif isa is not None or num_threads is not None:
            ops._adam_step_cpu_with(*state[:1], grad, *state[1:], **kwargs, isa=isa or "best",
                                    num_threads=num_threads if num_threads is not None else 0)
        else:
            ops.adam_step_cpu(*state[:1], grad, *state[1:], **kwargs)


def skip_unless_cpu_has(isa: str) -> None:
    if isa not in ops._cpu_isas():
        pytest.skip(f"this CPU lacks {isa} (it supports {', '.join(ops._cpu_isas())})")


@pytest.fixture
def fresh_fallback_warning() -> Iterator[None]:
    ops._warn_fallback.cache_clear()
    yield
    ops._warn_fallback.cache_clear()


# ------------------------------------------------------------------------------------------ against torch


@needs_extension
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("foreach", [False, True])
def test_matches_torch_adamw_over_100_steps(numel: int, weight_decay: float, foreach: bool) -> None:
    state = make_state(numel)
    weights = torch.nn.Parameter(state.param.clone())
    optimizer = torch.optim.AdamW([weights], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                  eps=HYPER["eps"], weight_decay=weight_decay, foreach=foreach)
    optimizer.state[weights].update(step=torch.tensor(0.0), exp_avg=state.exp_avg.clone(),
                                    exp_avg_sq=state.exp_avg_sq.clone())
    grads = make_grads(numel, 100, torch.float32)
    for grad in grads:
        weights.grad = grad
        optimizer.step()
    run_steps(state, grads, weight_decay=weight_decay)
    torch_state = optimizer.state[weights]
    # The moments do not depend on the parameters in AdamW: they match bit for bit. The parameters go
    # through sqrt, which torch takes from MKL (within an ulp, not always correctly rounded).
    assert_bitwise_equal(state.exp_avg, torch_state["exp_avg"], "exp_avg")
    assert_bitwise_equal(state.exp_avg_sq, torch_state["exp_avg_sq"], "exp_avg_sq")
    assert_close_normwise(state.param, weights.detach(), "param")


@needs_extension
@pytest.mark.parametrize("numel", [17, 1_000_003])
def test_matches_torch_adam_with_l2_weight_decay(numel: int) -> None:
    state = make_state(numel)
    weights = torch.nn.Parameter(state.param.clone())
    optimizer = torch.optim.Adam([weights], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                 eps=HYPER["eps"], weight_decay=0.1)
    optimizer.state[weights].update(step=torch.tensor(0.0), exp_avg=state.exp_avg.clone(),
                                    exp_avg_sq=state.exp_avg_sq.clone())
    grads = make_grads(numel, 100, torch.float32)
    for grad in grads:
        weights.grad = grad
        optimizer.step()
    run_steps(state, grads, weight_decay=0.1, decoupled=False)
    assert_close_normwise(state.param, weights.detach(), "param")
    assert_close_normwise(state.exp_avg, optimizer.state[weights]["exp_avg"], "exp_avg")
    assert_close_normwise(state.exp_avg_sq, optimizer.state[weights]["exp_avg_sq"], "exp_avg_sq")


# -------------------------------------------------------------------------------------- against reference


@needs_extension
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("copy_dtype", COPY_DTYPES, ids=str)
@pytest.mark.parametrize("decoupled", [True, False])
def test_matches_reference(numel: int, grad_dtype: torch.dtype, copy_dtype: torch.dtype | None, decoupled: bool) -> None:
    grads = make_grads(numel, 5, grad_dtype)
    grad_scale = 1 / 1024 if grad_dtype == torch.float16 else 1.0  # fp16 gradients come loss-scaled
    grads = [g * 1024 for g in grads] if grad_dtype == torch.float16 else grads
    ours, expected = make_state(numel), make_state(numel)
    out = None if copy_dtype is None else torch.empty(numel, dtype=copy_dtype)
    run_steps(ours, grads, out=out, decoupled=decoupled, grad_scale=grad_scale)
    run_steps(expected, grads, decoupled=decoupled, grad_scale=grad_scale, reference=True)
    for name, actual, wanted in zip(State._fields, ours, expected):
        assert_close_normwise(actual, wanted, name)
    if out is not None:  # the copy is the fp32 result rounded to nearest even
        assert_bitwise_equal(out, ours.param.to(copy_dtype), "out")


@needs_extension
def test_grad_is_read_only_and_empty_is_a_no_op() -> None:
    state = make_state(1000)
    grad = torch.randn(1000, dtype=torch.bfloat16)
    kept = grad.clone()
    run_steps(state, [grad])
    assert_bitwise_equal(grad, kept, "grad")
    empty = [torch.empty(0) for _ in range(4)]
    ops.adam_step_cpu(*empty, **HYPER, weight_decay=0.0, step=1, out=torch.empty(0, dtype=torch.float16))


@needs_extension
def test_bumps_autograd_versions() -> None:
    state = make_state(100)
    param = torch.nn.Parameter(state.param)
    out = torch.empty(100, dtype=torch.bfloat16)
    before = [t._version for t in (param, state.exp_avg, state.exp_avg_sq, out)]
    ops.adam_step_cpu(param, torch.randn(100), state.exp_avg, state.exp_avg_sq, **HYPER, weight_decay=0.0, step=1,
                      out=out)
    after = [t._version for t in (param, state.exp_avg, state.exp_avg_sq, out)]
    assert all(a > b for a, b in zip(after, before)), (before, after)


# ------------------------------------------------------------------------------ ISA paths and threads


@needs_extension
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("copy_dtype", COPY_DTYPES, ids=str)
@pytest.mark.parametrize("decoupled", [True, False])
def test_isa_paths_equal_scalar_bit_for_bit(
    isa: str, grad_dtype: torch.dtype, copy_dtype: torch.dtype | None, decoupled: bool
) -> None:
    skip_unless_cpu_has(isa)
    numel = 100_003  # whole vectors and a tail
    grads = make_grads(numel, 3, grad_dtype)
    results = {}
    for path in ("scalar", isa):
        state = make_state(numel)
        out = None if copy_dtype is None else torch.empty(numel, dtype=copy_dtype)
        run_steps(state, grads, out=out, decoupled=decoupled, isa=path, num_threads=1)
        results[path] = (*state, out)
    for name, actual, wanted in zip([*State._fields, "out"], results[isa], results["scalar"]):
        if wanted is not None:
            assert_bitwise_equal(actual, wanted, f"{name} ({isa} vs scalar)")


@needs_extension
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16_bit_grad_pattern_agrees_across_isas(isa: str, dtype: torch.dtype) -> None:
    # Every gradient bit pattern, inf and nan included, through the vector loads and the scalar loads.
    skip_unless_cpu_has(isa)
    grad = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    results = {}
    for path in ("scalar", isa):
        state = make_state(grad.numel())
        out = torch.empty(grad.numel(), dtype=dtype)
        run_steps(state, [grad], out=out, isa=path, num_threads=1)
        results[path] = (*state, out)
    for name, actual, wanted in zip([*State._fields, "out"], results[isa], results["scalar"]):
        assert_bitwise_equal(actual, wanted, f"{name} ({isa} vs scalar)")


@needs_extension
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_copy_rounds_like_torch(isa: str, dtype: torch.dtype) -> None:
    # lr = 0 and zero moments leave param as it is, so `out` is param rounded by our conversion: compare it
    # with torch's on edge cases (ties, subnormals, overflow) and on random bit patterns of every exponent.
    skip_unless_cpu_has(isa)
    edges = [0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, 65536.0, 1e30, float("inf"), float("-inf"), 2**-14,
             2**-24, 2**-25, 2**-25 * 1.0001, 3 * 2**-25, 2**-26, 1e-45, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8,
             1 + 3 * 2**-8, 3.4e38, -2**-24 * 1.5]
    generator = torch.Generator().manual_seed(0)
    patterns = torch.randint(-(2**31), 2**31, (200_000,), generator=generator, dtype=torch.int64).to(torch.int32)
    param = torch.cat([torch.tensor(edges), patterns.view(torch.float32)])
    param = param[~param.isnan()]  # torch itself rounds nan differently in its scalar and vector code
    numel = param.numel()
    out = torch.empty(numel, dtype=dtype)
    ops._adam_step_cpu_with(param, torch.zeros(numel), torch.zeros(numel), torch.zeros(numel), lr=0.0, beta1=0.9,
                            beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, out=out, num_threads=1, isa=isa)
    assert_bitwise_equal(out, param.to(dtype), f"out ({isa})")


@needs_extension
@pytest.mark.parametrize("num_threads", [2, 3, 8, 0])
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_multithreaded_equals_single_threaded(num_threads: int, offset: int) -> None:
    # Views starting `offset` elements into their buffers move the slice boundaries off the vector grid;
    # the guard elements around each view must stay untouched.
    numel = 1_000_003
    grads = make_grads(numel, 2, torch.bfloat16)
    results = []
    for threads in (1, num_threads):
        buffers = make_state(numel + offset + 1)
        state = State(*(b[offset : offset + numel] for b in buffers))
        before = buffers.clone()
        out_buffer = torch.zeros(numel + offset + 1, dtype=torch.bfloat16)
        out = out_buffer[offset : offset + numel]
        run_steps(state, grads, out=out, num_threads=threads)
        for buffer, kept in zip([*buffers, out_buffer], [*before, torch.zeros_like(out_buffer)]):
            assert torch.equal(buffer[:offset], kept[:offset]) and torch.equal(buffer[-1:], kept[-1:])
        results.append((*state, out))
    for name, actual, wanted in zip([*State._fields, "out"], results[1], results[0]):
        assert_bitwise_equal(actual, wanted, f"{name} ({num_threads} threads vs 1)")


@needs_extension
def test_pool_serves_jobs_of_changing_width() -> None:
    # Consecutive steps ask the worker pool for more, then fewer, then more threads than the step before: the
    # workers a step does not want must stay asleep through it and still serve the next one that wants them.
    numel = 700_001
    widths = [8, 2, 5, 1, 8, 3, 2, 8]
    grads = make_grads(numel, len(widths), torch.float32)
    expected, state = make_state(numel), make_state(numel)
    run_steps(expected, grads, num_threads=1)
    for step, (grad, width) in enumerate(zip(grads, widths), start=1):
        ops._adam_step_cpu_with(state.param, grad, state.exp_avg, state.exp_avg_sq, **HYPER, weight_decay=0.1,
                                step=step, num_threads=width, isa="best")
    for name, actual, wanted in zip(State._fields, state, expected):
        assert_bitwise_equal(actual, wanted, name)


@needs_extension
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("offset", [0, 3])
def test_streamed_copy_equals_scalar(isa: str, offset: int) -> None:
    # From 1 Mi elements on, the vector paths write the copy with streaming stores, from its first
    # vector-aligned element on (`offset` moves that boundary); the scalar path never does.
    skip_unless_cpu_has(isa)
    numel = (1 << 20) + 5
    grads = make_grads(numel, 2, torch.float16)
    results = []
    for path, threads in (("scalar", 1), (isa, 2)):
        state = make_state(numel)
        out_buffer = torch.zeros(numel + offset, dtype=torch.bfloat16)
        run_steps(state, grads, out=out_buffer[offset:], isa=path, num_threads=threads)
        results.append((*state, out_buffer))
    for name, actual, wanted in zip([*State._fields, "out"], results[1], results[0]):
        assert_bitwise_equal(actual, wanted, f"{name} ({isa} vs scalar)")


@needs_extension
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("offset, copy_offset", [(0, 0), (3, 0), (5, 1)])
def test_a_step_written_elsewhere_equals_one_in_place(isa: str, offset: int, copy_offset: int) -> None:
    # AdamTargets: the new master and moments go to other buffers (streamed from 1 Mi elements on, from their first
    # aligned element; `offset` moves that boundary, `copy_offset` the copy's against it) and the inputs are only read.
    skip_unless_cpu_has(isa)
    ext = ops._ext.require_extension()
    numel = (1 << 20) + 37
    gen = torch.Generator().manual_seed(3)

    def buffer(dtype: torch.dtype = torch.float32, at: int = offset) -> torch.Tensor:
        return torch.zeros(numel + 16, dtype=dtype)[at:at + numel]

    inputs = [buffer() for _ in range(3)]
    for tensor, scale in zip(inputs, (1.0, 0.1, 0.01)):
        tensor.copy_(torch.randn(numel, generator=gen).abs() * scale)
    grad = torch.randn(numel, generator=gen).to(torch.bfloat16)
    kept = [t.clone() for t in inputs]
    targets = [buffer() for _ in range(3)]
    copies = [buffer(torch.bfloat16, copy_offset) for _ in range(2)]
    code = ops._ext.dtype_code(ext, torch.bfloat16)

    def step(state, copy, **to) -> None:
        ext.adam_cpu(state[0].data_ptr(), grad.data_ptr(), code, state[1].data_ptr(), state[2].data_ptr(), numel,
                     1e-3, 0.9, 0.999, 1e-8, 0.1, 4, 0.5, True, copy.data_ptr(), code, 2, getattr(ext.CpuIsa, isa),
                     **to)

    step(inputs, copies[0], param_target=targets[0].data_ptr(), exp_avg_target=targets[1].data_ptr(),
         exp_avg_sq_target=targets[2].data_ptr())
    for name, before, after in zip(("param", "exp_avg", "exp_avg_sq"), kept, inputs):
        assert_bitwise_equal(after, before, f"{name}: an input written")
    step(inputs, copies[1])  # the same step in place
    for name, elsewhere, in_place in zip(("param", "exp_avg", "exp_avg_sq", "out"), [*targets, copies[0]],
                                         [*inputs, copies[1]]):
        assert_bitwise_equal(elsewhere, in_place, f"{name} ({isa}, written elsewhere vs in place)")


@needs_extension
def test_concurrent_callers_get_correct_results() -> None:
    # Two Python threads in the kernel at once (the GIL is released): one gets the pool, the other runs on
    # its own thread; both must be right.
    numel = 300_000
    grads = make_grads(numel, 10, torch.float32)
    expected = make_state(numel)
    run_steps(expected, grads, num_threads=1)
    states = [make_state(numel) for _ in range(2)]
    errors: list[BaseException] = []

    def work(state: State) -> None:
        try:
            run_steps(state, grads, num_threads=2)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    workers = [threading.Thread(target=work, args=(state,)) for state in states]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors, errors
    for state in states:
        for name, actual, wanted in zip(State._fields, state, expected):
            assert_bitwise_equal(actual, wanted, name)


@needs_extension
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_worker_pool_survives_fork() -> None:
    # The parent's pool has a worker; a forked child has none of its threads and must start its own. The child
    # runs nothing of torch's but the checks in bmtwrap.ops (torch's own OpenMP pool can hang after a fork).
    numel = 300_000
    grads = make_grads(numel, 2, torch.float32)
    expected, state = make_state(numel), make_state(numel)
    run_steps(expected, grads, num_threads=2)
    pid = os.fork()
    if pid == 0:  # child: exit code 0 only if the multithreaded steps finished and are right
        code = 1
        try:
            run_steps(state, grads, num_threads=2)
            code = 0 if all(a.numpy().tobytes() == b.numpy().tobytes() for a, b in zip(state, expected)) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@needs_extension
def test_unsupported_isa_raises() -> None:
    missing = [isa for isa in ISAS if isa not in ops._cpu_isas()]
    if not missing:
        pytest.skip(f"this CPU supports every ISA ({', '.join(ISAS)})")
    state = make_state(10)
    with pytest.raises(ValueError, match=f"this CPU does not support isa {missing[0]}"):
        run_steps(state, make_grads(10, 1, torch.float32), isa=missing[0], num_threads=1)


def test_fallback_without_extension_warns_once(monkeypatch: pytest.MonkeyPatch, fresh_fallback_warning: None) -> None:
    monkeypatch.setattr(ops._ext, "_C", None)
    grads = make_grads(1000, 3, torch.bfloat16)
    ours, expected = make_state(1000), make_state(1000)
    out = torch.empty(1000, dtype=torch.float16)
    with pytest.warns(RuntimeWarning, match=r"compiled extension bmtwrap._C is missing"):
        run_steps(ours, grads[:1], out=out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        for step, grad in enumerate(grads[1:], start=2):
            ops.adam_step_cpu(ours.param, grad, ours.exp_avg, ours.exp_avg_sq, **HYPER, weight_decay=0.1, step=step,
                              out=out)
    run_steps(expected, grads, reference=True)
    for name, actual, wanted in zip(State._fields, ours, expected):
        assert_bitwise_equal(actual, wanted, name)
    assert_bitwise_equal(out, expected.param.to(torch.float16), "out")


# ----------------------------------------------------------------------------------------------- errors


def call(**overrides: object) -> None:
    """adam_step_cpu on valid arguments of 8 elements, with some replaced."""
    arguments: dict[str, object] = dict(param=torch.zeros(8), grad=torch.zeros(8), exp_avg=torch.zeros(8),
                                        exp_avg_sq=torch.zeros(8), **HYPER, weight_decay=0.0, step=1)
    arguments.update(overrides)
    ops.adam_step_cpu(**arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (dict(param=torch.zeros(8, dtype=torch.bfloat16)), TypeError,
         r"param has dtype torch.bfloat16; param is the master copy of the weights and must be torch.float32"),
        (dict(exp_avg=torch.zeros(8, dtype=torch.float16)), TypeError,
         r"exp_avg has dtype torch.float16; exp_avg is optimizer state and must be torch.float32"),
        (dict(exp_avg_sq=torch.zeros(8, dtype=torch.float64)), TypeError,
         r"exp_avg_sq has dtype torch.float64; exp_avg_sq is optimizer state and must be torch.float32"),
        (dict(grad=torch.zeros(8, dtype=torch.float64)), TypeError,
         r"grad has dtype torch.float64; expected one of torch.float32, torch.float16, torch.bfloat16"),
        (dict(out=torch.zeros(8)), TypeError,
         r"out has dtype torch.float32; expected one of torch.float16, torch.bfloat16 \(out is the low-precision"),
        (dict(grad=[0.0] * 8), TypeError, r"grad must be a torch.Tensor, got list"),
        (dict(grad=torch.zeros(16)[::2]), ValueError, r"grad is not contiguous; call \.contiguous\(\) first"),
        (dict(exp_avg=torch.zeros(9)), ValueError, r"exp_avg has 9 elements but param has 8; expected the same"),
        (dict(out=torch.zeros(7, dtype=torch.float16)), ValueError, r"out has 7 elements but param has 8"),
        (dict(param=torch.zeros(8, device="meta")), NotImplementedError,
         r"param is on device meta; bmtwrap.ops supports cpu and cuda tensors"),
        (dict(grad=torch.zeros(8).to_sparse()), NotImplementedError, r"grad has layout torch.sparse_coo"),
        (dict(step=0), ValueError, r"step must be >= 1 \(the first step is 1\), got 0"),
        (dict(step=1.0), TypeError, r"step must be an int, got float"),
        (dict(step=True), TypeError, r"step must be an int, got bool"),
        (dict(lr=float("nan")), ValueError, r"lr must be finite and >= 0, got nan"),
        (dict(lr=-1e-3), ValueError, r"lr must be finite and >= 0, got -0.001"),
        (dict(lr=torch.tensor(1e-3)), TypeError, r"lr must be a real number, got Tensor"),
        (dict(beta1=1.0), ValueError, r"beta1 must be finite and in \[0, 1\), got 1.0"),
        (dict(beta2=-0.1), ValueError, r"beta2 must be finite and in \[0, 1\), got -0.1"),
        (dict(eps=float("inf")), ValueError, r"eps must be finite and >= 0, got inf"),
        (dict(weight_decay=-0.1), ValueError, r"weight_decay must be finite and >= 0, got -0.1"),
        (dict(grad_scale=0.0), ValueError, r"grad_scale must be finite and > 0, got 0.0"),
        (dict(grad_scale=float("inf")), ValueError, r"grad_scale must be finite and > 0, got inf"),
        (dict(decoupled=1), TypeError, r"decoupled must be a bool, got int"),
    ],
    ids=lambda value: None if isinstance(value, (dict, str, type)) else str(value),
)
def test_bad_arguments_raise(overrides: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call(**overrides)


def test_shared_memory_raises() -> None:
    buffer = torch.zeros(16)
    with pytest.raises(ValueError, match=r"exp_avg and exp_avg_sq share memory; expected a separate buffer"):
        call(exp_avg=buffer[:8], exp_avg_sq=buffer[4:12])
    param = torch.zeros(8)
    with pytest.raises(ValueError, match=r"share memory"):
        call(param=param, grad=param)
    with pytest.raises(ValueError, match=r"share memory"):
        call(param=param, out=param.view(torch.bfloat16)[:8])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: torch.cuda.is_available() is False")
def test_cuda_tensor_raises() -> None:
    with pytest.raises(ValueError, match=r"grad is on cuda:0; adam_step_cpu updates CPU tensors only"):
        call(grad=torch.zeros(8, device="cuda"))


def test_num_threads_argument() -> None:
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1)
    grad = make_grads(10_000, 1, torch.float32)[0]
    a, b = make_state(10_000), make_state(10_000)
    ops.adam_step_cpu(a.param, grad, a.exp_avg, a.exp_avg_sq, **hyper)
    ops.adam_step_cpu(b.param, grad, b.exp_avg, b.exp_avg_sq, num_threads=1, **hyper)
    assert torch.equal(a.param, b.param) and torch.equal(a.exp_avg_sq, b.exp_avg_sq)
    with pytest.raises(ValueError, match="num_threads must be a positive int or None, got 0"):
        ops.adam_step_cpu(b.param, grad, b.exp_avg, b.exp_avg_sq, num_threads=0, **hyper)


def test_host_zeros_are_zero_and_writable() -> None:
    from bmtwrap.engine.offload import host_zeros

    tensor = host_zeros(3 << 20)  # past two huge pages: the advice path runs
    assert tensor.dtype == torch.float32 and tensor.numel() == 3 << 20 and not tensor.any()
    tensor.fill_(1.5)
    assert tensor.sum().item() == 1.5 * (3 << 20)
