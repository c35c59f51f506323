"""Training throughput of ``bmtwrap.wrap`` on HF Llama shapes (1b / 3b / 8b), one process per GPU.

    torchrun --nproc_per_node=2 benchmarks/train_llama.py --size 8b --batch 2 --seq 4096

The protocol of the peer baselines: the model is built on the meta device, wrapped, initialised
on the GPU (``bmtwrap.materialize``); random token ids, labels = inputs; median step time of
``--steps`` steps after ``--warmup``; model FLOPs per token = 6 x dense parameters +
12 x layers x hidden x seq (recompute not counted) against 989 TFLOP/s. Prints one line,
``RESULT {json}``, with the peers' fields.

Precision: parameters, gathers and reductions in bf16. The optimizer (``--optimizer``):
``adam`` (default) is bmtwrap's fused Adam with an fp32 master copy and fp32 moments, the same
precision as the FSDP2 baseline's fp32 parameters; ``offload`` keeps them in CPU memory and updates
them there after backward; ``offload-in-backward`` starts each block's CPU update during backward;
``torch`` is torch's fused AdamW on the bf16 shards themselves (what a plain torch.optim user gets).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import resource
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import transformers

import bmtwrap as bmt
from bmtwrap.optim import gpu_updates
from bmtwrap.wrap import attention
from bmtwrap.engine.collectives import traffic
from bmtwrap.engine.memory import CudaGauge
from bmtwrap.wrap.convert import wrapped_record

SIZES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    # The 13b layers, 32 of them: 10.1 B parameters.
    "10b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=32, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    # Llama-2-13B's layers with Llama 3's grouped-query attention and vocabulary: 12.3 B parameters.
    "13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    # Llama-3-70B's shapes (80 layers, 70.6 B parameters); with --layers N, a slice of it at its width.
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}
PEAK_FLOPS = 989e12  # bf16 dense, H100 / H200 SXM


def flops_per_token(config: transformers.LlamaConfig, model: torch.nn.Module, seq: int) -> float:
    params = sum(p.numel() for p in model.parameters())
    lookup = 0 if config.tie_word_embeddings else model.model.embed_tokens.weight.numel()
    return 6 * (params - lookup) + 12 * config.num_hidden_layers * config.hidden_size * seq


def host_huge_pages_gib() -> float:
    """This process's memory on transparent huge pages (Linux; 0.0 elsewhere)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            kib = next((int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")), 0)
    except OSError:
        return 0.0
    return round(kib / 2**20, 2)


def compiled_blocks(model: torch.nn.Module) -> str:
    """How many blocks run compiled (what compile="auto" chose), as "compiled/blocks"."""
    forwards = [module.forward for module in model.modules() if hasattr(module.forward, "block_runner")]
    bodies = [getattr(f, "compiled_body", None) for f in forwards]
    compiled = sum(1 for body in bodies if body is not None and not body.is_eager())
    return f"{compiled}/{len(forwards)}"


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor,
         manager: Optional[bmt.optim.OptimManager] = None, clip: Optional[float] = None) -> torch.Tensor:
    return finish_step(model(input_ids=ids, labels=ids).loss, optimizer, manager, clip)


def finish_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer,
                manager: Optional[bmt.optim.OptimManager] = None, clip: Optional[float] = None) -> torch.Tensor:
    """The step after the forward: backward, clipping with ``manager``, the update."""
    loss.backward()
    if manager is None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss
    NORMS.append(manager.clip_grad_norm(optimizer.param_groups, clip).item())  # the global norm, before clipping
    manager.step()
    manager.zero_grad()
    return loss


NORMS: List[float] = []  # each step's gradient norm, with --clip


