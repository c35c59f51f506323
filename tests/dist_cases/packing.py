"""Packed batches on a model wrapped by bmtwrap: the same per-token losses and gradients as every
document run alone through the unwrapped model (tests/packing_ref.py), each rank on its own rows."""

from __future__ import annotations

import copy
import functools
from typing import Any, Dict

import torch

import bmtwrap as bmt
from bmtwrap.data import Packer
from common import run
from packing_ref import alone, examples, loss_count, rows_of, tiny, token_loss_gap

ROWS_PER_RANK = 2


def packed_vs_alone(family: str, **options: Any) -> Dict[str, Any]:
    ref = tiny(family)
    model = bmt.wrap(copy.deepcopy(ref), **options)
    world, rank = bmt.world_size(), bmt.rank()
    packer = Packer(seq=48, rows=ROWS_PER_RANK * world, seed=1, buffer_size=64)
    batch = next(iter(packer.batches(examples(40, seed=2, longest=30))))
    assert batch.input_ids.shape[0] == ROWS_PER_RANK * world, batch.input_ids.shape
    shares = [range(r * ROWS_PER_RANK, (r + 1) * ROWS_PER_RANK) for r in range(world)]
    mine = rows_of(batch, shares[rank])

    # The reference: each rank's documents alone, the loss their token mean, averaged over ranks (what
    # the engine's gradient average computes).
    ref_loss = sum(alone(ref, batch, share)[0] / loss_count(rows_of(batch, share)) for share in shares) / world
    ref_loss.backward()
    loss = model(**mine.model_inputs(model)).loss
    loss.backward()
    grads = bmt.full_grad_dict(model)
    grad_rel = max((grads[n] - p.grad).abs().max().item() / max(p.grad.abs().max().item(), 1e-30)
                   for n, p in ref.named_parameters())
    gaps = [token_loss_gap(model, ref, mine)]
    model.eval()  # evaluation: no use_cache=False from bmtwrap; model_inputs must pass it
    gaps.append(token_loss_gap(model, ref, mine))
    # The control, which must differ: the same rows with positions 0..seq-1 (one document a row).
    control = token_loss_gap(model, ref, mine, positions=torch.arange(mine.input_ids.shape[1]).expand_as(mine.input_ids))
    gap = torch.tensor([max(gaps), -control])
    torch.distributed.all_reduce(gap, op=torch.distributed.ReduceOp.MAX)
    return {"loss_rel": abs(bmt.sum_loss(loss).item() - ref_loss.item()) / ref_loss.item(), "grad_rel": grad_rel,
            "token_loss_gap": gap[0].item(), "control_gap": -gap[1].item(), "documents": batch.documents,
            "compiled_blocks": _compiled_blocks(model)}


def _compiled_blocks(model: torch.nn.Module) -> int:
    """How many blocks ran their training forward compiled (not fallen back to eager mode)."""
    bodies = [getattr(m.forward, "compiled_body", None) for m in model.modules() if hasattr(m.forward, "block_runner")]
    return sum(1 for body in bodies if body is not None and not body.is_eager())


CASES = {
    "llama": functools.partial(packed_vs_alone, "llama", checkpoint=False),
    "llama_checkpointed": functools.partial(packed_vs_alone, "llama", checkpoint=True),
    "qwen2_checkpointed": functools.partial(packed_vs_alone, "qwen2", checkpoint=True),
    "gpt2_checkpointed": functools.partial(packed_vs_alone, "gpt2", checkpoint=True),
    # Blocks traced by dynamo (the eager backend: no code generation on two CPU cores), checkpointed.
    "llama_compiled": functools.partial(packed_vs_alone, "llama", checkpoint=True, compile={"backend": "eager"}),
}

if __name__ == "__main__":
    run(CASES)
