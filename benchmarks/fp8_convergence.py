"""Does ``wrap(fp8=...)`` train as well as bf16? A 1B Llama on real text, the same batches in both runs.

    for seed in 0 1 2; do
      torchrun --nproc_per_node=1 benchmarks/fp8_convergence.py --fp8 off --seed $seed --out bf16_$seed.json
      torchrun --nproc_per_node=1 benchmarks/fp8_convergence.py --fp8 tensorwise --seed $seed --out ends_$seed.json
      torchrun --nproc_per_node=1 benchmarks/fp8_convergence.py --fp8 tensorwise --keep-ends 0 --seed $seed \
          --out every_$seed.json
    done
    python benchmarks/fp8_convergence.py --plot bf16_*.json ends_*.json every_*.json --png benchmarks/fp8_convergence.png

(``--fp8 tensorwise`` alone keeps wrap's default: the first and last 2 blocks in bf16; ``--keep-ends 0`` puts
every block in float8.)

The corpus is built here, from text every Python installation carries: the standard library's source
files (code, docstrings and comments), read in sorted order as UTF-8 bytes, one byte a token (a
vocabulary of 256). The last 5 % of the files are held out. Each step draws ``--batch`` windows of
``--seq`` bytes at random offsets from the training files, with one generator seeded alike in
every run, so runs that differ only in ``--fp8`` see the same tokens in the same order (``--seed`` sets the
initial weights alone). The model is
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
import re
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

    ctx = bmt.init_distributed(seed=args.seed)
    train_bytes, held_bytes = corpus(args.corpus)
    bmt.print_rank(f"corpus: {train_bytes.numel() / 1e6:.1f} M training bytes, {held_bytes.numel() / 1e6:.2f} M "
                   f"held out, from {args.corpus}", flush=True)
    config = transformers.LlamaConfig(**{**SIZES[args.size], "vocab_size": VOCAB},
                                      max_position_embeddings=max(args.seq, 128), attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    fp8 = False if args.fp8 == "off" else bmt.Float8(args.fp8, keep_ends=args.keep_ends)
    model = bmt.materialize(bmt.wrap(model, fp8=fp8))
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

    log: Dict[str, Any] = dict(fp8=args.fp8, keep_ends=args.keep_ends, seed=args.seed, size=args.size,
                               world=ctx.world_size, batch=args.batch, seq=args.seq,
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


def label(run: Dict[str, Any]) -> str:
    """The compute a run used: bf16, or the float8 recipe and the blocks it left in bf16 (from wrap's plan line)."""
    if run["fp8"] == "off":
        return "bf16"
    ends = re.search(r"first and last (\d+ blocks|block)", run.get("fp8_plan") or "")
    return f"float8 {run['fp8']}, " + (f"the first and last {ends.group(1)} in bf16" if ends else "every block")


def plot(paths: List[Path], png: Path) -> None:
    """Runs of the same compute (seeds) drawn as their mean, shaded from the lowest to the highest; the first
    compute named is the baseline of the printed gaps (each seed against the baseline's run of that seed)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot draws with matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: Dict[str, List[Dict[str, Any]]] = {}
    for p in paths:
        run = json.loads(p.read_text())
        groups.setdefault(label(run), []).append(run)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, runs in groups.items():
        curves = list(zip(*(smooth(run["train_loss"]) for run in runs)))
        steps = range(1, len(curves) + 1)
        line, = ax.plot(steps, [statistics.fmean(c) for c in curves],
                        label=f"{name}: training ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
        if len(runs) > 1:
            ax.fill_between(steps, [min(c) for c in curves], [max(c) for c in curves], color=line.get_color(),
                            alpha=0.2)
        held = list(zip(*(run["held_out"] for run in runs)))
        ax.plot([h[0][0] for h in held], [statistics.fmean(x[1] for x in h) for h in held], "o--",
                color=line.get_color(), label=f"{name}: held out")
    first = next(iter(groups.values()))[0]
    ax.set(xlabel="step", ylabel="loss (nats per byte)", xlim=(100, None), ylim=(0.65, 1.6),
           title=f"{first['size']} Llama, {first['world']} x {first['batch']} x {first['seq']} bytes per step, "
                 f"{first.get('device', '')}\nmeans over seeds (training smoothed over 25 steps; "
                 "shaded: lowest to highest)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    base_name, base_runs = next(iter(groups.items()))
    tail = {name: {run.get("seed", 0): statistics.fmean(run["train_loss"][-50:]) for run in runs}
            for name, runs in groups.items()}
    held = {name: {run.get("seed", 0): run["held_out"][-1][1] for run in runs} for name, runs in groups.items()}
    for name in groups:
        gaps = [tail[name][s] / tail[base_name][s] - 1 for s in tail[name] if s in tail[base_name]]
        mean_tail, mean_held = statistics.fmean(tail[name].values()), statistics.fmean(held[name].values())
        print(f"{name}: training loss (last 50 steps) {mean_tail:.4f} "
              f"({mean_tail / statistics.fmean(tail[base_name].values()) - 1:+.2%} against {base_name}; by seed "
              f"{', '.join(f'{g:+.1%}' for g in gaps)}), held-out {mean_held:.4f} "
              f"({mean_held / statistics.fmean(held[base_name].values()) - 1:+.2%}), seeds {sorted(tail[name])}, "
              f"{statistics.fmean(run['tok_s_gpu'] for run in groups[name]):,.0f} tokens/s/GPU")
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
    parser.add_argument("--keep-ends", type=int, default=None, metavar="N",
                        help="bmtwrap.Float8(keep_ends=N): blocks at each end left in bf16 (default: wrap's, 2)")
    parser.add_argument("--seed", type=int, default=0, help="the initial weights' seed (the batches are drawn alike)")
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
