"""Command line: ``python -m bmtwrap plan <HF model folder | config.json> [--world-size N]``.

Builds the model on the meta device (no weights are allocated or read) and prints the plan
:func:`bmtwrap.wrap` would follow, with a per-rank memory estimate.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import torch


def _load_config(path: str):
    from transformers import AutoConfig

    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise SystemExit(f"{path} has no config.json; give a Hugging Face model folder or a config.json file")
        return AutoConfig.from_pretrained(path)
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: no such file or folder")
    import json

    with open(path) as f:
        values = json.load(f)
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise SystemExit(f"{path} has no 'model_type'; is it a Hugging Face config.json?")
    return AutoConfig.for_model(model_type, **values)


def _build_on_meta(config):
    import transformers

    for auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModel"):
        try:
            with torch.device("meta"):
                return getattr(transformers, auto).from_config(config)
        except ValueError:
            continue
    raise SystemExit(f"transformers has no model class for config type {type(config).__name__}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bmtwrap", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="print what bmtwrap.wrap would do to a Hugging Face model")
    plan.add_argument("model", help="a Hugging Face model folder (with config.json) or a config.json file")
    plan.add_argument("--world-size", type=int, default=1, help="ranks to shard over (default 1)")
    plan.add_argument("--batch-size", type=int, help="sequences per rank, for the activation estimate")
    plan.add_argument("--seq-len", type=int, help="tokens per sequence, for the activation estimate")
    plan.add_argument("--no-checkpoint", action="store_true", help="plan without activation checkpointing")
    args = parser.parse_args(argv)

    from .wrap import plan as make_plan

    model = _build_on_meta(_load_config(args.model))
    print(make_plan(model, world_size=args.world_size, checkpoint=not args.no_checkpoint,
                    batch_size=args.batch_size, seq_len=args.seq_len))
    return 0


if __name__ == "__main__":
    sys.exit(main())
