"""Fine-tuning on many short examples: non-padding tokens per second, packed against unpacked.

    python benchmarks/packing.py --size 1b --seq 4096 --rows 2            # one GPU
    python benchmarks/packing.py --size tiny --seq 256 --rows 2 --steps 2  # a smoke check on the CPU

Example lengths are drawn from a log-normal distribution (median ``--median`` tokens, shape
``--sigma``), clipped to 1..``--seq``; token ids are random, labels = inputs. The model is HF
``LlamaForCausalLM`` of ``--size`` (shapes of train_llama.py; ``tiny``: hidden 32, 2 layers),
``attn_implementation="sdpa"``, wrapped by ``bmt.wrap``, bf16 on a GPU and fp32 on the CPU
(``--dtype``), trained with AdamW. Both runs train on the same stream of examples, each for ``--steps`` steps after
``--warmup``:

- packed: ``bmtwrap.data.Packer`` rows of ``--seq`` tokens, ``--rows`` a batch;
- unpacked: one example a row, padded to its batch's longest with an attention mask, as many a
  batch as fit the packed batch's ``rows x seq`` tokens (the same memory a step).

Before training, the per-token losses of the first packed batches (16 documents at least) are
compared with those of each document alone, unpacked: the run fails if they differ beyond rounding
(fp32: 1e-4 mean; bf16: 2e-2 mean, as packed and alone run different attention kernels). The
control beside it, the same rows with positions 0..seq-1 (documents seeing each other), shows how
far cross-talk moves them; ``--dtype fp32`` checks exactly on a GPU too. Prints ``RESULT {json}``:
non-padding tokens/s of both, their ratio, the padding shares. Blocks run eagerly by default
(``--compile false``): the unpacked batches change shape every step, which would recompile.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any, Dict, Iterator, List, Tuple

import torch
import transformers
from train_llama import SIZES

import bmtwrap as bmt
from bmtwrap.data import PackedBatch, Packer

SHAPES = {**SIZES, "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)}


def lognormal_examples(count: int, *, median: float, sigma: float, seq: int, vocab: int,
                       seed: int) -> List[Dict[str, List[int]]]:
    """``count`` examples of random tokens whose lengths are log-normal (``median``, ``sigma``), within 1..``seq``."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.empty(count).log_normal_(math.log(median), sigma, generator=generator).round().clamp(1, seq)
    out = []
    for n in lengths.long().tolist():
        ids = torch.randint(0, vocab, (n,), generator=generator).tolist()
        out.append({"input_ids": ids, "labels": ids})
    return out


