"""Attention kernels at Llama training shapes: each of torch's SDPA backends, forward and backward.

    python benchmarks/attention_backends.py            # on one GPU

The call a Hugging Face Llama makes in training with ``attn_implementation="sdpa"`` and no padding mask:
``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` in bf16, ``q`` with all the
heads, ``k`` and ``v`` with the key/value heads. Also the same with ``k`` and ``v`` repeated to every head
(what transformers does when a mask is given). Median of 20 timed forward+backward calls after 5, per
backend; a backend that does not take the call says why. Each output is compared with the flash backend's.
Prints one line per row and ``RESULT {json}``. See [Note: the attention kernel] in
``bmtwrap/wrap/attention.py`` for what bmtwrap does with the figures.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cross_entropy import measure

# name: (batch, heads, key/value heads, sequence, head size): the Llama 3 shapes benchmarks/train_llama.py runs.
SHAPES = {
    "1b, 8 x 2048": (8, 32, 8, 2048, 64),
    "8b, 2 x 4096": (2, 32, 8, 4096, 128),
    "70b, 2 x 4096 (one GPU's heads at tp 2)": (2, 32, 4, 4096, 128),
}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def row(shape: Any, backend: str, gqa: bool, reference: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    batch, heads, kv_heads, seq, size = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, heads, seq, size, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(batch, kv_heads, seq, size, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    if not gqa:
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    grad = torch.randn(batch, heads, seq, size, device="cuda", dtype=torch.bfloat16, generator=gen)
    kwargs = dict(is_causal=True, enable_gqa=gqa)

    def call() -> torch.Tensor:
        with sdpa_kernel(BACKENDS[backend]):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    try:
        out = call()
    except RuntimeError as error:
        return dict(backend=backend, gqa=gqa, error=" ".join(str(error).split())[:160])
    key = f"{gqa}"
    reference.setdefault(key, out.detach())
    diff = (out.detach().float() - reference[key].float()).abs().max().item()
    forward_ms, _ = measure(call, warmup=5, repeat=20)

    def both() -> None:
        call().backward(grad)

    total_ms, _ = measure(both, warmup=5, repeat=20)
    forward_s, total_s = forward_ms / 1e3, total_ms / 1e3
    # Causal: half the score matrix; 2 matmuls of 2 FLOPs per multiply-add forward, 2.5x that backward.
    flops = 2 * 2 * batch * heads * seq * seq * size / 2 * 3.5
    return dict(backend=backend, gqa=gqa, forward_ms=round(forward_s * 1e3, 3), fwd_bwd_ms=round(total_s * 1e3, 3),
                tflops=round(flops / total_s / 1e12, 1), max_diff_vs_flash=round(diff, 5))


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                cudnn=torch.backends.cudnn.version(), priority=[int(b) for b in torch._C._get_sdp_priority_order()])
    print(info, flush=True)
    rows: List[Dict[str, Any]] = []
    for name, shape in SHAPES.items():
        reference: Dict[str, torch.Tensor] = {}
        for gqa in (True, False):
            for backend in BACKENDS:
                found = dict(shape=name, **row(shape, backend, gqa, reference))
                rows.append(found)
                print(found, flush=True)
    print("RESULT " + json.dumps(dict(**info, rows=rows)), flush=True)


if __name__ == "__main__":
    main()
