"""Does ``wrap(fp8=...)`` train as well as bf16? A 1B Llama on real text, the same batches in both runs.

    torchrun --nproc_per_node=1 benchmarks/fp8_convergence.py --fp8 off --out bf16.json
    torchrun --nproc_per_node=1 benchmarks/fp8_convergence.py --fp8 tensorwise --out fp8.json
    python benchmarks/fp8_convergence.py --plot bf16.json fp8.json --png benchmarks/fp8_convergence.png

The corpus is built here, from text every Python installation carries: the standard library's source
files (code, docstrings and comments), read in sorted order as UTF-8 bytes, one byte a token (a
vocabulary of 256). The last 5 % of the files are held out. Each step draws ``--batch`` windows of
``--seq`` bytes at random offsets from the training files, with one generator seeded alike in
every run, so runs that differ only in ``--fp8`` see the same tokens in the same order. The model is
train_llama's ``1b`` shape with the byte vocabulary (0.97 B parameters), trained with bmtwrap's defaults
(``checkpoint="auto"``, compiled blocks), AdamW at ``--lr`` with a linear warmup and a cosine decay to a
tenth, the global gradient norm clipped to 1.

Writes ``--out``: every step's training loss, the held-out loss every ``--eval-every`` steps (the same 16
windows each time), tokens per second, and what wrap chose. ``--plot`` draws two or more such files into
one PNG (matplotlib) and prints the final losses and their gap.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

VOCAB = 256
HELD_OUT = 0.05


def corpus(root: Path) -> Tuple[torch.Tensor, torch.Tensor]:
    """Training and held-out bytes of the ``.py`` files under ``root`` (sorted; the last 5 % held out)."""
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    if len(files) < 20:
        raise SystemExit(f"--corpus {root}: {len(files)} .py files; give a folder with more text")
    cut = int(len(files) * (1 - HELD_OUT))

    def read(paths: List[Path]) -> torch.Tensor:
        raw = b"\n".join(p.read_bytes() for p in paths)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()

    return read(files[:cut]), read(files[cut:])


def windows(data: torch.Tensor, count: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - seq, (count,), generator=generator)
    return torch.stack([data[s : s + seq] for s in starts.tolist()])


def learning_rate(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(args: argparse.Namespace) -> None:
    import transformers

    import bmtwrap as bmt
    from bmtwrap.wrap.convert import wrapped_record
    from train_llama import SIZES, compiled_blocks

    ctx = bmt.init_distributed(seed=0)
    train_bytes, held_bytes = corpus(args.corpus)
    bmt.print_rank(f"corpus: {train_bytes.numel() / 1e6:.1f} M training bytes, {held_bytes.numel() / 1e6:.2f} M "
                   f"held out, from {args.corpus}", flush=True)
    config = transformers.LlamaConfig(**{**SIZES[args.size], "vocab_size": VOCAB},
                                      max_position_embeddings=max(args.seq, 128), attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model = bmt.materialize(bmt.wrap(model, fp8=False if args.fp8 == "off" else args.fp8))
    optimizer = bmt.optim.auto_adam(model.parameters(), lr=args.lr, weight_decay=0.1)
    manager = bmt.optim.OptimManager()
    manager.add_optimizer(optimizer)
    draw = torch.Generator().manual_seed(1234)
    held = windows(held_bytes, 16, args.seq, torch.Generator().manual_seed(99)).to(ctx.device)

    def held_out_loss() -> float:
        model.eval()
        with torch.no_grad():
            losses = [model(input_ids=held[i : i + 4], labels=held[i : i + 4]).loss for i in range(0, held.shape[0], 4)]
        model.train()
        return torch.stack(losses).mean().item()  # the same windows on every rank

    log: Dict[str, Any] = dict(fp8=args.fp8, size=args.size, world=ctx.world_size, batch=args.batch, seq=args.seq,
                               lr=args.lr, steps=args.steps, train_loss=[], held_out=[], step_s=[])
    model.train()
    for step in range(args.steps):
        rows = windows(train_bytes, args.batch * ctx.world_size, args.seq, draw)
        mine = rows[ctx.rank * args.batch : (ctx.rank + 1) * args.batch].to(ctx.device)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=mine, labels=mine).loss  # transformers shifts the labels itself
        loss.backward()
        manager.clip_grad_norm(optimizer.param_groups, 1.0)
        manager.step()
        manager.zero_grad()
        torch.cuda.synchronize()
        log["step_s"].append(time.perf_counter() - start)
        log["train_loss"].append(bmt.sum_loss(loss.detach()).item())  # the mean over ranks
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            log["held_out"].append([step + 1, held_out_loss()])
            bmt.print_rank(f"step {step + 1}: loss {log['train_loss'][-1]:.4f}, held-out {log['held_out'][-1][1]:.4f}",
                           flush=True)
    record = wrapped_record(model)
    median = statistics.median(log["step_s"][10:])
    log.update(tok_s_gpu=round(args.batch * args.seq / median, 1), compiled=compiled_blocks(model),
               fp8_plan=record.plan.fp8, kept_blocks=record.auto.report.get("kept_blocks") if record.auto else None,
               device=torch.cuda.get_device_name(ctx.device), peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
    if ctx.rank == 0:
        args.out.write_text(json.dumps(log) + "\n")
        print("RESULT " + json.dumps({k: v for k, v in log.items() if k not in ("train_loss", "step_s")}), flush=True)


def smooth(values: List[float], width: int = 25) -> List[float]:
    return [statistics.fmean(values[max(0, i - width + 1) : i + 1]) for i in range(len(values))]


def plot(paths: List[Path], png: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot draws with matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(p.read_text()) for p in paths]
    fig, ax = plt.subplots(figsize=(8, 5))
    for run in runs:
        label = "bf16" if run["fp8"] == "off" else f"float8 ({run['fp8']})"
        ax.plot(range(1, len(run["train_loss"]) + 1), smooth(run["train_loss"]), label=f"{label}, training (mean of 25)")
        steps, losses = zip(*run["held_out"])
        ax.plot(steps, losses, "o--", label=f"{label}, held out")
    first = runs[0]
    ax.set(xlabel="step", ylabel="loss (nats per byte)", ylim=(0, None),
           title=f"{first['size']} Llama, {first['world']} x {first['batch']} x {first['seq']} bytes per step, "
                 f"{first.get('device', '')}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    base = runs[0]
    for run in runs:
        tail = statistics.fmean(run["train_loss"][-50:])
        gap = tail / statistics.fmean(base["train_loss"][-50:]) - 1
        held = run["held_out"][-1][1]
        print(f"{run['fp8']:>12}: training loss (last 50 steps) {tail:.4f} ({gap:+.2%} against {base['fp8']}), "
              f"held-out {held:.4f} ({held / base['held_out'][-1][1] - 1:+.2%}), {run['tok_s_gpu']:,.0f} tokens/s/GPU")
    print(f"wrote {png}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fp8", default="off", choices=["off", "tensorwise", "rowwise", "rowwise_with_gw_hp"])
    parser.add_argument("--size", default="1b")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--corpus", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                        help="a folder whose .py files are the text (default: the standard library's)")
    parser.add_argument("--out", type=Path, default=Path("fp8_convergence.json"))
    parser.add_argument("--plot", type=Path, nargs="+", default=None, metavar="JSON")
    parser.add_argument("--png", type=Path, default=Path("fp8_convergence.png"))
    args = parser.parse_args()
    if args.plot:
        plot(args.plot, args.png)
    else:
        train(args)


if __name__ == "__main__":
    sys.exit(main())