KERNEL_KINDS = (("attention", ("flash", "fmha", "cudnn", "attention")),
                ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "scaled_mm", "cublas")),
                ("optimizer", ("adam", "multi_tensor", "foreach")),
                ("compiled (triton)", ("triton",)))


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel, from its (lower-case) name."""
    return next((kind for kind, marks in KERNEL_KINDS if any(m in name for m in marks)), "other")


def kernel_spans(events: List[Any]) -> List[Tuple[float, float]]:
    """The time ranges (profiler microseconds) in which at least one of ``events`` ran, merged and in order."""
    merged: List[List[float]] = []
    for a, b in sorted((e.time_range.start, e.time_range.end) for e in events):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def overlap_s(ours: List[Tuple[float, float]], theirs: List[Tuple[float, float]]) -> float:
    """Seconds during which a span of ``ours`` and one of ``theirs`` both ran (each list merged)."""
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in ours for c, d in theirs) / 1e6


def profile_step(run: Callable[[], Any], trace: Optional[str] = None) -> Dict[str, Any]:
    """One step under the profiler: the share of its time some compute kernel ran on the GPU, the share
    a host-device copy ran, the longest gap with no kernel at all, and the communication: the time NCCL's
    kernels of each kind ran, and the share of it some compute kernel ran beside (hidden behind compute).
    With ``trace``, the step's timeline is also written there (Chrome's trace format, gzipped if the name ends
    in .gz)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    if trace:
        prof.export_chrome_trace(trace)
    copies, kernels, comms = [], [], {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue  # record_function's ranges show on the GPU too, spanning the kernels they launched
        name = e.name.lower()
        if "nccl" in name:  # NCCL's kernels by kind; the profiler's own ranges around them are left out
            kind = next((k for k in ("AllGather", "ReduceScatter", "AllReduce") if k.lower() in name), None)
            if kind is not None:
                comms.setdefault(kind, []).append(e)
        else:
            (copies if "memcpy" in name or "memset" in name else kernels).append(e)

    def length(spans: List[Tuple[float, float]]) -> float:
        return sum(b - a for a, b in spans) / 1e6  # microseconds -> seconds

    busy = kernel_spans(kernels)
    compute, copied = length(busy), length(kernel_spans(copies))
    gap = max((c - b for (_, b), (c, _) in zip(busy, busy[1:])), default=0.0) / 1e6

    def hidden(spans: List[Tuple[float, float]]) -> Dict[str, Any]:
        """How long ``spans`` ran, and the share of it some compute kernel ran beside."""
        total = length(spans)
        return dict(s=round(total, 4), hidden_pct=round(100 * overlap_s(spans, busy) / total, 1) if total else None)

    every = hidden(kernel_spans([e for events in comms.values() for e in events]))
    kinds: Dict[str, float] = {}
    names: Dict[str, List[float]] = {}
    for e in kernels:
        kind = kernel_kind(e.name.lower())
        took = (e.time_range.end - e.time_range.start) / 1e6
        kinds[kind] = kinds.get(kind, 0.0) + took
        names.setdefault(f"{kind}: {e.name[:90]}", []).append(took)
    top = sorted(names.items(), key=lambda kv: -sum(kv[1]))[:15]
    return dict(profiled_step_s=round(wall, 4), gpu_busy_pct=round(100 * compute / wall, 1),
                kernel_s={k: round(v, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
                top_kernels=[[name, len(times), round(sum(times), 4)] for name, times in top],
                gpu_copy_pct=round(100 * copied / wall, 1), longest_gpu_gap_s=round(gap, 4),
                comm_s=every["s"], comm_hidden_pct=every["hidden_pct"],
                comm_by_kind={kind: hidden(kernel_spans(events)) for kind, events in comms.items()})


def forward_timeline(model: torch.nn.Module, ids: torch.Tensor, run_rest: Callable[[torch.Tensor], Any],
                     kernels: bool = False) -> Dict[str, Any]:
    """Whether the GPU waits for the host in the forward, measured in one more step: a CUDA event and the host's
    clock where the forward starts, at each decoder layer's start and where the forward ends. The host's lead at
    a mark is how long after the host passed it the GPU reached it; near zero, the GPU had caught up and waited
    for the host there. With ``kernels``, the step runs under a CUDA-only profile (kernel times from the driver,
    no host-side recording) and also reports the share of the forward's GPU time some kernel ran.
    ``run_rest(loss)`` finishes the step (backward, update)."""
    from torch.profiler import ProfilerActivity, profile

    marks: List[Tuple[float, torch.cuda.Event]] = []

    def mark() -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((time.perf_counter(), event))

    def timed(forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            mark()
            return forward(*args, **kwargs)
        return run

    layers = list(model.model.layers)
    forwards = [layer.forward for layer in layers]  # wrap's, on each instance
    for layer, forward in zip(layers, forwards):
        layer.forward = timed(forward)
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) if kernels else contextlib.nullcontext() as prof:
            torch.cuda._sleep(1000)  # markers on the kernels' timeline: the forward lies between the two sleeps
            mark()
            loss = model(input_ids=ids, labels=ids).loss
            mark()
            torch.cuda._sleep(1000)
            run_rest(loss)
            torch.cuda.synchronize()
    finally:
        for layer, forward in zip(layers, forwards):
            layer.forward = forward
    host = [t - marks[0][0] for t, _ in marks]
    gpu = [marks[0][1].elapsed_time(e) / 1e3 for _, e in marks]
    leads = [round(1e3 * (g - h), 2) for g, h in zip(gpu, host)]
    out = dict(forward_gpu_s=round(gpu[-1], 4), forward_host_s=round(host[-1], 4),
               host_lead_ms_at_layers=leads[1:-1], host_lead_ms_at_end=leads[-1])
    if kernels:
        events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                        key=lambda e: e.time_range.start)
        sleeps = [i for i, e in enumerate(events) if "spin" in e.name.lower() or "sleep" in e.name.lower()]
        if len(sleeps) >= 2:
            window = (events[sleeps[0]].time_range.end, events[sleeps[1]].time_range.start)
            busy = overlap_s(kernel_spans(events[sleeps[0] + 1 : sleeps[1]]), [window])
            out.update(forward_kernels_s=round(busy, 4),
                       forward_gpu_busy_pct=round(100 * busy / max((window[1] - window[0]) / 1e6, 1e-12), 1))
    return out


def host_profile(run: Callable[[], Any], path: str) -> None:
    """One step under cProfile (the host's Python, not the GPU): the functions by their own time and by their
    time with callees, written to ``path``."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(45)
    with open(path, "w") as f:
        f.write(text.getvalue())


def add_shape_arguments(parser: argparse.ArgumentParser, sizes: Dict[str, Any]) -> None:
    """The options every throughput benchmark takes: the model, the batch and the steps timed."""
    parser.add_argument("--size", default="1b", choices=sorted(sizes))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None, metavar="N",
                        help="the size's layers, only N of them (a slice of a larger model, per-layer figures)")


def shape(args: argparse.Namespace, sizes: Dict[str, Any]) -> Dict[str, Any]:
    """The LlamaConfig arguments of ``--size``, with ``--layers``."""
    return {**sizes[args.size], **({} if args.layers is None else {"num_hidden_layers": args.layers})}


def main() -> None:
    parser = argparse.ArgumentParser()
    add_shape_arguments(parser, SIZES)
    parser.add_argument("--checkpoint", default="true", choices=["true", "false", "auto"])
    parser.add_argument("--compile", default="auto", choices=["true", "false", "auto"],
                        help="wrap(compile=...): torch.compile each block's forward")
    parser.add_argument("--compile-options", default=None, metavar="JSON",
                        help='wrap(compile={...}): torch.compile\'s options for the blocks, e.g. '
                             '\'{"options": {"combo_kernels": true}}\' (instead of --compile)')
    parser.add_argument("--keep-logits", action="store_true",
                        help="wrap(keep_logits=True): transformers' loss over the whole fp32 logits")
    parser.add_argument("--loss-peak", action="store_true",
                        help="also report the peak from the step's start until the loss's backward reaches the "
                             "final norm (the forward and the loss, both ways)")
    parser.add_argument("--max-gpu-memory", default=None, help="wrap(max_gpu_memory=...), e.g. 21GiB")
    parser.add_argument("--fp8", default="off", choices=["off", "tensorwise", "rowwise", "rowwise_with_gw_hp"],
                        help="wrap(fp8=...): the blocks' linear layers in float8 (torchao); MFU stays counted "
                             "against the bf16 peak")
    parser.add_argument("--fp8-keep-ends", type=int, default=None, metavar="N",
                        help="bmtwrap.Float8(keep_ends=N): blocks at each end left in bf16 (default: wrap's, 2)")
    parser.add_argument("--zero-level", type=int, default=3, choices=[2, 3])
    parser.add_argument("--attention", default="auto", choices=["auto", "torch", "cudnn", "flash", "efficient"],
                        help="the blocks' attention kernel (bmtwrap.wrap.attention.PREFERENCE): auto is cuDNN first on "
                             "compute capability 9.0, torch is torch's own order")
    parser.add_argument("--gpu-updates", default="side", choices=["side", "compute"],
                        help="where the optimizer updates the state kept on the GPU: on a side stream beside the next "
                             "forward (default), or on the computing stream after backward "
                             "(bmtwrap.optim.gpu_updates.BESIDE_FORWARD)")
    parser.add_argument("--tp", type=int, default=1, metavar="T",
                        help="wrap(tp_size=T): the model's tensor-parallel plan in groups of T ranks, ZeRO over the "
                             "rest; each group trains on one batch, so tokens/s/GPU counts a group's batch once")
    parser.add_argument("--shard-size", type=int, default=None,
                        help="init_distributed(shard_size=...): hybrid sharding in groups of this many ranks")
    parser.add_argument("--optimizer", default="auto",
                        choices=["auto", "adam", "offload", "offload-in-backward", "torch"],
                        help="auto: bmt.optim.auto_adam (on a GPU the offload optimizer with offload_fraction='auto' "
                             "and step_in_backward='auto': the state that fits stays on the GPU); offload: updates "
                             "after backward; offload-in-backward: step_in_backward=True; both with --offload-fraction")
    parser.add_argument("--clip", type=float, default=None, metavar="MAX_NORM",
                        help="clip the global gradient norm to MAX_NORM through bmt.optim.OptimManager, as a "
                             "fine-tune does")
    parser.add_argument("--offload-threads", type=int, default=None,
                        help="CPU threads of the offloaded update (default: the optimizer's)")
    parser.add_argument("--offload-fraction", default="1.0",
                        help="share of the parameters whose optimizer state the offload optimizers keep on the CPU, "
                             "or 'auto' (what does not fit the GPU after the first step)")
    parser.add_argument("--offload-params", nargs="?", const="true", default="auto", choices=["true", "false", "auto"],
                        help="keep parameter shards in host memory too (wrap(offload_params=...); default auto)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one more step after the timed ones and report how busy the GPU was")
    parser.add_argument("--trace", default=None, metavar="PATH",
                        help="with --profile: write the profiled step's timeline there (Chrome's format; rank 0, "
                             "gzipped when PATH ends in .gz)")
    parser.add_argument("--host", default=None, metavar="PATH",
                        help="after the timed steps, measure whether the forward waits for the host (how far the "
                             "host runs ahead of the GPU at each layer; the share of the forward the GPU ran "
                             "kernels, from a CUDA-only profile) and write a cProfile of one step to PATH (rank 0)")
    parser.add_argument("--auto-headroom", type=float, default=None,
                        help="share of the GPU that offload_fraction='auto' leaves free (default: the optimizer's)")
    args = parser.parse_args()
    attention.PREFERENCE = args.attention
    gpu_updates.BESIDE_FORWARD = args.gpu_updates == "side"
    if args.auto_headroom is not None:
        bmt.engine.placement.AUTO_HEADROOM = args.auto_headroom
    fraction = args.offload_fraction if args.offload_fraction == "auto" else float(args.offload_fraction)

    ctx = bmt.init_distributed(seed=0, zero_level=args.zero_level, shard_size=args.shard_size, tp_size=args.tp)
    config = transformers.LlamaConfig(max_position_embeddings=max(args.seq, 128), attn_implementation="sdpa",
                                      **shape(args, SIZES))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    per_token = flops_per_token(config, model, args.seq)
    params = sum(p.numel() for p in model.parameters())
    checkpoint = {"true": True, "false": False, "auto": "auto"}[args.checkpoint]
    compile_option = {"true": True, "false": False, "auto": "auto"}[args.compile]
    if args.compile_options:
        compile_option = json.loads(args.compile_options)
    fp8 = False if args.fp8 == "off" else bmt.Float8(args.fp8, keep_ends=args.fp8_keep_ends)
    # What bmtwrap.plan predicts for this run, printed beside the measured peak.
    offload_params = {"true": True, "false": False}.get(args.offload_params, "auto")
    # The plan for the card (or the budget): with --optimizer auto it shows what auto_adam will decide.
    card = args.max_gpu_memory or torch.cuda.get_device_properties(ctx.device).total_memory
    plan_optimizer = {"auto": "auto", "adam": False, "torch": False}.get(args.optimizer, True)
    planned = bmt.plan(model, world_size=ctx.world_size, checkpoint=checkpoint, batch_size=args.batch, seq_len=args.seq,
                       offload_optimizer=plan_optimizer, offload_fraction=fraction if plan_optimizer is True else 1.0,
                       step_in_backward={"offload": False, "offload-in-backward": True}.get(args.optimizer, "auto"),
                       offload_params=offload_params, max_gpu_memory=card,
                       keep_logits=args.keep_logits, compile=compile_option, fp8=fp8, tp_size=args.tp)
    bmt.print_rank(f"plan: optimizer state on the host {planned.offload.fraction:.3f}, "
                   f"{sum(not b.checkpoint for b in planned.blocks)} blocks kept, "
                   f"{planned.memory.total / 2**30:.2f} GiB", flush=True)
    planned = planned.memory
    model = bmt.wrap(model, checkpoint=checkpoint, offload_params=offload_params,
                     max_gpu_memory=args.max_gpu_memory, keep_logits=args.keep_logits, compile=compile_option,
                     fp8=fp8, tp_size=args.tp)
    bmt.materialize(model)
    model.train()
    optimizer = {
        "adam": lambda: bmt.optim.AdamOptimizer(model.parameters(), lr=1e-4),
        "offload": lambda: bmt.optim.AdamOffloadOptimizer(model.parameters(), lr=1e-4,
                                                          cpu_threads=args.offload_threads, step_in_backward=False,
                                                          offload_fraction=fraction),
        "offload-in-backward": lambda: bmt.optim.AdamOffloadOptimizer(
            model.parameters(), lr=1e-4, step_in_backward=True, cpu_threads=args.offload_threads,
            offload_fraction=fraction),
        "torch": lambda: torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True),
        "auto": lambda: bmt.optim.auto_adam(model.parameters(), lr=1e-4, cpu_threads=args.offload_threads),
    }[args.optimizer]()
    offloading = isinstance(optimizer, bmt.optim.AdamOffloadOptimizer)
    manager = None
    if args.clip is not None:
        manager = bmt.optim.OptimManager()
        manager.add_optimizer(optimizer)

    # The ranks of a tensor-parallel group share their batch.
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(ctx.rank // args.tp)).to(ctx.device)
    loss_peaks: List[float] = []
    if args.loss_peak:
        model.model.norm.register_full_backward_pre_hook(
            lambda module, grad: loss_peaks.append(torch.cuda.max_memory_allocated() / 2**30))
    torch.cuda.reset_peak_memory_stats()
    times, peaks, reserved, used, first_step_s = [], [], [], [], None
    gauge = CudaGauge(ctx.device)
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            traffic(ctx, reset=True)  # the timed steps' collectives
        if i == args.warmup and offloading:
            stats_before = optimizer.offload_stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step(model, optimizer, ids, manager, args.clip)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        if i == 0:
            first_step_s = time.perf_counter() - start  # with compile: the blocks' compilation
        peaks.append(torch.cuda.max_memory_allocated())
        reserved.append(torch.cuda.max_memory_reserved())
        used.append(gauge.reserved_peak() + gauge.outside_allocator())  # what nvidia-smi shows at most
        torch.cuda.reset_peak_memory_stats()
        # Each step as it ends, so that a run cut short still tells its pace.
        bmt.print_rank(f"step {i + 1}/{args.warmup + args.steps} {time.perf_counter() - start:.2f} s, peak "
                       f"{peaks[-1] / 2**30:.2f} GiB", flush=True)
        if i == 0 and getattr(optimizer, "auto_report", None):
            bmt.print_rank(f"offload_fraction='auto' decided: {optimizer.auto_report}, first step's peak "
                           f"{peaks[0] / 2**30:.2f} GiB", flush=True)
    cpu = {}
    if offloading:
        optimizer.wait()  # the last step's CPU updates
        stats = {k: v - stats_before[k] for k, v in optimizer.offload_stats().items()}
        cpu = dict(host_huge_gib=host_huge_pages_gib(), cpu_adam_s=round(stats["adam_s"] / args.steps, 4), cpu_stalled_s=round(stats["stalled_s"] / args.steps, 4),
                   cpu_idle_s=round(stats["idle_s"] / args.steps, 4),
                   cpu_adam_melem_s=round(stats["elements"] / max(stats["adam_s"], 1e-9) / 1e6, 1))
    moved = {op: dict(calls=calls // args.steps, gb=round(sent / args.steps / 1e9, 3))
             for op, (calls, sent) in traffic(ctx).items()}  # per step, each rank's share sent
    trace = args.trace if ctx.rank == 0 else None
    busy = profile_step(lambda: step(model, optimizer, ids, manager, args.clip), trace) if args.profile else {}
    if args.host:
        rest = lambda loss: finish_step(loss, optimizer, manager, args.clip)  # noqa: E731
        busy.update(forward_timeline(model, ids, rest))
        busy.update({f"profiled_{k}": v for k, v in forward_timeline(model, ids, rest, kernels=True).items()})
        if ctx.rank == 0:
            host_profile(lambda: step(model, optimizer, ids, manager, args.clip), args.host)
    if not math.isfinite(loss.item()):
        raise SystemExit(f"the loss is {loss.item()} after {args.warmup + args.steps} steps: training is broken, "
                         "the timings mean nothing")
    auto = wrapped_record(model).auto  # what checkpoint="auto" chose, for the row
    step_s = statistics.median(times)
    tokens = args.batch * args.seq / args.tp  # per GPU: a tensor-parallel group's T GPUs share one batch
    bmt.print_rank("RESULT " + json.dumps(dict(
        system="bmtwrap", size=args.size, layers=config.num_hidden_layers, world=ctx.world_size,
        shard_size=ctx.shard_size, tp=args.tp, batch=args.batch,
        seq=args.seq, params=params, traffic_per_step=moved,
        activation_checkpointing=args.checkpoint, zero_level=args.zero_level, optimizer=args.optimizer,
        optimizer_class=type(optimizer).__name__,
        compile=args.compile, compiled=compiled_blocks(model), keep_logits=args.keep_logits,
        fp8=wrapped_record(model).plan.fp8, attention=args.attention, gpu_updates=args.gpu_updates,
        attention_order=[b.name for b in attention.preferred_backends(args.attention, ctx.device) or []],
        first_step_s=round(first_step_s, 1),
        offload_threads=args.offload_threads,
        offload_fraction=round(optimizer.offload_fraction, 3) if offloading else args.offload_fraction,
        step_in_backward=("speculative" if getattr(optimizer, "speculative", False) else
                          getattr(optimizer, "step_in_backward", None)),
        speculation=getattr(optimizer, "speculation", None), clip=args.clip,
        grad_norms=[round(n, 3) for n in NORMS[-args.steps:]],
        auto_report={k: (round(v / 2**30, 2) if isinstance(v, int) and v > 2**20 else v)
                     for k, v in (getattr(optimizer, "auto_report", None) or {}).items()},
        offload_params=wrapped_record(model).plan.offload.params,
        step_s=round(step_s, 4), tok_s_gpu=round(tokens / step_s, 1),
        mfu=round(per_token * tokens / step_s / PEAK_FLOPS, 4),
        peak_gib=round(max(peaks) / 2**30, 2), reserved_gib=round(max(reserved) / 2**30, 2),
        used_gib=round(max(used) / 2**30, 2), max_gpu_memory=args.max_gpu_memory,
        auto_kept_blocks=auto.report.get("kept_blocks") if auto is not None else None,
        auto_predicted_gib=round(auto.report["predicted_peak_bytes"] / 2**30, 2) if auto and auto.report else None,
        # What checkpoint="auto" predicted for the blocks it kept: the step with all recomputed, and their activations.
        auto_predicted_kept_gib=(round((auto.report["predicted_peak_bytes"] + auto.report["kept_activation_bytes"])
                                       / 2**30, 2) if auto and auto.report else None),
        step_peaks_gib=[round(p / 2**30, 1) for p in peaks], loss_peaks_gib=[round(p, 2) for p in loss_peaks],
        loss=round(loss.item(), 4),
        plan_gib=round(planned.total / 2**30, 2), plan_host_gib=round(planned.host / 2**30, 2),
        host_peak_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2), **cpu, **busy,
    )), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
