"""Command line: ``python -m bmtwrap plan <HF model folder | config.json> [options]``.

Builds the model on the meta device (no weights are allocated or read) and prints the plan
:func:`bmtwrap.wrap` would follow, with a per-rank memory estimate on the GPU and the host.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, List, Optional, Tuple

import torch

from .engine.memory import parse_bytes

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
  python -m bmtwrap plan ./Llama-3-8B --max-gpu-memory H100 --batch-size 4 --seq-len 2048
  python -m bmtwrap plan config.json --world-size 1 --offload --batch-size 4 --seq-len 2048
  python -m bmtwrap plan ./Llama-3-8B --offload --offload-params --checkpoint true
  python -m bmtwrap plan ./bart-large --model-class BartForCausalLM"""


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
    # transformers 5 reads config.json's torch_dtype into dtype (and warns on reading torch_dtype).
    configured = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    if isinstance(configured, str):
        configured = getattr(torch, configured, None)
    return configured if isinstance(configured, torch.dtype) else torch.float32


# Tried in this order when the config names no class transformers has: a checkpoint folder is most
# often a language model, and AutoModel (no head) takes every config.
AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModel")


def _model_class(name: str) -> Optional[type]:
    """``transformers.<name>`` if it is a model class, else None."""
    import transformers

    try:
        cls = getattr(transformers, name)
    except (AttributeError, ImportError):  # not in transformers, or needs a backend that is not installed
        return None
    return cls if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) else None


def _takes(cls: type, config: Any) -> bool:
    expected = getattr(cls, "config_class", None)
    return not isinstance(expected, type) or isinstance(config, expected)


def _classes_for(config: Any) -> List[str]:
    """The model classes that build from ``config``, best first: the ones config.architectures names (the
    folder was saved from them), the family's causal LM, then its other heads (transformers' Auto mappings)."""
    from transformers.models.auto import modeling_auto

    saved = getattr(config, "architectures", None) or ()
    names = [n for n in saved if (cls := _model_class(n)) is not None and _takes(cls, config)]
    mappings = ["MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES"] + sorted(
        n for n in dir(modeling_auto) if n.startswith("MODEL_FOR_") and n.endswith("_MAPPING_NAMES"))
    for mapping in mappings:
        found = getattr(modeling_auto, mapping).get(getattr(config, "model_type", None), ())
        names += [n for n in ((found,) if isinstance(found, str) else found) if n not in names]
    return [n for n in names if _model_class(n) is not None]


def _suggest(config: Any) -> str:
    """What to give --model-class instead, for an error message."""
    names = _classes_for(config)
    if not names:
        return f"transformers has no model class for a {type(config).__name__}"
    others = f"; the others for a {type(config).__name__}: {', '.join(names[1:9])}{' ...' if len(names) > 9 else ''}"
    return f"give --model-class {names[0]}{others if len(names) > 1 else ''}"


def _chosen_class(config: Any, override: Optional[str]) -> Tuple[Optional[type], str]:
    """The class to build and why; None (with why) when the Auto classes must choose.

    ``config.architectures`` names the class the folder was saved from (``BartForConditionalGeneration``,
    with its encoder); an Auto class would pick its own (``BartForCausalLM``, a decoder only).
    """
    if override is not None:
        cls = _model_class(override)
        if cls is None:
            raise SystemExit(f"--model-class {override}: transformers has no model class of that name; "
                             f"{_suggest(config)}")
        if not _takes(cls, config):
            raise SystemExit(f"--model-class {override} builds from a {cls.config_class.__name__}, but the config is a "
                             f"{type(config).__name__}; {_suggest(config)}")
        return cls, "given by --model-class"
    named = list(getattr(config, "architectures", None) or ())
    if not named:
        return None, "config.architectures names no class"
    cls = _model_class(named[0])
    if cls is None:
        return None, f"config.architectures names {named[0]}, which transformers does not have"
    if not _takes(cls, config):
        return None, f"config.architectures names {named[0]}, which builds from a {cls.config_class.__name__}"
    return cls, "named by config.architectures"


