"""Command line: ``python -m bmtwrap plan <HF model folder | config.json> [options]``.

Builds the model on the meta device (no weights are allocated or read) and prints the plan
:func:`bmtwrap.wrap` would follow, with a per-rank memory estimate on the GPU and the host.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, List, Optional

import torch

DESCRIPTION = """\
Print what bmtwrap.wrap would do to a Hugging Face model: the blocks it makes (each repeated layer
sharded, gathered and checkpointed on its own), what stays in the root group, and the memory of
each rank on the GPU and on the host. The model is built on the meta device: no weight is read or
allocated, so any size plans on any machine.

The parameter, gradient and optimizer figures are exact for Adam(W); the gathered copies and the
activations are an estimate of a transformer's peak (give --batch-size and --seq-len)."""

EXAMPLES = """\
examples:
  python -m bmtwrap plan ./Llama-3.2-1B --world-size 8 --batch-size 2 --seq-len 4096
  python -m bmtwrap plan config.json --world-size 1 --offload --batch-size 4 --seq-len 2048
  python -m bmtwrap plan ./Llama-3-8B --offload --offload-params --checkpoint true"""


def _load_config(path: str) -> Any:
    from transformers import AutoConfig

    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise SystemExit(f"{path} has no config.json; give a Hugging Face model folder or a config.json file")
        return AutoConfig.from_pretrained(path)
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: no such file or folder")
    with open(path) as f:
        values = json.load(f)
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise SystemExit(f"{path} has no 'model_type'; is it a Hugging Face config.json?")
    return AutoConfig.for_model(model_type, **values)


def _dtype(name: str, config: Any) -> torch.dtype:
    """``auto``: the config's dtype (what from_pretrained builds), else fp32."""
    if name != "auto":
        return getattr(torch, name)
    configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(configured, str):
        configured = getattr(torch, configured, None)
    return configured if isinstance(configured, torch.dtype) else torch.float32


def _build_on_meta(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    for auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModel"):
        try:
            with torch.device("meta"):
                return getattr(transformers, auto).from_config(config, dtype=dtype)
        except ValueError:
            continue
    raise SystemExit(f"transformers has no model class for config type {type(config).__name__}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bmtwrap", description="bmtwrap's command line.")
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="print what bmtwrap.wrap would do to a Hugging Face model",
                               description=DESCRIPTION, epilog=EXAMPLES,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("model", help="a Hugging Face model folder (with config.json) or a config.json file")
    plan.add_argument("--world-size", type=int, default=1, help="ranks (GPUs) to shard over (default 1)")
    plan.add_argument("--ranks-per-host", type=int, default=None,
                      help="ranks sharing one host's memory, for the per-host figure (default: world size, at most 8)")
    plan.add_argument("--batch-size", type=int, help="sequences per rank, for the activation estimate")
    plan.add_argument("--seq-len", type=int, help="tokens per sequence, for the activation estimate")
    plan.add_argument("--checkpoint", default="auto", choices=["true", "false", "auto"],
                      help="activation checkpointing of the blocks, as wrap(checkpoint=...) (default auto, "
                           "planned as true, since wrap decides in the first step)")
    plan.add_argument("--no-checkpoint", action="store_true", help="the same as --checkpoint false")
    plan.add_argument("--offload", action="store_true",
                      help="plan for AdamOffloadOptimizer: optimizer state in host memory")
    plan.add_argument("--offload-fraction", type=float, default=1.0,
                      help="with --offload: the share of the optimizer state on the host (default 1.0)")
    plan.add_argument("--offload-params", action="store_true",
                      help="as wrap(offload_params=True): block parameters and gradients in host memory")
    plan.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                      help="parameter dtype (default auto: the config's, else float32)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    args = _parser().parse_args(argv)
    if args.world_size < 1:
        raise SystemExit(f"--world-size must be >= 1, got {args.world_size}")
    if (args.batch_size is None) != (args.seq_len is None):
        raise SystemExit("give --batch-size and --seq-len together (the activation estimate needs both)")
    if args.offload_fraction != 1.0 and not args.offload:
        raise SystemExit("--offload-fraction applies to --offload; add --offload")

    from .wrap import plan as make_plan

    config = _load_config(args.model)
    model = _build_on_meta(config, _dtype(args.dtype, config))
    checkpoint = {"true": True, "false": False, "auto": "auto"}["false" if args.no_checkpoint else args.checkpoint]
    print(make_plan(model, world_size=args.world_size, checkpoint=checkpoint, batch_size=args.batch_size,
                    seq_len=args.seq_len, offload_optimizer=args.offload, offload_fraction=args.offload_fraction,
                    offload_params=args.offload_params, ranks_per_host=args.ranks_per_host))
    return 0


if __name__ == "__main__":
    sys.exit(main())
