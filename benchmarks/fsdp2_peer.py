"""The FSDP2 peer of ``benchmarks/train_llama.py``: torch's ``fully_shard`` training the same HF Llama shapes.

    torchrun --nproc_per_node=2 benchmarks/fsdp2_peer.py --size 8b --batch 2 --seq 4096 [--compile]

The baseline for bmtwrap's ``wrap(compile=...)`` rows: ``--compile`` compiles each decoder layer's
forward with ``torch.compile`` (regional compilation, row ``fsdp2-compile``); without it the layers run
eagerly (row ``fsdp2``).

The peers' protocol: the model is built on the meta device, ``fully_shard`` is applied to every
decoder layer and then to the root, and the shards are initialised on the device. Parameters are
gathered in bf16 (fp32 on a CPU) and gradients reduced in fp32; the fp32 shards are updated by torch's
AdamW (fused on a GPU). Full activation checkpointing through transformers (``--no-checkpoint`` turns it
off). Random token ids, labels = inputs; the median step time of ``--steps`` steps after ``--warmup``,
and the first step's time apart (compilation included). Model FLOPs per token as train_llama counts
them, against its peak. Prints one line, ``RESULT {json}``, with train_llama's fields.

``--keep N`` leaves the first N layers' activations in memory (no checkpointing), the rest checkpointed:
the most a card holds is FSDP2 at its best. ``--fp8 tensorwise|rowwise`` is the float8 peer, configured as
torchtitan configures torchao's float8 training: every decoder layer's linear whose sizes are multiples
of 16 in float8 (the output projection stays bf16), each layer compiled (``--fp8`` implies ``--compile``);
tensorwise with float8 all-gathers (each weight shard cast before the gather), its scales computed for
all layers at once after each optimizer step (``precompute_float8_dynamic_scale_for_fsdp``) and the
float8 weight recomputed in backward under checkpointing; rowwise with bf16 gathers.

A ``tiny`` size runs on CPUs (gloo) for a smoke test; there ``--compile-backend aot_eager`` skips
inductor's C++ compiler.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import statistics
import time
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from bmtwrap.wrap.attention import attention_order, preferred_backends
from train_llama import PEAK_FLOPS, add_shape_arguments, flops_per_token, shape
from train_llama import SIZES as TRAIN_SIZES

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True),
    **TRAIN_SIZES,
}


class Timing(NamedTuple):
    first_s: float  # the first step, compilation included
    median_s: float  # the median of the timed steps
    loss: float  # the last step's


def build(args: argparse.Namespace) -> Tuple[transformers.LlamaConfig, transformers.LlamaForCausalLM]:
    config = transformers.LlamaConfig(max_position_embeddings=max(args.seq, 128), attn_implementation="sdpa",
                                      **shape(args, SIZES))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return config, model


def checkpointed(layer: torch.nn.Module, run: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``run`` (the layer's compiled forward) under the checkpoint function transformers gave the layer."""

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        if layer.gradient_checkpointing and layer.training:
            return layer._gradient_checkpointing_func(functools.partial(run, **kwargs), *args)
        return run(*args, **kwargs)

    return forward


def compile_layers(model: transformers.LlamaForCausalLM, backend: str) -> None:
    """Compile each decoder layer's forward alone: FSDP2's gathers run in the module's hooks, outside the compiled
    code, and activation checkpointing wraps the compiled call. Call it before ``fully_shard``.

    Where transformers checkpoints a layer in ``GradientCheckpointingLayer.__call__`` (up to 5.22), that call
    runs the module's hooks and then the instance's ``forward``: compiling the bound forward is enough. From
    5.23 the checkpoint happens inside the class's ``forward``, a wrapper around the plain forward
    (``__wrapped__``); compiling the bound ``layer.forward`` would put the checkpoint inside the compiled code,
    and once ``fully_shard`` has swapped in its subclass (which transformers wraps again) the wrapper no longer
    counts itself outermost and does not checkpoint at all. So there the plain forward is compiled, and the
    checkpoint transformers configured is applied around it here.
    """
    for layer in model.model.layers:
        plain = getattr(type(layer).forward, "__wrapped__", None)
        if plain is None:
            layer.forward = torch.compile(layer.forward, backend=backend)
        else:
            layer.forward = checkpointed(layer, torch.compile(plain.__get__(layer), backend=backend))


def hybrid_mesh(shard_size: Optional[int], device_type: str) -> Optional[Any]:
    """FSDP2's HSDP: a (replicate, shard) device mesh of ``shard_size`` ranks per shard group; ``None`` (sharding
    over every rank) when ``shard_size`` is ``None`` or the world size."""
    world = dist.get_world_size()
    if shard_size is None or shard_size == world:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


