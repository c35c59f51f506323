"""bmtwrap.ops' fused CUDA Adam and cross-entropy: the kernels against torch on a GPU (tests marked `cuda`), and
their Python side (argument checks, the plain-torch references) on the CPU.

Each GPU check poisons what the kernel should write (nan, or stale values that cannot pass), draws fresh
random data, and compares with a reference by relative norm and element by element.

Tolerances, and why:
- Adam, fp32: ||kernel - torch|| / ||torch|| <= 1e-6 for param, exp_avg and exp_avg_sq, after 100 steps
  against torch.optim.AdamW/Adam and after a few against ops._adam_reference. The kernel performs torch's
  foreach CUDA operations in torch's order; what remains is an ulp here and there where torch's and nvcc's
  fused multiply-adds differ, a random walk of about 1e-7 relative after 100 steps (1e-8 was seen in a host
  simulation against torch's CPU path). Element by element: within 4e-6 relative or 1e-6 of the largest.
  Any wrong element (unwritten, updated twice, a wrong formula) misses by orders of magnitude.
- Adam, 16-bit grads: the same bounds (the kernel and the reference read the same 16-bit values, exactly
  representable in fp32). `out` must equal the kernel's own fp32 master rounded to out's dtype bit for bit:
  both round to nearest even.
- Cross-entropy: the reference is torch.nn.functional.cross_entropy in float64 on the upcast logits (the
  upcast is exact, so kernel and reference see the same numbers). torch's own fp32 path is not accurate
  enough to be the yardstick: with label smoothing, on a row whose target logit dominates, its fp32 backward
  was seen 5e-5 off (cancellation in log_softmax's backward) where the kernel was 4e-7 off. It is still
  checked, at the looser bounds below.
  Loss: |kernel - ref| <= 1e-5 + 1e-5 |ref|. The kernel works in fp32: lse is rounded to fp32 (half an ulp
  of |lse|, 1e-6 at |lse| ~ 30) and summed over up to 128256 terms (1e-6 relative).
  lse: |kernel - ref| <= 1e-5 + 1e-6 |ref|, on counted rows; 0 on ignored rows.
  Grad: |kernel - ref| <= u |ref| + 1e-5 max|ref| (+ 2^-25 for fp16), with u half an ulp of the output dtype
  (2^-24 fp32, 2^-11 fp16, 2^-8 bf16): rounding the fp32 result to nearest even costs at most u |ref|, and
  the fp32 computation shifts every p of a row by the relative rounding of its lse (<= 3e-6 here), a term
  bounded by the largest gradient rather than by each element's own (a p that rounds to exactly 1 has no
  relative accuracy left). fp16 flushes magnitudes under 2^-24 to subnormals spaced 2^-24: 2^-25 absolute.
  Norm-wise the grads land near u / 2; the checks ask for <= u + 1e-5 (+ 2^-25 sqrt(N V) / ||ref|| for fp16).
  Against torch fp32 (the brief's yardstick): loss norm-relative 1e-5; grads within u |ref| + 1e-4 max|ref|.
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from bmtwrap import ops

CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: torch.cuda.is_available() is False"),
]
cuda = pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
HALF_ULP = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.uint8: torch.uint8}
ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


@pytest.fixture
def fresh_fallback_warning() -> Iterator[None]:
    """Forget which fallback warnings bmtwrap.ops gave, so that this test sees its own."""
    ops._warn_fallback.cache_clear()
    yield
    ops._warn_fallback.cache_clear()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero); nan never passes a `<=`."""
    a, b = a.double(), b.double()
    denominator = b.norm().item()
    difference = (a - b).norm().item()
    return difference / denominator if denominator > 0 else difference


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that nan compares equal to the same nan."""
    return tensor.view(BITS[tensor.dtype])


def generator(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


# ============================================================================================ Adam, on a GPU


def adam_state(numel: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random fp32 master and moments as after some steps (never zeros: those hide unwritten elements)."""
    g = generator(seed, device)
    param = torch.randn(numel, generator=g, device=device)
    exp_avg = torch.randn(numel, generator=g, device=device) * 1e-2
    exp_avg_sq = torch.rand(numel, generator=g, device=device) * 1e-4
    return param, exp_avg, exp_avg_sq


def random_grad(numel: int, dtype: torch.dtype, seed: int, device: str, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(numel, generator=generator(seed, device), device=device) * scale).to(dtype)


def assert_adam_close(name: str, kernel: torch.Tensor, reference: torch.Tensor) -> None:
    assert torch.isfinite(kernel).all(), f"{name}: non-finite values"
    assert rel(kernel, reference) <= 1e-6, f"{name}: relative error {rel(kernel, reference):.3g}"
    bound = 4e-6 * reference.abs() + 1e-6 * reference.abs().max()
    worst = ((kernel - reference).abs() - bound).max().item()
    assert worst <= 0, f"{name}: an element is {worst:.3g} past its bound"


@cuda
def test_cuda_kernels_compiled_in(device: str) -> None:
    # Fails rather than skips: on a GPU machine the build must have found nvcc.
    assert ops.extension_available(cuda=True), "bmtwrap._C was built without CUDA; rebuild where nvcc is found"


