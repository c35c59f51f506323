"""``bmt.from_pretrained`` of every Hugging Face family of the zoo, against transformers' own ``from_pretrained``.

For each family (zoo.py's Hugging Face cases, plus Gemma and Gemma 2, whose embedding scale is a
buffer made in the constructor and never saved): rank 0 saves a seeded random model with
``save_pretrained``; every rank loads that folder twice, with plain transformers (the reference)
and with ``bmt.from_pretrained`` (built on the meta device, wrapped, streamed into shards), both
in float32, and reports whether

- every parameter and persistent buffer (``bmt.full_state_dict``) equals the reference's, bit for bit;
- every buffer, non-persistent ones included (``named_buffers``), equals the reference's, bit for bit;
- the loss of one batch, both models in eval mode, is the same (the largest relative difference
  over the ranks is reported).

A second check per family, ``materialize``: the model built on the meta device, wrapped and
initialised by ``bmt.materialize`` has the same buffers as the model built on the CPU (its
parameters are drawn at random, so only the buffers can be compared).

Arguments: 1: where rank 0 writes the results; 2: a scratch folder every rank sees.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist
import transformers as tf
from torch import nn

import bmtwrap as bmt
from bmtwrap.engine.dist import current
from common import run
from zoo import HF_CASES, Case, hf_causal, tokens

FAMILIES: Dict[str, Case] = {
    **HF_CASES,
    "gemma": Case(hf_causal("GemmaForCausalLM", "GemmaConfig", head_dim=8), [], tokens, None),
    "gemma2": Case(hf_causal("Gemma2ForCausalLM", "Gemma2Config", head_dim=8, sliding_window=4,
                             final_logit_softcapping=30.0, attn_logit_softcapping=50.0), [], tokens, None),
}
SCRATCH = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(".")


def _all_ranks(value: float) -> float:
    """The largest of every rank's ``value``."""
    t = torch.tensor([value], dtype=torch.float64, device=current().device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _every_rank(flag: bool) -> bool:
    return _all_ranks(0.0 if flag else 1.0) == 0.0


def _unequal(ours: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> list:
    """Keys whose values differ (dtype, shape or any bit), and keys only one side has."""
    keys = sorted(set(ours) | set(ref))
    return [k for k in keys if k not in ours or k not in ref or ours[k].dtype != ref[k].dtype
            or not torch.equal(ours[k].cpu(), ref[k].cpu())]


@torch.no_grad()
def _loss(model: nn.Module, batch: Dict[str, Any]) -> float:
    return model(**batch).loss.item()


def imported(name: str, case: Case) -> Dict[str, Any]:
    folder = SCRATCH / name
    if bmt.rank() == 0:
        torch.manual_seed(0)
        case.build().save_pretrained(folder)
    dist.barrier()
    config = tf.AutoConfig.from_pretrained(folder)
    cls = getattr(tf, config.architectures[0])
    device = current().device  # the GPU under NCCL: both models compute there
    ref = cls.from_pretrained(folder, dtype=torch.float32).eval().to(device)
    model = bmt.from_pretrained(folder, model_class=cls, torch_dtype=torch.float32)
    params = _unequal(bmt.full_state_dict(model), ref.state_dict())
    buffers = _unequal(dict(model.named_buffers()), dict(ref.named_buffers()))
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.batch(0).items()}
    ours, theirs = _loss(model, batch), _loss(ref, batch)
    return {"class": cls.__name__, "params_unequal": params, "buffers_unequal": buffers,
            "buffers": sorted(dict(ref.named_buffers())), "loss": ours, "ref_loss": theirs,
            "loss_rel": _all_ranks(abs(ours - theirs) / abs(theirs)), "eval": not model.training,
            "same_on_every_rank": _every_rank(not params and not buffers)}


def materialized(name: str, case: Case) -> Dict[str, Any]:
    torch.manual_seed(0)
    ref = case.build().to(current().device)
    with torch.device("meta"):
        model = case.build()
    bmt.materialize(bmt.wrap(model))
    buffers = _unequal(dict(model.named_buffers()), dict(ref.named_buffers()))
    return {"buffers_unequal": buffers, "buffers": sorted(dict(ref.named_buffers())),
            "same_on_every_rank": _every_rank(not buffers)}


def cases() -> Dict[str, Callable[[], Dict[str, Any]]]:
    out: Dict[str, Callable[[], Dict[str, Any]]] = {}
    for name, case in FAMILIES.items():
        out[f"import/{name}"] = lambda name=name, case=case: imported(name, case)
        out[f"materialize/{name}"] = lambda name=name, case=case: materialized(name, case)
    return out


if __name__ == "__main__":
    run(cases())
