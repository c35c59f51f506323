"""FusedCrossEntropy and linear_cross_entropy against torch.nn.functional.cross_entropy (CPU, fp32).

On the CPU both run on the torch reference of the kernel's math, so these tests check the
autograd plumbing: reductions, ignored rows, label smoothing, in-place gradients, chunking.
The CUDA kernels are compared with torch in tests/test_cuda_kernels.py.
"""

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import bmtwrap as bmt


def data(n=37, v=11, h=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g, dtype=torch.float64).float()
    target = torch.randint(0, v, (n,), generator=g)
    target[::5] = -100
    return logits, target, torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("inplace", [False, True])
def test_fused_cross_entropy_matches_torch(reduction, smoothing, inplace):
    logits, target, _, _ = data()
    ours_in = logits.clone().requires_grad_()
    ref_in = logits.clone().requires_grad_()
    loss = bmt.loss.FusedCrossEntropy(reduction=reduction, label_smoothing=smoothing, inplace=inplace)(
        ours_in * 1.0, target)
    ref = F.cross_entropy(ref_in, target, reduction=reduction, label_smoothing=smoothing, ignore_index=-100)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    weight = torch.randn_like(ref) if reduction == "none" else torch.tensor(1.7)
    (loss * weight).sum().backward()
    (ref * weight).sum().backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-5, atol=1e-6)


def test_fused_cross_entropy_keeps_leading_dimensions():
    logits, target, _, _ = data(n=12)
    loss = bmt.loss.FusedCrossEntropy(reduction="none")(logits.view(3, 4, -1), target.view(3, 4))
    assert loss.shape == (3, 4)


@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_matches_torch(chunk, reduction):
    _, target, hidden, weight = data()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ours = bmt.loss.linear_cross_entropy(h1, w1, target, reduction=reduction, label_smoothing=0.1, chunk_size=chunk)
    ref = F.cross_entropy(h2 @ w2.T, target, reduction=reduction, label_smoothing=0.1)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    (ours * 0.5).backward()
    (ref * 0.5).backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-6)


def test_loss_arguments_are_checked():
    logits, target, hidden, weight = data()
    with pytest.raises(ValueError, match="reduction must be one of"):
        bmt.loss.FusedCrossEntropy(reduction="max")
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\)"):
        bmt.loss.FusedCrossEntropy(label_smoothing=1.0)
    with pytest.raises(ValueError, match="disagree"):
        bmt.loss.FusedCrossEntropy()(logits, target[:-1])
    with pytest.raises(ValueError, match="linear_cross_entropy reduces"):
        bmt.loss.linear_cross_entropy(hidden, weight, target, reduction="none")
    with pytest.raises(ValueError, match=r"need hidden \(N, H\) and weight \(V, H\)"):
        bmt.loss.linear_cross_entropy(hidden, weight.T, target)


def test_linear_cross_entropy_slices_the_vocabulary(monkeypatch):
    """The weight gradient is accumulated a few vocabulary rows at a time: same result."""
    monkeypatch.setattr(bmt.loss, "_VOCAB_SLICE", 3)
    _, target, hidden, weight = data()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    bmt.loss.linear_cross_entropy(h1, w1, target, chunk_size=4).backward()
    F.cross_entropy(h2 @ w2.T, target).backward()
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)


class _LogitsAlive(TorchDispatchMode):
    """Before each product that makes a chunk's logits (a matmul with ``vocab`` columns), counts the (rows x vocab)
    tensors made before it that are still alive (the logits, their softcapped form)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.made = weakref.WeakValueDictionary()  # by id: alive ones only
        self.alive_at_product = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        makes_logits = func is torch.ops.aten.mm.default and args[1].shape[-1] == self.vocab
        if makes_logits:
            self.alive_at_product.append(len(self.made))
        out = func(*args, **(kwargs or {}))
        if not func.is_view and isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[-1] == self.vocab:
            self.made[id(out)] = out
        return out


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_linear_cross_entropy_holds_one_chunk_of_logits(softcap):
    """Each chunk's logits are freed before the next chunk's are made: one chunk alive at a time, not two."""
    _, target, hidden, weight = data()
    h = hidden.clone().requires_grad_()
    with _LogitsAlive(weight.shape[0]) as seen:
        bmt.loss.linear_cross_entropy(h, weight, target, chunk_size=10, softcap=softcap).backward()
    assert seen.alive_at_product == [0, 0, 0, 0]


def test_linear_cross_entropy_under_autocast_gives_gradients_in_the_inputs_dtypes():
    """Under bf16 autocast (the Trainer's ``bf16=True``) the products run in bf16 while the hidden state and the weight
    are fp32: each gradient comes back in its input's dtype, close to torch's loss under the same autocast."""
    _, target, hidden, weight = data()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = bmt.loss.linear_cross_entropy(h1, w1, target, chunk_size=10)
        ref = F.cross_entropy((h2 @ w2.T).float(), target)
    ours.backward()
    ref.backward()
    assert (h1.grad.dtype, w1.grad.dtype) == (torch.float32, torch.float32)
    torch.testing.assert_close(ours, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=5e-2, atol=5e-3)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=5e-2, atol=5e-3)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fused_cross_entropy_with_class_weights_matches_torch(reduction):
    """BMTrain's signature: FusedCrossEntropy(weight, ignore_index, reduction, label_smoothing, parallel)."""
    logits, target, _, _ = data()
    weight = torch.rand(logits.shape[-1], generator=torch.Generator().manual_seed(3)) + 0.5
    ours_in = logits.clone().requires_grad_()
    ref_in = logits.clone().requires_grad_()
    loss = bmt.loss.FusedCrossEntropy(weight, -100, reduction, 0.1)(ours_in, target)
    ref = F.cross_entropy(ref_in, target, weight=weight, ignore_index=-100, reduction=reduction, label_smoothing=0.1)
    torch.testing.assert_close(loss, ref)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad)
    with pytest.raises(ValueError, match=r"weight must be a 1-D tensor with one weight per class, got \(2, 2\)"):
        bmt.loss.FusedCrossEntropy(torch.ones(2, 2))
    with pytest.raises(ValueError, match="weight has 3 entries but the logits 11 classes"):
        bmt.loss.FusedCrossEntropy(torch.ones(3))(logits, target)
    with pytest.raises(NotImplementedError, match=r"FusedCrossEntropy\(parallel=True\) takes no class weight"):
        bmt.loss.FusedCrossEntropy(torch.ones(11), -100, "mean", 0.0, True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_linear_cross_entropy_on_a_gpu_accumulates_the_weight_gradient_in_fp32():
    """bf16 inputs on a GPU: the weight gradient is summed over chunks in fp32 by the matmul itself. Against
    float64 math on the same bf16 values, both gradients stay within bf16 rounding of the logits' gradient
    (which is stored in bf16), far below what an accumulation in bf16 over 8 chunks would lose."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 1024, 256, 5003
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * 0.05).bfloat16()
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    target[::7] = -100
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = bmt.loss.linear_cross_entropy(h1, w1, target, chunk_size=128)
    loss.backward()
    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = F.cross_entropy(h2 @ w2.T, target)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-3 * abs(ref.item())
    for ours, theirs in ((h1.grad, h2.grad), (w1.grad, w2.grad)):
        assert ours.dtype == torch.bfloat16
        error = (ours.double() - theirs).abs().max().item() / theirs.abs().max().item()
        assert error < 2 ** -6, error