@cuda
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("numel", [1, 3, 4099, 1_000_003])
def test_adam_matches_torch_optim_over_100_steps(device: str, decoupled: bool, numel: int) -> None:
    weight = torch.nn.Parameter(torch.randn(numel, generator=generator(numel, device), device=device))
    optimizer_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    optimizer = optimizer_class([weight], lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
                                weight_decay=ADAM["weight_decay"])
    param = weight.detach().clone()
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    for step in range(1, 101):
        lr = ADAM["lr"] * (0.5 + step / 100)  # a schedule: lr changes every step
        optimizer.param_groups[0]["lr"] = lr
        grad = random_grad(numel, torch.float32, seed=step, device=device)
        weight.grad = grad.clone()
        optimizer.step()
        ops.adam_step_cuda(param, grad, exp_avg, exp_avg_sq, **{**ADAM, "lr": lr}, step=step, decoupled=decoupled)
    state = optimizer.state[weight]
    assert_adam_close("param", param, weight.detach())
    assert_adam_close("exp_avg", exp_avg, state["exp_avg"])
    assert_adam_close("exp_avg_sq", exp_avg_sq, state["exp_avg_sq"])


@cuda
@pytest.mark.parametrize("grad_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("out_dtype", [None, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("numel", [1, 3, 1000, 1_000_003])
@pytest.mark.parametrize("grad_scale", [1.0, 1 / 1024])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
def test_adam_matches_reference(
    device: str, grad_dtype: torch.dtype, out_dtype: torch.dtype | None, numel: int, grad_scale: float, decoupled: bool
) -> None:
    param, exp_avg, exp_avg_sq = adam_state(numel, seed=numel, device=device)
    ref_param, ref_exp_avg, ref_exp_avg_sq = param.clone(), exp_avg.clone(), exp_avg_sq.clone()
    out = None if out_dtype is None else torch.full((numel,), math.nan, dtype=out_dtype, device=device)
    for step in (1, 2, 3):
        grad = random_grad(numel, grad_dtype, seed=100 * step + numel, scale=1 / grad_scale, device=device)
        hyper = dict(**ADAM, step=step, grad_scale=grad_scale, decoupled=decoupled)
        ops.adam_step_cuda(param, grad, exp_avg, exp_avg_sq, **hyper, out=out)
        ops._adam_reference(ref_param, grad, ref_exp_avg, ref_exp_avg_sq, **hyper)
    assert_adam_close("param", param, ref_param)
    assert_adam_close("exp_avg", exp_avg, ref_exp_avg)
    assert_adam_close("exp_avg_sq", exp_avg_sq, ref_exp_avg_sq)
    if out is not None:
        assert torch.equal(bits(out), bits(param.to(out_dtype))), "out is not param rounded to nearest even"


@cuda
@pytest.mark.parametrize("param_offset", range(8))
@pytest.mark.parametrize("grad_shift", [0, 1, 3])
@pytest.mark.parametrize("grad_dtype", FLOATS, ids=str)
def test_adam_unaligned_views(device: str, param_offset: int, grad_shift: int, grad_dtype: torch.dtype) -> None:
    # Equal offsets: a head of scalars, then 16-byte packs. Unequal ones (grad_shift > 0): no common
    # alignment, every element takes the scalar path. Neighbours outside the views must stay untouched.
    numel, pad = 10_007, 16
    grad_offset = (param_offset + grad_shift) % 8
    base_param, base_exp_avg, base_exp_avg_sq = adam_state(numel + pad, seed=param_offset, device=device)
    base_grad = random_grad(numel + pad, grad_dtype, seed=grad_offset, device=device)
    base_out = torch.full((numel + pad,), math.nan, dtype=torch.bfloat16, device=device)
    before = [base.clone() for base in (base_param, base_exp_avg, base_exp_avg_sq, base_out)]
    view = slice(param_offset, param_offset + numel)
    param, exp_avg, exp_avg_sq, out = (t[view] for t in (base_param, base_exp_avg, base_exp_avg_sq, base_out))
    grad = base_grad[grad_offset : grad_offset + numel]
    ref = [t.clone() for t in (param, exp_avg, exp_avg_sq)]

    ops.adam_step_cuda(param, grad, exp_avg, exp_avg_sq, **ADAM, step=5, out=out)
    ops._adam_reference(*ref[:1], grad, *ref[1:], **ADAM, step=5)

    for name, kernel, reference in zip(("param", "exp_avg", "exp_avg_sq"), (param, exp_avg, exp_avg_sq), ref):
        assert_adam_close(name, kernel, reference)
    assert torch.equal(bits(out), bits(param.to(torch.bfloat16)))
    for base, old in zip((base_param, base_exp_avg, base_exp_avg_sq, base_out), before):
        outside = torch.cat([bits(base)[:param_offset], bits(base)[param_offset + numel :]])
        expected = torch.cat([bits(old)[:param_offset], bits(old)[param_offset + numel :]])
        assert torch.equal(outside, expected), "an element outside the view was written"


@cuda
def test_adam_skip_flag_writes_nothing(device: str) -> None:
    numel = 100_003
    param, exp_avg, exp_avg_sq = adam_state(numel, seed=1, device=device)
    out = torch.full((numel,), math.nan, dtype=torch.float16, device=device)
    grad = random_grad(numel, torch.bfloat16, seed=2, device=device)
    buffers = (param, exp_avg, exp_avg_sq, out)
    before = [bits(t).clone() for t in buffers]

    flag = torch.ones(1, dtype=torch.uint8, device=device)
    for step in (1, 2, 3):  # several skipped launches in a row, no synchronisation in between
        ops.adam_step_cuda(param, grad, exp_avg, exp_avg_sq, **ADAM, step=step, out=out, skip_if=flag)
    assert all(torch.equal(bits(t), b) for t, b in zip(buffers, before)), "a skipped step wrote"

    found = torch.zeros(1, dtype=torch.uint8, device=device)  # the intended use: an overflow found on device
    overflowed = grad.clone()
    overflowed[12_345] = math.inf
    ops.has_inf_nan_into(overflowed, found)
    ops.adam_step_cuda(param, overflowed, exp_avg, exp_avg_sq, **ADAM, step=1, out=out, skip_if=found)
    assert found.item() == 1
    assert all(torch.equal(bits(t), b) for t, b in zip(buffers, before)), "a step with inf grads wrote"

    flag.zero_()
    ref = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    ops.adam_step_cuda(param, grad, exp_avg, exp_avg_sq, **ADAM, step=1, out=out, skip_if=flag)
    ops._adam_reference(ref[0], grad, ref[1], ref[2], **ADAM, step=1)
    assert_adam_close("param", param, ref[0])
    assert torch.equal(bits(out), bits(param.to(torch.float16)))


@cuda
def test_adam_empty_and_shaped_tensors(device: str) -> None:
    empty = torch.empty(0, device=device)
    ops.adam_step_cuda(empty, empty.clone(), empty.clone(), empty.clone(), **ADAM, step=1)
    # Any contiguous shape works: the kernel sees numel elements.
    param, exp_avg, exp_avg_sq = (t.view(100, 37) for t in adam_state(3700, seed=3, device=device))
    ref = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    grad = random_grad(3700, torch.bfloat16, seed=4, device=device).view(100, 37)
    ops.adam_step_cuda(param, grad, exp_avg, exp_avg_sq, **ADAM, step=2)
    ops._adam_reference(ref[0], grad, ref[1], ref[2], **ADAM, step=2)
    assert_adam_close("param", param, ref[0])


@cuda
def test_adam_on_a_side_stream(device: str) -> None:
    param, exp_avg, exp_avg_sq = adam_state(1_000_003, seed=5, device=device)
    ref = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    grad = random_grad(1_000_003, torch.float32, seed=6, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.adam_step_cuda(param, grad, exp_avg, exp_avg_sq, **ADAM, step=1)
    torch.cuda.current_stream().wait_stream(stream)
    ops._adam_reference(ref[0], grad, ref[1], ref[2], **ADAM, step=1)
    assert_adam_close("param", param, ref[0])


@cuda
def test_adam_device_mismatch_raises(device: str) -> None:
    param, exp_avg, exp_avg_sq = adam_state(16, seed=7, device=device)
    with pytest.raises(ValueError, match="grad is on cpu but param is on cuda:0; expected one device"):
        ops.adam_step_cuda(param, torch.randn(16), exp_avg, exp_avg_sq, **ADAM, step=1)
    with pytest.raises(ValueError, match="skip_if is on cpu but param is on cuda:0"):
        ops.adam_step_cuda(param, param.clone(), exp_avg, exp_avg_sq, **ADAM, step=1,
                           skip_if=torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="(param and out|out and param) share memory"):
        ops.adam_step_cuda(param, param.clone(), exp_avg, exp_avg_sq, **ADAM, step=1,
                           out=param.view(torch.bfloat16)[:16])


@cuda
def test_adam_on_another_device(device: str) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    param, exp_avg, exp_avg_sq = adam_state(10_000, seed=8, device="cuda:1")
    ref = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    grad = random_grad(10_000, torch.bfloat16, seed=9, device="cuda:1")
    with torch.cuda.device(0):
        ops.adam_step_cuda(param, grad, exp_avg, exp_avg_sq, **ADAM, step=1)
    ops._adam_reference(ref[0], grad, ref[1], ref[2], **ADAM, step=1)
    assert_adam_close("param", param, ref[0])


@cuda
def test_adam_fallback_when_built_without_cuda(
    device: str, monkeypatch: pytest.MonkeyPatch, fresh_fallback_warning: None
) -> None:
    monkeypatch.setattr(ops._ext, "_C", types.SimpleNamespace(has_cuda=lambda: False))
    param, exp_avg, exp_avg_sq = adam_state(1000, seed=10, device=device)
    ref = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    grad = random_grad(1000, torch.float16, seed=11, device=device)
    with pytest.warns(RuntimeWarning, match="built without CUDA kernels"):
        ops.adam_step_cuda(param, grad, exp_avg, exp_avg_sq, **ADAM, step=1)
    ops._adam_reference(ref[0], grad, ref[1], ref[2], **ADAM, step=1)
    assert torch.equal(param, ref[0])
    skip = torch.ones(1, dtype=torch.uint8, device=device)
    kept = param.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        ops.adam_step_cuda(param, grad, exp_avg, exp_avg_sq, **ADAM, step=2, skip_if=skip)
    assert torch.equal(param, kept)


# ===================================================================================== cross-entropy, shared


def ce_inputs(
    N: int, V: int, dtype: torch.dtype, device: str, seed: int, *, offset: int = 0, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (N, V) of std 2 (a view `offset` elements into a larger buffer, so rows start off 16-byte
    boundaries), targets with ~10% rows ignored, the first and last classes used, and some rows whose target
    dominates (logit 30: loss ~ 0, p ~ 1, the hard case for fp32)."""
    g = generator(seed, device)
    flat = (torch.randn(N * V + offset, generator=g, device=device) * 2).to(dtype)
    logits = flat[offset:].view(N, V)
    targets = torch.randint(0, V, (N,), generator=g, device=device)
    ignored = torch.rand(N, generator=g, device=device) < 0.1
    targets.masked_fill_(ignored, ignore_index)
    targets[0] = 0
    if N > 1:
        targets[1] = V - 1
    if N > 2:
        targets[2] = ignore_index
    dominant = torch.arange(3, max(N, 3), 97, device=device)
    logits[dominant, targets[dominant].clamp(0, V - 1)] = 30.0
    return logits, targets


def ce_grad_rows(targets: torch.Tensor, seed: int, *, mean: bool = False, ignore_index: int = -100) -> torch.Tensor:
    """The upstream gradient per row: 1 / count for a mean reduction, else random in [0.5, 1.5)."""
    counted = targets != ignore_index
    if mean:
        grad_rows = counted.float() / counted.sum().clamp(min=1)
    else:
        grad_rows = torch.rand(targets.shape[0], generator=generator(seed, str(targets.device)),
                               device=targets.device) + 0.5
    return grad_rows.masked_fill(~counted, 0.0)


def torch_ce(
    logits: torch.Tensor, targets: torch.Tensor, grad_rows: torch.Tensor, dtype: torch.dtype, *, ignore_index: int,
    label_smoothing: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.nn.functional.cross_entropy on logits upcast to `dtype`: per-row loss, lse and the gradient of
    sum(loss * grad_rows), all in `dtype`."""
    x = logits.to(dtype).requires_grad_()
    loss = F.cross_entropy(x, targets, reduction="none", ignore_index=ignore_index, label_smoothing=label_smoothing)
    loss.backward(grad_rows.to(dtype))
    return loss.detach(), torch.logsumexp(x.detach(), dim=1), x.grad


def assert_ce_matches_torch(
    logits: torch.Tensor, targets: torch.Tensor, grad_rows: torch.Tensor, loss: torch.Tensor, lse: torch.Tensor,
    grad: torch.Tensor, *, ignore_index: int, label_smoothing: float,
) -> None:
    """Compares the kernel's loss, lse and grad with torch in float64 (and fp32), chunk by chunk of rows so
    that a (8192, 128256) case stays within a few GB; the bounds are in the module docstring."""
    N, V = logits.shape
    u = HALF_ULP[grad.dtype]
    subnormal = 2.0**-25 if grad.dtype == torch.float16 else 0.0
    counted = targets != ignore_index
    assert torch.equal(loss[~counted], torch.zeros_like(loss[~counted])), "ignored rows must have loss 0"
    assert torch.equal(lse[~counted], torch.zeros_like(lse[~counted])), "ignored rows must have lse 0"
    assert torch.isfinite(loss).all() and torch.isfinite(lse).all(), "loss or lse not written (still nan)"
    assert torch.equal(grad[~counted], torch.zeros_like(grad[~counted])), "ignored rows must have zero grads"

    # The largest gradient of the whole problem sets the absolute part of the grad bounds; it is the same in
    # every chunk, so take it from the float64 reference first. No gradient exceeds max |grad_rows| (|p -
    # onehot| <= 1), which keeps the bound meaningful where every gradient is 0 (V = 1).
    chunk = max(1, (1 << 25) // V)
    chunks = [(start, min(N, start + chunk)) for start in range(0, N, chunk)]
    refs64 = {}
    largest = grad_rows.abs().max().item() if N else 0.0
    for a, b in chunks:
        refs64[a] = torch_ce(logits[a:b], targets[a:b], grad_rows[a:b], torch.float64, ignore_index=ignore_index,
                             label_smoothing=label_smoothing)
        largest = max(largest, refs64[a][2].abs().max().item())
        if len(chunks) > 4:  # big problems: keep one chunk's reference at a time, recompute below
            refs64[a] = None
    squared_error = squared_ref = 0.0
    for a, b in chunks:
        ref_loss, ref_lse, ref_grad = refs64[a] or torch_ce(logits[a:b], targets[a:b], grad_rows[a:b], torch.float64,
                                                             ignore_index=ignore_index, label_smoothing=label_smoothing)
        where = f"rows [{a}, {b})"
        loss_err = (loss[a:b].double() - ref_loss).abs()
        assert (loss_err <= 1e-5 + 1e-5 * ref_loss.abs()).all(), f"loss, {where}: worst error {loss_err.max():.3g}"
        rows = counted[a:b]
        lse_err = (lse[a:b].double() - ref_lse).abs()[rows]
        assert (lse_err <= 1e-5 + 1e-6 * ref_lse[rows].abs()).all(), f"lse, {where}: worst error {lse_err.max():.3g}"
        grad_err = (grad[a:b].double() - ref_grad).abs()
        excess = grad_err - (u * ref_grad.abs() + 1e-5 * largest + subnormal)
        assert excess.max() <= 0, f"grad, {where}: an element {excess.max():.3g} past its bound"
        squared_error += grad_err.square().sum().item()
        squared_ref += ref_grad.square().sum().item()
        del ref_loss, ref_lse, ref_grad, grad_err, excess

        ref32_loss, _, ref32_grad = torch_ce(logits[a:b], targets[a:b], grad_rows[a:b], torch.float32,
                                             ignore_index=ignore_index, label_smoothing=label_smoothing)
        assert rel(loss[a:b], ref32_loss) <= 1e-5, f"loss vs torch fp32, {where}: {rel(loss[a:b], ref32_loss):.3g}"
        excess32 = (grad[a:b].float() - ref32_grad).abs() - (u * ref32_grad.abs() + 1e-4 * largest + subnormal)
        assert excess32.max() <= 0, f"grad vs torch fp32, {where}: an element {excess32.max():.3g} past its bound"
        del ref32_loss, ref32_grad, excess32
    # Norm-wise: u, plus what fp16's flush to subnormals may cost every element at once.
    ref_norm = math.sqrt(squared_ref)
    norm_bound = u + 1e-5 + (subnormal * math.sqrt(N * V) / ref_norm if ref_norm > 0 else 0.0)
    norm_rel = math.sqrt(squared_error) / ref_norm if ref_norm > 0 else math.sqrt(squared_error)
    assert norm_rel <= norm_bound, f"grad: relative error {norm_rel:.3g} > {norm_bound:.3g}"


def run_ce(
    logits: torch.Tensor, targets: torch.Tensor, grad_rows: torch.Tensor, *, ignore_index: int, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward into nan-poisoned outputs, backward in place over a copy of the logits."""
    N = logits.shape[0]
    loss = torch.full((N,), math.nan, device=logits.device)
    lse = torch.full((N,), math.nan, device=logits.device)
    result = ops.cross_entropy_forward(logits, targets, ignore_index=ignore_index, label_smoothing=label_smoothing,
                                       out=(loss, lse))
    assert result[0] is loss and result[1] is lse
    grad = logits.clone()
    returned = ops.cross_entropy_backward_(grad, targets, lse, grad_rows, ignore_index=ignore_index,
                                           label_smoothing=label_smoothing)
    assert returned is grad
    return loss, lse, grad


# ============================================================================= cross-entropy, on a GPU


@cuda
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("V", [7, 1000, 32000, 128256])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_cross_entropy_matches_torch(device: str, dtype: torch.dtype, V: int, label_smoothing: float) -> None:
    N = 8192  # (8192, 128256) bf16 logits are 2.1 GB; fp32, 4.2 GB; the reference works in chunks
    logits, targets = ce_inputs(N, V, dtype, device, seed=V)
    grad_rows = ce_grad_rows(targets, seed=V)
    loss, lse, grad = run_ce(logits, targets, grad_rows, ignore_index=-100, label_smoothing=label_smoothing)
    assert_ce_matches_torch(logits, targets, grad_rows, loss, lse, grad, ignore_index=-100,
                            label_smoothing=label_smoothing)


@cuda
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("V", [1, 2, 7, 9, 2048, 2049, 32001])
@pytest.mark.parametrize("N", [1, 3, 37])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_cross_entropy_odd_shapes_and_views(device: str, dtype: torch.dtype, V: int, N: int, offset: int) -> None:
    # V at the warp/block boundary (2048/2049), rows that start anywhere, and V below one 16-byte pack.
    logits, targets = ce_inputs(N, V, dtype, device, seed=N * V + offset, offset=offset)
    grad_rows = ce_grad_rows(targets, seed=N)
    for label_smoothing in (0.0, 0.1):
        loss, lse, grad = run_ce(logits, targets, grad_rows, ignore_index=-100, label_smoothing=label_smoothing)
        assert_ce_matches_torch(logits, targets, grad_rows, loss, lse, grad, ignore_index=-100,
                                label_smoothing=label_smoothing)


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cross_entropy_mean_reduction_grads(device: str, dtype: torch.dtype) -> None:
    # grad_rows = 1 / count: gradients of 1e-9 and less, which fp16 flushes toward its subnormals.
    logits, targets = ce_inputs(4096, 32000, dtype, device, seed=5)
    grad_rows = ce_grad_rows(targets, seed=5, mean=True)
    loss, lse, grad = run_ce(logits, targets, grad_rows, ignore_index=-100, label_smoothing=0.1)
    assert_ce_matches_torch(logits, targets, grad_rows, loss, lse, grad, ignore_index=-100, label_smoothing=0.1)


@cuda
def test_cross_entropy_ignore_index_inside_the_vocabulary(device: str) -> None:
    logits, targets = ce_inputs(512, 5000, torch.bfloat16, device, seed=6, ignore_index=0)
    grad_rows = ce_grad_rows(targets, seed=6, ignore_index=0)
    loss, lse, grad = run_ce(logits, targets, grad_rows, ignore_index=0, label_smoothing=0.1)
    assert_ce_matches_torch(logits, targets, grad_rows, loss, lse, grad, ignore_index=0, label_smoothing=0.1)


@cuda
@pytest.mark.parametrize("V", [100, 50_000])
def test_cross_entropy_masked_classes_and_bad_targets(device: str, V: int) -> None:
    logits, targets = ce_inputs(64, V, torch.bfloat16, device, seed=7)
    logits[10, ::3] = -math.inf  # masked classes (not the target)
    targets[10] = 1
    targets[20] = V  # out of range: nan, never an error
    targets[21] = -5
    grad_rows = ce_grad_rows(targets, seed=7)
    loss, lse = ops.cross_entropy_forward(logits, targets)
    assert torch.isnan(loss[20]) and torch.isnan(loss[21])
    good = torch.ones(64, dtype=torch.bool, device=device)
    good[20:22] = False
    ref_loss, _, ref_grad = torch_ce(logits[good], targets[good], grad_rows[good], torch.float64, ignore_index=-100,
                                     label_smoothing=0.0)
    assert ((loss[good].double() - ref_loss).abs() <= 1e-5 + 1e-5 * ref_loss.abs()).all()
    grad = logits.clone()
    ops.cross_entropy_backward_(grad, targets, lse, grad_rows, ignore_index=-100, label_smoothing=0.0)
    assert torch.isnan(grad[20:22].float()).all()
    assert torch.equal(grad[10, ::3], torch.zeros_like(grad[10, ::3]))
    bound = HALF_ULP[torch.bfloat16] * ref_grad.abs() + 1e-5 * ref_grad.abs().max()
    assert ((grad[good].double() - ref_grad).abs() <= bound).all()


@cuda
def test_cross_entropy_on_a_side_stream(device: str) -> None:
    logits, targets = ce_inputs(1024, 32000, torch.bfloat16, device, seed=8)
    grad_rows = ce_grad_rows(targets, seed=8)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        loss, lse, grad = run_ce(logits, targets, grad_rows, ignore_index=-100, label_smoothing=0.0)
    torch.cuda.current_stream().wait_stream(stream)
    assert_ce_matches_torch(logits, targets, grad_rows, loss, lse, grad, ignore_index=-100, label_smoothing=0.0)


@cuda
def test_cross_entropy_on_another_device(device: str) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    logits, targets = ce_inputs(256, 32000, torch.bfloat16, "cuda:1", seed=9)
    grad_rows = ce_grad_rows(targets, seed=9)
    with torch.cuda.device(0):
        loss, lse, grad = run_ce(logits, targets, grad_rows, ignore_index=-100, label_smoothing=0.1)
    assert_ce_matches_torch(logits, targets, grad_rows, loss, lse, grad, ignore_index=-100, label_smoothing=0.1)


@cuda
def test_cross_entropy_fallback_when_built_without_cuda(
    device: str, monkeypatch: pytest.MonkeyPatch, fresh_fallback_warning: None
) -> None:
    monkeypatch.setattr(ops._ext, "_C", types.SimpleNamespace(has_cuda=lambda: False))
    logits, targets = ce_inputs(64, 1000, torch.float16, device, seed=10)
    grad_rows = ce_grad_rows(targets, seed=10)
    with pytest.warns(RuntimeWarning, match="built without CUDA kernels"):
        loss, lse, grad = run_ce(logits, targets, grad_rows, ignore_index=-100, label_smoothing=0.1)
    assert_ce_matches_torch(logits, targets, grad_rows, loss, lse, grad, ignore_index=-100, label_smoothing=0.1)


# ===================================================================== on the CPU: references and checks


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("V", [1, 7, 1000])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_cross_entropy_cpu_runs_the_reference_silently(dtype: torch.dtype, V: int, label_smoothing: float) -> None:
    logits, targets = ce_inputs(200, V, dtype, "cpu", seed=V)
    grad_rows = ce_grad_rows(targets, seed=V)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no kernel exists for the CPU: no fallback warning either
        loss, lse, grad = run_ce(logits, targets, grad_rows, ignore_index=-100, label_smoothing=label_smoothing)
    assert_ce_matches_torch(logits, targets, grad_rows, loss, lse, grad, ignore_index=-100,
                            label_smoothing=label_smoothing)


def test_cross_entropy_cpu_without_extension_is_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops._ext, "_C", None)
    logits, targets = ce_inputs(16, 50, torch.bfloat16, "cpu", seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, lse = ops.cross_entropy_forward(logits, targets)
        ops.cross_entropy_backward_(logits.clone(), targets, lse, torch.ones(16), ignore_index=-100,
                                    label_smoothing=0.0)


def test_cross_entropy_reference_bad_targets_and_masked_classes() -> None:
    logits = torch.randn(4, 30, dtype=torch.float64).float()
    logits[0, 1::2] = -math.inf
    targets = torch.tensor([0, 30, -1, -100])
    loss, lse = ops._cross_entropy_forward_reference(logits, targets, ignore_index=-100, label_smoothing=0.0)
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1]) and torch.isnan(loss[2]) and loss[3] == 0
    assert lse[3] == 0
    expected = F.cross_entropy(logits[:1].double(), targets[:1], reduction="none")
    assert abs(loss[0].item() - expected.item()) <= 1e-5
    grad = ops._cross_entropy_backward_reference(logits, targets, lse, torch.ones(4), ignore_index=-100,
                                                 label_smoothing=0.0)
    assert torch.isfinite(grad[0]).all() and (grad[0, 1::2] == 0).all()
    assert torch.isnan(grad[1:3]).all() and (grad[3] == 0).all()


def test_cross_entropy_empty_batch() -> None:
    loss, lse = ops.cross_entropy_forward(torch.empty(0, 10), torch.empty(0, dtype=torch.int64))
    assert loss.shape == (0,) and lse.shape == (0,) and loss.dtype == torch.float32
    logits = torch.empty(0, 10)
    assert ops.cross_entropy_backward_(logits, torch.empty(0, dtype=torch.int64), lse, loss, ignore_index=-100,
                                       label_smoothing=0.0) is logits


def ce_call(logits: object = None, targets: object = None, **kwargs: object) -> None:
    logits = torch.randn(4, 10) if logits is None else logits
    targets = torch.zeros(4, dtype=torch.int64) if targets is None else targets
    ops.cross_entropy_forward(logits, targets, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: ce_call(logits=[[1.0]]), TypeError, "logits must be a torch.Tensor, got list"),
        (lambda: ce_call(logits=torch.randn(4, 10, dtype=torch.float64)), TypeError,
         "logits has dtype torch.float64; expected one of torch.float32, torch.float16, torch.bfloat16"),
        (lambda: ce_call(logits=torch.randn(40)), ValueError, r"logits has shape \(40,\); expected \(N, V\)"),
        (lambda: ce_call(logits=torch.randn(4, 0)), ValueError,
         r"logits has shape \(4, 0\); expected \(N, V\) with V >= 1"),
        (lambda: ce_call(logits=torch.randn(10, 4).t()), ValueError,
         r"logits is not contiguous; call \.contiguous\(\)"),
        (lambda: ce_call(targets=torch.zeros(4, dtype=torch.int32)), TypeError,
         "targets has dtype torch.int32; expected torch.int64 class indices"),
        (lambda: ce_call(targets=(1, 2, 3, 4)), TypeError, "targets must be a torch.Tensor, got tuple"),
        (lambda: ce_call(targets=torch.zeros(5, dtype=torch.int64)), ValueError,
         r"targets has shape \(5,\); expected \(4,\), one class index per row of logits"),
        (lambda: ce_call(targets=torch.zeros(8, dtype=torch.int64)[::2]), ValueError, "targets is not contiguous"),
        (lambda: ce_call(ignore_index=-100.0), TypeError, "ignore_index must be an int, got float"),
        (lambda: ce_call(label_smoothing="0.1"), TypeError, "label_smoothing must be a real number, got str"),
        (lambda: ce_call(label_smoothing=1.5), ValueError, r"label_smoothing must be in \[0, 1\], got 1.5"),
        (lambda: ce_call(label_smoothing=-0.1), ValueError, r"label_smoothing must be in \[0, 1\], got -0.1"),
        (lambda: ce_call(out=torch.zeros(4)), TypeError, r"out must be a \(loss, lse\) tuple of two tensors"),
        (lambda: ce_call(out=(torch.zeros(4), torch.zeros(4, dtype=torch.float16))), TypeError,
         r"out\[1\] \(lse\) has dtype torch.float16; expected torch.float32"),
        (lambda: ce_call(out=(torch.zeros(3), torch.zeros(4))), ValueError,
         r"out\[0\] \(loss\) has shape \(3,\); expected \(4,\)"),
        (lambda: (lambda b: ce_call(out=(b[:4], b[2:6])))(torch.zeros(8)), ValueError,
         r"out\[0\] \(loss\) and out\[1\] \(lse\) share memory"),
        (lambda: ce_call(logits=torch.empty(4, 10, device="meta")), NotImplementedError,
         "logits is on device meta; bmtwrap.ops supports cpu and cuda tensors"),
    ],
)
def test_cross_entropy_forward_argument_errors(call: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call()  # type: ignore[operator]


def ce_backward_call(lse: object = None, grad_rows: object = None, **kwargs: object) -> None:
    logits = torch.randn(4, 10)
    targets = torch.zeros(4, dtype=torch.int64)
    lse = torch.zeros(4) if lse is None else lse
    grad_rows = torch.ones(4) if grad_rows is None else grad_rows
    options = {"ignore_index": -100, "label_smoothing": 0.0, **kwargs}
    ops.cross_entropy_backward_(logits, targets, lse, grad_rows, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: ce_backward_call(lse=torch.zeros(4, dtype=torch.float64)), TypeError,
         "lse has dtype torch.float64; expected torch.float32"),
        (lambda: ce_backward_call(grad_rows=torch.ones(4, 1)), ValueError,
         r"grad_rows has shape \(4, 1\); expected \(4,\), one value per row of logits"),
        (lambda: ce_backward_call(grad_rows=torch.ones(8)[::2]), ValueError, "grad_rows is not contiguous"),
        (lambda: ce_backward_call(grad_rows=1.0), TypeError, "grad_rows must be a torch.Tensor, got float"),
        (lambda: ce_backward_call(label_smoothing=2.0), ValueError, r"label_smoothing must be in \[0, 1\]"),
        (lambda: (lambda b: ce_backward_call(lse=b[:4], grad_rows=b[2:6]))(torch.zeros(8)), ValueError,
         "lse and grad_rows share memory"),
    ],
)
def test_cross_entropy_backward_argument_errors(call: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call()  # type: ignore[operator]


def test_cross_entropy_backward_needs_both_options() -> None:
    with pytest.raises(TypeError, match="label_smoothing"):
        ops.cross_entropy_backward_(torch.randn(2, 3), torch.zeros(2, dtype=torch.int64), torch.zeros(2),
                                    torch.ones(2), ignore_index=-100)  # type: ignore[call-arg]


def adam_call(**overrides: object) -> None:
    tensors = {"param": torch.zeros(8), "grad": torch.zeros(8), "exp_avg": torch.zeros(8),
               "exp_avg_sq": torch.zeros(8)}
    options: dict[str, object] = {**ADAM, "step": 1}
    for name, value in overrides.items():
        (tensors if name in tensors else options)[name] = value
    ops.adam_step_cuda(tensors["param"], tensors["grad"], tensors["exp_avg"], tensors["exp_avg_sq"],
                       **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"param": torch.zeros(8, dtype=torch.bfloat16)}, TypeError,
         "param has dtype torch.bfloat16; the master copy must be fp32"),
        ({"exp_avg": torch.zeros(8, dtype=torch.float16)}, TypeError,
         "exp_avg has dtype torch.float16; the optimizer moments must be fp32"),
        ({"exp_avg_sq": torch.zeros(8, dtype=torch.float64)}, TypeError,
         "exp_avg_sq has dtype torch.float64; the optimizer moments must be fp32"),
        ({"grad": torch.zeros(8, dtype=torch.int32)}, TypeError,
         "grad has dtype torch.int32; expected one of torch.float32, torch.float16, torch.bfloat16"),
        ({"grad": [0.0] * 8}, TypeError, "grad must be a torch.Tensor, got list"),
        ({"out": torch.zeros(8)}, TypeError, "out has dtype torch.float32; expected one of torch.float16"),
        ({"grad": torch.zeros(16)[::2]}, ValueError, r"grad is not contiguous; call \.contiguous\(\) first"),
        ({"exp_avg": torch.zeros(9)}, ValueError, "exp_avg has 9 elements but param has 8; expected the same"),
        ({"skip_if": torch.zeros(1, dtype=torch.bool)}, TypeError,
         "skip_if has dtype torch.bool; expected torch.uint8"),
        ({"skip_if": torch.zeros(2, dtype=torch.uint8)}, ValueError, "skip_if has 2 elements; expected 1"),
        ({"skip_if": 0}, TypeError, "skip_if must be a torch.Tensor or None, got int"),
        ({}, ValueError, r"param is on cpu; adam_step_cuda updates CUDA tensors \(adam_step_cpu: CPU ones\)"),
        ({"step": 0}, ValueError, "step must be >= 1"),
        ({"beta1": 1.0}, ValueError, r"beta1 must be finite and in \[0, 1\)"),
        ({"grad_scale": 0.0}, ValueError, "grad_scale must be finite and > 0"),
        ({"decoupled": 1}, TypeError, "decoupled must be a bool, got int"),
        ({"param": torch.empty(8, device="meta")}, NotImplementedError, "param is on device meta"),
    ],
)
def test_adam_step_cuda_argument_errors(overrides: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        adam_call(**overrides)


@pytest.mark.parametrize("with_out", [False, True])
def test_adam_reference_unless_skips_without_sync(with_out: bool) -> None:
    # The fallback of adam_step_cuda honours skip_if with torch.where, never with .item().
    param, exp_avg, exp_avg_sq = adam_state(1000, seed=12, device="cpu")
    grad = random_grad(1000, torch.bfloat16, seed=13, device="cpu")
    out = torch.full((1000,), math.nan, dtype=torch.bfloat16) if with_out else None
    hyper = ops._AdamHyper(**ADAM, step=3, grad_scale=0.5, decoupled=True)
    before = [bits(t).clone() for t in (param, exp_avg, exp_avg_sq)] + ([bits(out).clone()] if with_out else [])

    ops._adam_reference_unless(torch.ones(1, dtype=torch.uint8), param, grad, exp_avg, exp_avg_sq, hyper, out)
    after = [bits(t) for t in (param, exp_avg, exp_avg_sq)] + ([bits(out)] if with_out else [])
    assert all(torch.equal(a, b) for a, b in zip(after, before))

    ref = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    ops._adam_reference(ref[0], grad, ref[1], ref[2], **hyper._asdict())
    ops._adam_reference_unless(torch.zeros(1, dtype=torch.uint8), param, grad, exp_avg, exp_avg_sq, hyper, out)
    assert all(torch.equal(a, b) for a, b in zip((param, exp_avg, exp_avg_sq), ref))
    if with_out:
        assert torch.equal(bits(out), bits(param.to(torch.bfloat16)))


# ============================================================================================ scaled copy


def scaled_inputs(numel: int, dtype: torch.dtype, device: str, offset: int) -> torch.Tensor:
    """Values of every magnitude bf16 and fp16 round differently (and fp16's overflow), `offset` elements into a
    larger buffer so that the start may be off a 16-byte boundary."""
    g = generator(numel + offset, device)
    flat = torch.randn(numel + offset, generator=g, device=device) * torch.logspace(-6, 5, numel + offset,
                                                                                     device=device)
    return flat.to(dtype)[offset:]


@cuda
@pytest.mark.parametrize("src_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("out_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("numel, src_offset, out_offset", [(1, 0, 0), (13, 0, 0), (4099, 0, 0), (4099, 1, 0),
                                                          (4099, 0, 3), (1 << 20, 0, 0)])
def test_scaled_copy_matches_torch_bit_for_bit(device: str, src_dtype: torch.dtype, out_dtype: torch.dtype,
                                               numel: int, src_offset: int, out_offset: int) -> None:
    """The kernel gives what torch's fp32 product rounded to the output's dtype gives, vectors and tail alike."""
    src = scaled_inputs(numel, src_dtype, device, src_offset)
    for value in (1.0, 0.3717, -2.5e-3, math.inf):
        scale = torch.tensor([value], device=device)
        out = torch.full((numel + out_offset,), math.nan, dtype=out_dtype, device=device)[out_offset:]
        assert ops.scaled_copy_(out, src, scale) is out
        assert torch.equal(bits(out), bits((src.float() * value).to(out_dtype))), (value, numel)


@cuda
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_scaled_copy_in_place(device: str, dtype: torch.dtype) -> None:
    src = scaled_inputs(10_001, dtype, device, 0)
    expected = (src.float() * 0.3717).to(dtype)
    ops.scaled_copy_(src, src, torch.tensor([0.3717], device=device))
    assert torch.equal(bits(src), bits(expected))


def test_scaled_copy_on_the_cpu_and_its_errors() -> None:
    src = scaled_inputs(1000, torch.float32, "cpu", 0)
    out = torch.empty(1000, dtype=torch.bfloat16)
    ops.scaled_copy_(out, src, torch.tensor(0.3717))
    assert torch.equal(bits(out), bits((src * 0.3717).to(torch.bfloat16)))
    with pytest.raises(ValueError, match="out has 999 elements but src 1000"):
        ops.scaled_copy_(out[:999], src, torch.tensor(1.0))
    with pytest.raises(TypeError, match="scale has dtype torch.float64"):
        ops.scaled_copy_(out, src, torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="scale has 2 elements"):
        ops.scaled_copy_(out, src, torch.ones(2))
    with pytest.raises(ValueError, match="share memory"):
        ops.scaled_copy_(src[1:].view(torch.int32).view(torch.float32)[:999], src[:999], torch.tensor(1.0))
