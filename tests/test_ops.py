"""bmtwrap.ops against its plain-PyTorch references: on the CPU always, on a GPU for tests marked `cuda`."""

from __future__ import annotations

import random
import types
import warnings
from collections.abc import Iterator

import pytest
import torch

from bmtwrap import ops

CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: torch.cuda.is_available() is False"),
]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 7, 1000, 1_000_003]
SPECIALS = [float("inf"), float("-inf"), float("nan")]
POSITIONS = ["first", "last", "random"]
# Integer dtypes of the same width, to write raw bit patterns into float tensors with .view().
BITS_DTYPE = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def random_tensor(numel: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator).to(dtype=dtype, device=device)


def position(numel: int, where: str, seed: int = 0) -> int:
    return {"first": 0, "last": numel - 1, "random": random.Random(seed).randrange(numel)}[where]


def from_bits(bits: list[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Float tensor holding exactly these bit patterns (given as unsigned integers)."""
    width = torch.finfo(dtype).bits
    signed = [b - (1 << width) if b >= 1 << (width - 1) else b for b in bits]
    return torch.tensor(signed, dtype=BITS_DTYPE[dtype]).view(dtype).to(device)


@pytest.fixture
def fresh_fallback_warning() -> Iterator[None]:
    """Forget which fallback warnings bmtwrap.ops gave, so that this test sees its own."""
    ops._warn_fallback.cache_clear()
    yield
    ops._warn_fallback.cache_clear()


def test_extension_is_built() -> None:
    # Fails rather than skips: CI builds the extension, so a missing one is a broken build.
    assert ops.extension_available(), "bmtwrap._C is not importable; run `pip install --no-build-isolation -e .`"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", SIZES)
def test_finite_matches_reference(device: str, dtype: torch.dtype, numel: int) -> None:
    tensor = random_tensor(numel, dtype, device, seed=numel)
    expected = bool(ops._has_inf_nan_reference(tensor))
    assert ops.has_inf_nan(tensor) is expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [n for n in SIZES if n > 0])
@pytest.mark.parametrize("special", SPECIALS, ids=str)
@pytest.mark.parametrize("where", POSITIONS)
def test_planted_matches_reference(device: str, dtype: torch.dtype, numel: int, special: float, where: str) -> None:
    tensor = random_tensor(numel, dtype, device, seed=numel)
    tensor[position(numel, where, seed=numel)] = special
    assert bool(ops._has_inf_nan_reference(tensor)) is True
    assert ops.has_inf_nan(tensor) is True


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16_bit_pattern(device: str, dtype: torch.dtype) -> None:
    # Work on the bits: a nan that passes through a Python float loses its payload.
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)  # wraps to every int16
    is_finite = torch.isfinite(bits.view(dtype))
    assert ops.has_inf_nan(bits[is_finite].view(dtype).to(device)) is False
    # Each non-finite pattern in its own chunk of 8 finite elements (one 16-byte vector), at every lane in
    # turn; one flag per chunk, so that a single miss shows.
    non_finite = bits[~is_finite]
    rows = torch.arange(len(non_finite))
    chunks = torch.ones(len(non_finite), 8, dtype=dtype)
    chunks.view(torch.int16)[rows, rows % 8] = non_finite
    chunks = chunks.to(device)
    flags = torch.zeros(len(non_finite), dtype=torch.uint8, device=device)
    for i in range(len(non_finite)):
        ops.has_inf_nan_into(chunks[i], flags[i : i + 1])
    assert flags.bool().all()


@pytest.mark.parametrize("device", DEVICES)
def test_float32_edge_bit_patterns(device: str) -> None:
    finite = [0x00000000, 0x80000000, 0x00000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000]
    non_finite = [0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0xFFC00001]
    assert ops.has_inf_nan(from_bits(finite, torch.float32, device)) is False
    for bits in non_finite:
        assert ops.has_inf_nan(from_bits(finite + [bits], torch.float32, device)) is True


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_offset_views_read_only_their_elements(device: str, dtype: torch.dtype) -> None:
    # Views that start off a 16-byte boundary; nan just outside each view must not be seen.
    base = random_tensor(1003, dtype, device)
    base[0] = base[-1] = float("nan")
    for start in range(1, 10):
        view = base[start:-1]
        assert ops.has_inf_nan(view) is False, f"start={start}"
        for index in (0, -1):
            kept = view[index].clone()
            view[index] = float("inf")
            assert ops.has_inf_nan(view) is True, f"start={start}, index={index}"
            view[index] = kept


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_into_accumulates_over_buffers(device: str, dtype: torch.dtype) -> None:
    flag = torch.zeros(1, dtype=torch.uint8, device=device)
    buffers = [random_tensor(n, dtype, device, seed=n) for n in (5, 1000, 0, 70_001)]
    for buffer in buffers:
        ops.has_inf_nan_into(buffer, flag)
    assert flag.item() == 0
    poisoned = random_tensor(333, dtype, device)
    poisoned[100] = float("nan")
    ops.has_inf_nan_into(poisoned, flag)
    assert flag.item() == 1
    for buffer in buffers:  # finite buffers never clear the flag
        ops.has_inf_nan_into(buffer, flag)
    assert flag.item() == 1


@pytest.mark.parametrize("device", DEVICES)
def test_not_contiguous_raises(device: str) -> None:
    transposed = torch.randn(4, 6, device=device).t()
    strided = torch.randn(10, device=device)[::2]
    for tensor in (transposed, strided):
        with pytest.raises(ValueError, match=r"tensor is not contiguous; call \.contiguous\(\) first"):
            ops.has_inf_nan(tensor)
        with pytest.raises(ValueError, match=r"tensor is not contiguous; call \.contiguous\(\) first"):
            ops.has_inf_nan_into(tensor, torch.zeros(1, dtype=torch.uint8, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.float64], ids=str)
def test_wrong_dtype_raises(device: str, dtype: torch.dtype) -> None:
    tensor = torch.zeros(8, dtype=dtype, device=device)
    expected = rf"tensor has dtype {dtype}; expected one of torch.float32, torch.float16, torch.bfloat16"
    with pytest.raises(TypeError, match=expected):
        ops.has_inf_nan(tensor)
    with pytest.raises(TypeError, match=expected):
        ops.has_inf_nan_into(tensor, torch.zeros(1, dtype=torch.uint8, device=device))


def test_not_a_tensor_raises() -> None:
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor, got list"):
        ops.has_inf_nan([1.0, 2.0])  # type: ignore[arg-type]


def test_unsupported_device_raises() -> None:
    with pytest.raises(NotImplementedError, match="tensor is on device meta; bmtwrap.ops supports cpu and cuda"):
        ops.has_inf_nan(torch.empty(4, device="meta"))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_flag_raises(device: str) -> None:
    tensor = torch.randn(16, device=device)
    with pytest.raises(TypeError, match="flag has dtype torch.float32; expected torch.uint8"):
        ops.has_inf_nan_into(tensor, torch.zeros(1, device=device))
    with pytest.raises(ValueError, match="flag has 2 elements; expected 1"):
        ops.has_inf_nan_into(tensor, torch.zeros(2, dtype=torch.uint8, device=device))
    with pytest.raises(TypeError, match="flag must be a torch.Tensor, got int"):
        ops.has_inf_nan_into(tensor, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", DEVICES)
def test_fallback_without_extension_warns_once(
    device: str, monkeypatch: pytest.MonkeyPatch, fresh_fallback_warning: None
) -> None:
    monkeypatch.setattr(ops._ext, "_C", None)
    poisoned = random_tensor(1000, torch.bfloat16, device)
    poisoned[-1] = float("nan")
    expected = r"compiled extension bmtwrap._C is missing.*pip install --no-build-isolation -e \."
    with pytest.warns(RuntimeWarning, match=expected):
        assert ops.has_inf_nan(poisoned) is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: no second warning
        assert ops.extension_available() is False
        assert ops.has_inf_nan(random_tensor(1000, torch.float16, device)) is False
        assert ops.has_inf_nan(torch.empty(0, device=device)) is False
        flag = torch.zeros(1, dtype=torch.uint8, device=device)
        ops.has_inf_nan_into(random_tensor(10, torch.float32, device), flag)
        assert flag.item() == 0
        ops.has_inf_nan_into(poisoned, flag)
        ops.has_inf_nan_into(random_tensor(10, torch.float32, device), flag)
        assert flag.item() == 1


# ------------------------------------------------------------------------------------------- GPU only


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_cuda_kernels_compiled_in(device: str) -> None:
    assert ops.extension_available(cuda=True), "bmtwrap._C was built without CUDA; rebuild where nvcc is found"


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_large_buffer(device: str, dtype: torch.dtype) -> None:
    numel = 64 * 1024 * 1024
    tensor = torch.randn(numel, device=device, dtype=dtype)
    assert bool(ops._has_inf_nan_reference(tensor)) is False
    assert ops.has_inf_nan(tensor) is False
    for where, special in zip(POSITIONS, SPECIALS):
        index = position(numel, where)
        kept = tensor[index].clone()
        tensor[index] = special
        assert ops.has_inf_nan(tensor) is True, f"{special} at {where}"
        tensor[index] = kept


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_cuda_into_on_side_stream(device: str) -> None:
    poisoned = torch.randn(100_000, device=device)
    poisoned[12_345] = float("inf")
    flag = torch.zeros(1, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.has_inf_nan_into(poisoned, flag)
    stream.synchronize()
    assert flag.item() == 1


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_cuda_tensor_on_another_device(device: str) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    tensor = torch.randn(10_000, device="cuda:1")
    tensor[-1] = float("nan")
    flag = torch.zeros(1, dtype=torch.uint8, device="cuda:1")
    with torch.cuda.device(0):
        assert ops.has_inf_nan(tensor) is True
        ops.has_inf_nan_into(tensor, flag)
    assert flag.item() == 1
    with pytest.raises(ValueError, match="flag is on cuda:0 but tensor is on cuda:1"):
        ops.has_inf_nan_into(tensor, torch.zeros(1, dtype=torch.uint8, device="cuda:0"))


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_cuda_fallback_when_built_without_cuda(
    device: str, monkeypatch: pytest.MonkeyPatch, fresh_fallback_warning: None
) -> None:
    monkeypatch.setattr(ops._ext, "_C", types.SimpleNamespace(has_cuda=lambda: False))
    poisoned = torch.randn(1000, device=device)
    poisoned[3] = float("nan")
    with pytest.warns(RuntimeWarning, match="built without CUDA kernels"):
        assert ops.has_inf_nan(poisoned) is True