def _build_on_meta(config: Any, dtype: torch.dtype, override: Optional[str]) -> Tuple[torch.nn.Module, str]:
    """The model on the meta device, and a line saying which class it is and why."""
    import transformers

    cls, why = _chosen_class(config, override)
    if cls is not None:
        with torch.device("meta"):
            # What AutoModel*.from_config calls once it has found the class.
            model = cls._from_config(config, dtype=dtype)
        return model, f"model class: {cls.__name__} ({why})"
    for auto in AUTO_CLASSES:
        try:
            with torch.device("meta"):
                model = getattr(transformers, auto).from_config(config, dtype=dtype)
        except ValueError:
            continue
        return model, (f"model class: {type(model).__name__} ({auto}'s choice: {why}; "
                       "give --model-class to build another)")
    raise SystemExit(f"transformers has no model class for config type {type(config).__name__}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bmtwrap", description="bmtwrap's command line.")
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="print what bmtwrap.wrap would do to a Hugging Face model",
                               description=DESCRIPTION, epilog=EXAMPLES,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("model", help="a Hugging Face model folder (with config.json) or a config.json file")
    plan.add_argument("--world-size", type=int, default=1, help="ranks (GPUs) in the job (default 1)")
    plan.add_argument("--shard-size", type=int, default=None,
                      help="hybrid sharding: ranks each parameter is sharded over, as init_distributed(shard_size=N); "
                           "it must divide --world-size (default: the world size)")
    plan.add_argument("--tp-size", type=int, default=1,
                      help="tensor parallelism, as wrap(tp_size=N): the layers the model's plan splits count at one "
                           "rank's slice, and parameters are sharded over --world-size / N ranks (default 1)")
    plan.add_argument("--fp8", default="off", choices=["off", "tensorwise", "rowwise", "rowwise_with_gw_hp"],
                      help="wrap(fp8=...): name the float8 recipe and count the linear layers it converts (needs torchao)")
    plan.add_argument("--ranks-per-host", type=int, default=None,
                      help="ranks sharing one host's memory, for the per-host figure (default: world size, at most 8)")
    plan.add_argument("--batch-size", type=int, help="sequences per rank, for the activation estimate")
    plan.add_argument("--seq-len", type=int, help="tokens per sequence, for the activation estimate")
    plan.add_argument("--checkpoint", default="auto", choices=["true", "false", "auto"],
                      help="activation checkpointing of the blocks, as wrap(checkpoint=...) (default auto, "
                           "planned as true, since wrap decides in the first step)")
    plan.add_argument("--no-checkpoint", action="store_true", help="the same as --checkpoint false")
    plan.add_argument("--no-compile", action="store_true",
                      help="plan eager blocks, as wrap(compile=False) (default: compiled, as wrap runs them on a GPU)")
    plan.add_argument("--max-gpu-memory", metavar="SIZE|CARD",
                      help="the GPU memory per rank: a card (H100, H200, A100-80GB, A100-40GB) or a budget as "
                           "wrap(max_gpu_memory=...), e.g. 24GiB. With a batch shape, the optimizer state that fits "
                           "is planned on the GPU and the rest on the host (what bmtwrap.optim.auto_adam decides at "
                           "its first step), then with --checkpoint auto the blocks whose activations fit are planned "
                           "kept; the plan says whether it fits")
    plan.add_argument("--optimizer", default="auto", choices=["auto", "adam", "offload"],
                      help="auto (default): what bmtwrap.optim.auto_adam builds, decided for --max-gpu-memory (without "
                           "it: all state on the GPU); adam: AdamOptimizer, all on the GPU; offload: "
                           "AdamOffloadOptimizer with --offload-fraction")
    plan.add_argument("--offload", action="store_true", help="the same as --optimizer offload")
    plan.add_argument("--offload-fraction", default="1.0",
                      help="with --optimizer offload: the share of the optimizer state on the host (default 1.0), or "
                           "auto (decided for --max-gpu-memory)")
    plan.add_argument("--step-in-backward", nargs="?", const="true", default="auto", choices=["auto", "true", "false"],
                      help="the offload optimizer's step_in_backward: other than false, gradients of the state on "
                           "the host leave the GPU as backward makes them (default auto, as on a GPU)")
    plan.add_argument("--offload-params", nargs="?", const="true", default="auto", choices=["true", "false", "auto"],
                      help="as wrap(offload_params=...): block parameters and gradients in host memory; auto "
                           "(default) decides from --max-gpu-memory as wrap does (without it: false)")
    plan.add_argument("--model-class", metavar="NAME",
                      help="the transformers class to build, e.g. BertForMaskedLM (default: the first of the config's "
                           "architectures, else what AutoModelForCausalLM, AutoModelForSeq2SeqLM or AutoModel picks)")
    plan.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                      help="parameter dtype (default auto: the config's, else float32)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    args = _parser().parse_args(argv)
    if args.world_size < 1:
        raise SystemExit(f"--world-size must be >= 1, got {args.world_size}")
    if args.shard_size is not None and not (1 <= args.shard_size <= args.world_size
                                            and args.world_size % args.shard_size == 0):
        raise SystemExit(f"--shard-size {args.shard_size} must divide --world-size {args.world_size}")
    if args.tp_size < 1 or args.world_size % args.tp_size:
        raise SystemExit(f"--tp-size {args.tp_size} must divide --world-size {args.world_size}")
    if (args.batch_size is None) != (args.seq_len is None):
        raise SystemExit("give --batch-size and --seq-len together (the activation estimate needs both)")
    optimizer = "offload" if args.offload else args.optimizer
    try:
        fraction = "auto" if args.offload_fraction == "auto" else float(args.offload_fraction)
    except ValueError:
        raise SystemExit(f"--offload-fraction must be a number in [0, 1] or auto, got {args.offload_fraction!r}")
    if fraction != 1.0 and optimizer != "offload":
        raise SystemExit("--offload-fraction applies to --optimizer offload; add it")
    budget = None
    if args.max_gpu_memory is not None:
        try:
            budget = parse_bytes(args.max_gpu_memory, name="--max-gpu-memory")
        except ValueError as error:
            raise SystemExit(str(error)) from None

    from .wrap import plan as make_plan

    config = _load_config(args.model)
    model, chosen = _build_on_meta(config, _dtype(args.dtype, config), args.model_class)
    print(chosen)
    checkpoint = {"true": True, "false": False, "auto": "auto"}["false" if args.no_checkpoint else args.checkpoint]
    try:
        planned = make_plan(model, world_size=args.world_size, checkpoint=checkpoint, batch_size=args.batch_size,
                            seq_len=args.seq_len,
                            offload_optimizer={"auto": "auto", "adam": False, "offload": True}[optimizer],
                            offload_fraction=fraction,
                            step_in_backward={"true": True, "false": False}.get(args.step_in_backward, "auto"),
                            offload_params={"true": True, "false": False}.get(args.offload_params, "auto"),
                            ranks_per_host=args.ranks_per_host, max_gpu_memory=budget, compile=not args.no_compile,
                            shard_size=args.shard_size or args.world_size // args.tp_size, tp_size=args.tp_size,
                            fp8=False if args.fp8 == "off" else args.fp8)
    except ImportError as error:  # --fp8 without torchao
        raise SystemExit(f"--fp8 {args.fp8}: {error}") from None
    except (ValueError, NotImplementedError) as error:
        if args.tp_size == 1:
            raise
        raise SystemExit(f"--tp-size {args.tp_size}: {error}") from None
    print(planned)
    return 0


if __name__ == "__main__":
    sys.exit(main())