def unpacked_batches(examples: List[Dict[str, List[int]]], budget: int) -> Iterator[Dict[str, torch.Tensor]]:
    """One example a row padded to the batch's longest (attention mask 0 there, labels -100), in order, as
    many a batch as fit ``budget`` padded tokens: the grouping ``Packer.padding_share().unpacked`` counts."""
    start = 0
    while start < len(examples):
        end, longest = start, 0
        while end < len(examples) and (end - start + 1) * max(longest, len(examples[end]["input_ids"])) <= budget:
            longest = max(longest, len(examples[end]["input_ids"]))
            end += 1
        end = max(end, start + 1)
        group = examples[start:end]
        longest = max(len(e["input_ids"]) for e in group)
        ids = torch.zeros(len(group), longest, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        mask = torch.zeros_like(ids)
        for r, e in enumerate(group):
            n = len(e["input_ids"])
            ids[r, :n], labels[r, :n], mask[r, :n] = torch.tensor(e["input_ids"]), torch.tensor(e["labels"]), 1
        yield {"input_ids": ids, "labels": labels, "attention_mask": mask}
        start = end


def token_losses(model: torch.nn.Module, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, T-1) fp32 loss of each token predicting the next label; 0 where that label is -100."""
    with torch.no_grad():
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2).float(), inputs["labels"][:, 1:],
                                             ignore_index=-100, reduction="none")


def check_losses(model: torch.nn.Module, batches: List[PackedBatch], examples: List[Dict[str, List[int]]],
                 device: torch.device) -> Dict[str, float]:
    """The largest and mean gap between a token's loss packed and alone, over the documents of the first
    packed batches (16 documents at least, where there are); and the control: the same rows with positions
    0..seq-1 (documents seeing each other)."""
    model.eval()
    gaps: List[torch.Tensor] = []
    control_gaps: List[torch.Tensor] = []
    for batch in batches:
        _compare(model, batch, {tuple(e["input_ids"]): e for e in examples}, device, gaps, control_gaps)
        if len(gaps) >= 16:
            break
    model.train()
    gap, control_gap = torch.cat(gaps), torch.cat(control_gaps)
    return dict(loss_gap_max=gap.max().item(), loss_gap_mean=gap.mean().item(),
                control_gap_mean=control_gap.mean().item(), checked_documents=len(gaps))


def _compare(model: torch.nn.Module, packer_batch: PackedBatch, by_tokens: Dict[Tuple[int, ...], Dict[str, List[int]]],
             device: torch.device, gaps: List[torch.Tensor], control_gaps: List[torch.Tensor]) -> None:
    """Append each document's token-loss gaps, packed and with the control's positions, against it alone."""
    inputs = packer_batch.model_inputs(model, device)
    packed = token_losses(model, inputs).cpu()
    control = token_losses(model, {**inputs, "position_ids": torch.arange(inputs["input_ids"].shape[1],
                                                                          device=device)[None]}).cpu()
    for r, positions in enumerate(packer_batch.position_ids.tolist()):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        for s, e in zip(starts, starts[1:]):
            example = by_tokens.get(tuple(packer_batch.input_ids[r, s:e].tolist()))
            if example is None or e - s < 2:  # the padding, or nothing to predict
                continue
            alone = next(unpacked_batches([example], budget=e - s))
            expected = token_losses(model, {k: v.to(device) for k, v in alone.items()})[0].cpu()
            gaps.append((packed[r, s : e - 1] - expected).abs())
            control_gaps.append((control[r, s : e - 1] - expected).abs())


def timed(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          batches: Iterator[Tuple[Dict[str, Any], int]], steps: int, warmup: int,
          device: torch.device) -> Dict[str, float]:
    """Train on ``warmup + steps`` (inputs, non-padding tokens) batches; the timed steps' tokens per second."""
    tokens, seconds = 0, 0.0
    for i in range(warmup + steps):
        inputs, count = next(batches)
        inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        _sync(device)
        start = time.perf_counter()
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if i >= warmup:
            seconds += time.perf_counter() - start
            tokens += count
    if not math.isfinite(loss.item()):
        raise SystemExit(f"the loss is {loss.item()}: training is broken, the timings mean nothing")
    return dict(tok_s=tokens / seconds, step_s=seconds / steps)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=2, help="packed rows a step")
    parser.add_argument("--median", type=float, default=300.0, help="the examples' median length in tokens")
    parser.add_argument("--sigma", type=float, default=1.0, help="the log-normal's shape (of the log of the length)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--checkpoint", default="true", choices=["true", "false", "auto"])
    parser.add_argument("--compile", default="false", choices=["true", "false", "auto"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                        help="auto: bf16 on a GPU, fp32 on the CPU; fp32 makes the loss check exact")
    args = parser.parse_args()

    ctx = bmt.init_distributed(seed=0)
    device = ctx.device
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "bf16": torch.bfloat16,
             "fp32": torch.float32}[args.dtype]
    config = transformers.LlamaConfig(max_position_embeddings=max(args.seq, 128), attn_implementation="sdpa",
                                      **SHAPES[args.size])
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    option = {"true": True, "false": False, "auto": "auto"}
    model = bmt.wrap(model, checkpoint=option[args.checkpoint], compile=option[args.compile])
    bmt.materialize(model)
    model.train()
    optimizer = (bmt.optim.AdamOptimizer(model.parameters(), lr=1e-5) if device.type == "cuda"
                 else torch.optim.AdamW(model.parameters(), lr=1e-5))

    # Enough examples for both runs' steps, a few times the packer's buffer.
    per_step = max(1, int(args.rows * args.seq / (args.median * math.exp(args.sigma ** 2 / 2))))
    count = max(4 * (args.warmup + args.steps + 1) * per_step, 256)
    examples = lognormal_examples(count, median=args.median, sigma=args.sigma, seq=args.seq,
                                  vocab=config.vocab_size, seed=ctx.rank)
    packer = Packer(seq=args.seq, rows=args.rows, seed=ctx.rank, buffer_size=min(count, 1024))
    packed = list(packer.batches(examples))
    shares = packer.padding_share()
    budget = args.rows * args.seq
    unpacked = list(unpacked_batches(examples, budget))
    cells = sum(b["input_ids"].numel() for b in unpacked)
    unpacked_share = 1 - sum(b["attention_mask"].sum().item() for b in unpacked) / cells
    assert abs(unpacked_share - shares.unpacked) < 1e-9, (unpacked_share, shares.unpacked)

    check = check_losses(model, packed, examples, device)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    if not check["loss_gap_mean"] <= tolerance:
        raise SystemExit(f"packed and unpacked per-token losses differ: {check}")

    need = args.warmup + args.steps
    if len(packed) < need or len(unpacked) < need:
        raise SystemExit(f"{len(packed)} packed and {len(unpacked)} unpacked batches, {need} needed")
    with_packing = timed(model, optimizer, ((b.model_inputs(model), b.tokens) for b in packed),
                         args.steps, args.warmup, device)
    without = timed(model, optimizer, ((b, int(b["attention_mask"].sum())) for b in unpacked),
                    args.steps, args.warmup, device)
    bmt.print_rank("RESULT " + json.dumps(dict(
        system="bmtwrap", benchmark="packing", size=args.size, world=ctx.world_size, seq=args.seq, rows=args.rows,
        median=args.median, sigma=args.sigma, device=str(device), dtype=str(dtype).replace("torch.", ""),
        packed_tok_s=round(with_packing["tok_s"], 1), unpacked_tok_s=round(without["tok_s"], 1),
        ratio=round(with_packing["tok_s"] / without["tok_s"], 3),
        packed_step_s=round(with_packing["step_s"], 4), unpacked_step_s=round(without["step_s"], 4),
        padding_share_packed=round(shares.packed, 4), padding_share_unpacked=round(shares.unpacked, 4),
        **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in check.items()},
    )), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
