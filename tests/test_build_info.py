"""What the compiled extension says it was built for (``ops.cuda_archs()``), and the line install.sh prints."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

from bmtwrap import ops
from bmtwrap.ops import _ext


def test_cuda_archs_are_those_compiled_into_the_extension() -> None:
    """setup.py's record (a macro of the binding) against the cubins nvcc put into the module: each cubin
    carries its ptxas options, ``-arch sm_XX -m 64``, as text in the fatbin."""
    archs = ops.cuda_archs()
    assert all(re.fullmatch(r"sm_\d+[af]?", arch) for arch in archs), archs
    assert bool(archs) == ops.extension_available(cuda=True)
    if not ops.extension_available():
        pytest.skip("bmtwrap._C is not built (tests/test_ops.py::test_extension_is_built fails)")
    binary = Path(_ext._C.__file__).read_bytes()
    compiled = sorted({arch.decode() for arch in re.findall(rb"-arch (sm_\d+[af]?) ", binary)})
    if archs and not compiled:
        pytest.skip("this nvcc leaves no readable ptxas options in the fatbin")
    assert compiled == sorted(archs)


def _built(*, cuda: str | None) -> types.SimpleNamespace:
    """A stand-in for bmtwrap._C built for these compute capabilities (None: without CUDA) on an AVX2 CPU."""
    isas = [types.SimpleNamespace(name="scalar"), types.SimpleNamespace(name="avx2")]
    return types.SimpleNamespace(has_cuda=lambda: cuda is not None, cuda_archs=lambda: cuda or "",
                                 cpu_supported_isas=lambda: isas)


def _gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int] | None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100")


def test_cuda_archs_without_cuda_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_ext, "_C", None)
    assert ops.cuda_archs() == []
    monkeypatch.setattr(_ext, "_C", _built(cuda=None))
    assert ops.cuda_archs() == []
    monkeypatch.setattr(_ext, "_C", _built(cuda="80;90a"))
    assert ops.cuda_archs() == ["sm_80", "sm_90a"]


NO_CUDA = "no CUDA: built without nvcc or with BMTWRAP_NO_CUDA=1"


@pytest.mark.parametrize("cuda, capability, expected", [
    ("80;90", None, "CUDA for sm_80, sm_90 (no GPU visible: the CPU kernels and torch run here)"),
    ("80;90", (9, 0), "CUDA for sm_80, sm_90 (GPU visible: NVIDIA H100, sm_90)"),
    ("80;90a", (9, 0), "CUDA for sm_80, sm_90a (GPU visible: NVIDIA H100, sm_90)"),
    ("80;90", (10, 0), "CUDA for sm_80, sm_90 (GPU visible: NVIDIA H100, sm_100: the kernels run from the sm_90 "
                       "PTX, compiled by the driver on first use)"),
    ("80;90", (7, 5), "CUDA for sm_80, sm_90 (GPU visible: NVIDIA H100, sm_75, which has no kernel image among them: "
                      "rebuild with BMTWRAP_CUDA_ARCH=75)"),
    (None, None, f"{NO_CUDA} (no GPU visible: the CPU kernels and torch run here)"),
    (None, (9, 0), f"{NO_CUDA} (GPU visible: NVIDIA H100, sm_90; its ops run their plain-PyTorch references)"),
])
def test_build_summary(monkeypatch: pytest.MonkeyPatch, cuda: str | None, capability: tuple[int, int] | None,
                       expected: str) -> None:
    monkeypatch.setattr(_ext, "_C", _built(cuda=cuda))
    _gpu(monkeypatch, capability)
    assert _ext.build_summary() == f"with compiled kernels: CPU (AVX2), {expected}"


def test_build_summary_without_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_ext, "_C", None)
    assert _ext.build_summary() == "WITHOUT compiled kernels: every op runs its plain-PyTorch reference"