def shard(model: transformers.LlamaForCausalLM, param_dtype: torch.dtype, mesh: Optional[Any] = None) -> None:
    """``fully_shard`` each decoder layer, then the root (the embedding, the final norm and the head); with a 2-D
    ``mesh``, hybrid (HSDP)."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy, mesh=mesh)
    fully_shard(model, mp_policy=policy, mesh=mesh)


def materialise(model: transformers.LlamaForCausalLM, device: torch.device) -> None:
    """Allocate the meta-built shards on ``device`` and initialise them as ``from_config`` would, buffers too."""
    model.to_empty(device=device)
    with torch.no_grad():
        # The method's name differs across transformers 5.x.
        (getattr(model, "initialize_weights", None) or model.init_weights)()
    model.tie_weights()


def to_float8(model: transformers.LlamaForCausalLM, recipe: str, checkpoint: bool) -> Callable[[], None]:
    """Convert the decoder layers' linears to torchao's float8 training, as torchtitan does; what to run after each
    optimizer step (tensorwise: compute every float8 weight's scale at once)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, force_recompute_fp8_weight_in_bwd=checkpoint)
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model.model.layers, config=config,
                               module_filter_fn=lambda m, fqn: m.in_features % 16 == 0 and m.out_features % 16 == 0)
    if recipe == "tensorwise":
        return lambda: precompute_float8_dynamic_scale_for_fsdp(model)
    return lambda: None


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, *, warmup: int,
          steps: int, after_step: Callable[[], None] = lambda: None) -> Timing:
    cuda = ids.is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times: List[float] = []
    for _ in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        after_step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return Timing(first_s=times[0], median_s=statistics.median(times[warmup:]), loss=loss.item())


def main() -> None:
    parser = argparse.ArgumentParser()
    add_shape_arguments(parser, SIZES)
    parser.add_argument("--no-checkpoint", action="store_true", help="keep every layer's activations")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer's forward")
    parser.add_argument("--keep", type=int, default=0, metavar="N",
                        help="the first N layers keep their activations (not checkpointed)")
    parser.add_argument("--fp8", default="off", choices=["off", "tensorwise", "rowwise"],
                        help="torchao float8 training of the decoder layers, as torchtitan sets it (implies --compile)")
    parser.add_argument("--shard-size", type=int, default=None,
                        help="HSDP: shard in groups of this many ranks, replicate across them")
    parser.add_argument("--attention", default="torch", choices=["torch", "cudnn"],
                        help="the attention kernel: torch's own order (flash first), or cuDNN's first as bmtwrap's "
                             "blocks run on compute capability 9.0 (bmtwrap.wrap.attention)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile's backend (aot_eager: no C++ compiler, for a CPU smoke test)")
    args = parser.parse_args()
    if args.steps < 1:
        raise SystemExit(f"--steps {args.steps}: at least one step must be timed")

    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    config, model = build(args)
    per_token = flops_per_token(config, model, args.seq)
    params = sum(p.numel() for p in model.parameters())
    checkpoint = not args.no_checkpoint
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for layer in model.model.layers[:args.keep]:
            layer.gradient_checkpointing = False
    after_step = lambda: None  # noqa: E731
    if args.fp8 != "off":
        after_step = to_float8(model, args.fp8, checkpoint and args.keep < config.num_hidden_layers)
        args.compile = True
    if args.compile:
        compile_layers(model, args.compile_backend)
    shard(model, torch.bfloat16 if cuda else torch.float32, hybrid_mesh(args.shard_size, device.type))
    materialise(model, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)

    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(rank)).to(device)
    order = preferred_backends(args.attention, device)
    with contextlib.nullcontext() if order is None else attention_order(order):
        timing = train(model, optimizer, ids, warmup=args.warmup, steps=args.steps, after_step=after_step)
    if not math.isfinite(timing.loss):
        raise SystemExit(f"the loss is {timing.loss} after {args.warmup + args.steps} steps: training is broken, "
                         "the timings mean nothing")
    tokens = args.batch * args.seq
    if rank == 0:
        print("RESULT " + json.dumps(dict(
            system=(f"fsdp2-fp8-{args.fp8}" if args.fp8 != "off" else "fsdp2-compile" if args.compile else "fsdp2"),
            size=args.size, layers=config.num_hidden_layers, world=world, keep=args.keep,
            shard_size=args.shard_size or world, batch=args.batch, attention=args.attention,
            seq=args.seq, params=params, activation_checkpointing=checkpoint, step_s=round(timing.median_s, 4),
            tok_s_gpu=round(tokens / timing.median_s, 1),
            mfu=round(per_token * tokens / timing.median_s / PEAK_FLOPS, 4) if cuda else None,
            peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            first_step_s=round(timing.first_s, 4), loss=round(timing.loss, 4),
        )), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
