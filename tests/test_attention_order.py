"""The blocks' attention kernel order (``bmtwrap/wrap/attention.py``): which order each card gets, and that
entering it reorders torch's backends without switching on one the user switched off."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from bmtwrap.wrap import attention

CUDA = torch.device("cuda")


def test_preferences():
    assert attention.preferred_backends("auto", torch.device("cpu")) is None
    assert attention.preferred_backends("auto", CUDA, (8, 0)) is None  # Ampere: torch's own order
    assert attention.preferred_backends("torch", CUDA, (9, 0)) is None
    flash_first = attention.preferred_backends("flash", CUDA, (8, 0))
    assert flash_first == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
                           SDPBackend.CUDNN_ATTENTION]
    assert attention.preferred_backends("cudnn", CUDA, (8, 0))[0] == SDPBackend.CUDNN_ATTENTION
    hopper = attention.preferred_backends("auto", CUDA, (9, 0))
    assert hopper is None if not torch.backends.cudnn.is_available() else hopper[0] == SDPBackend.CUDNN_ATTENTION
    with pytest.raises(ValueError, match="'auto', 'torch' or one of"):
        attention.preferred_backends("fa3", CUDA, (9, 0))


def test_order_keeps_switched_off_backends_off():
    before = torch._C._get_sdp_priority_order()
    order = attention.preferred_backends("cudnn", CUDA, (9, 0))
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        with attention.attention_order(order):
            assert torch._C._get_sdp_priority_order()[0] == int(SDPBackend.CUDNN_ATTENTION)
            assert not torch.backends.cuda.flash_sdp_enabled()
            assert torch.backends.cuda.math_sdp_enabled() and torch.backends.cuda.cudnn_sdp_enabled()
        assert torch._C._get_sdp_priority_order() == before
    finally:
        torch.backends.cuda.enable_flash_sdp(True)


def test_body_runs_under_the_order_only_on_cuda():
    seen = []

    def body(x):
        seen.append(torch._C._get_sdp_priority_order()[0])
        return x + 1

    assert attention.with_attention_order(body, torch.device("cpu")) is body
    previous = attention.PREFERENCE
    attention.PREFERENCE = "cudnn"
    try:
        ordered = attention.with_attention_order(body, CUDA)  # the order is chosen here, not run on a GPU
    finally:
        attention.PREFERENCE = previous
    assert ordered(torch.ones(1)).item() == 2 and seen == [int(SDPBackend.CUDNN_ATTENTION)]
    assert torch._C._get_sdp_priority_order()[0] != int(SDPBackend.CUDNN_ATTENTION)
