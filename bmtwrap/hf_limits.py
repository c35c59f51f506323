"""The TrainingArguments settings and models that bmtwrap's Trainers refuse, each with what to use instead.

Checked when a Trainer is built, before any collective: a refusal raises on every rank alike.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, NamedTuple, Optional

from torch import nn
from transformers import TrainingArguments


def _fsdp_as_given(args: TrainingArguments) -> str:
    """``args.fsdp`` as the user spelt it, near enough.

    TrainingArguments (5.x) turns every ``fsdp`` into ``True`` and moves the legacy words into
    ``fsdp_config`` (``"full_shard"``: ``reshard_after_forward=True``, ``"shard_grad_op"``: False,
    ``"offload"``: ``cpu_offload``); printing ``fsdp=True`` would name a value nobody wrote.
    """
    if not isinstance(args.fsdp, bool):  # a string or a list of FSDPOption, as given
        words = args.fsdp.split() if isinstance(args.fsdp, str) else [getattr(w, "value", w) for w in args.fsdp]
        return repr(" ".join(words))
    config = args.fsdp_config if isinstance(args.fsdp_config, dict) else {}
    reshard = config.get("reshard_after_forward")
    words = [{True: "full_shard", False: "shard_grad_op"}.get(reshard, reshard)] if reshard is not None else []
    words += ["offload"] if config.get("cpu_offload") else []
    return repr(" ".join(words)) if words else repr(args.fsdp)


class _Limit(NamedTuple):
    """A TrainingArguments setting bmtwrap's Trainer refuses, and what to do instead."""

    argument: str  # attribute path on TrainingArguments
    applies: Callable[[TrainingArguments], bool]
    instead: str
    shown: Optional[Callable[[TrainingArguments], str]] = None  # the value in the message; default its repr


_LIMITS = (
    _Limit("deepspeed", lambda a: bool(a.deepspeed),
           "bmtwrap shards the model itself (ZeRO-3); remove deepspeed=, and pass offload=True (and "
           "wrap_options={'offload_params': True}) for CPU offload"),
    _Limit("fsdp", lambda a: bool(a.fsdp),
           "bmtwrap shards the model itself (ZeRO-3); remove fsdp= and fsdp_config=, and pass the sharding "
           "options as wrap_options", _fsdp_as_given),
    _Limit("fsdp_config", lambda a: bool(a.fsdp_config),
           "bmtwrap shards the model itself (ZeRO-3); remove fsdp= and fsdp_config=, and pass the sharding "
           "options as wrap_options"),
    _Limit("fp16", lambda a: bool(a.fp16),
           "the gradient scaler checks each rank's gradient shards for inf/nan on its own, so the ranks could "
           "disagree on skipping a step; use bf16=True, which needs no loss scaling"),
    _Limit("fp16_full_eval", lambda a: bool(a.fp16_full_eval),
           "it casts the model with .to(dtype), which would replace the sharded parameters; use bf16=True "
           "(autocast) or load the model in the dtype you want"),
    _Limit("bf16_full_eval", lambda a: bool(a.bf16_full_eval),
           "it casts the model with .to(dtype), which would replace the sharded parameters; use bf16=True "
           "(autocast) or load the model in the dtype you want"),
    _Limit("torch_compile", lambda a: bool(a.torch_compile),
           "torch.compile does not trace through bmtwrap's gathers and reductions; leave torch_compile off"),
    _Limit("auto_find_batch_size", lambda a: bool(a.auto_find_batch_size),
           "an out-of-memory error on one rank would leave the others waiting in a collective; set "
           "per_device_train_batch_size yourself"),
    _Limit("use_liger_kernel", lambda a: bool(a.use_liger_kernel),
           "Liger replaces the forward of modules that bmtwrap has already made into sharded blocks; leave "
           "use_liger_kernel off"),
    _Limit("accelerator_config.even_batches", lambda a: not a.accelerator_config.even_batches,
           "every forward of a sharded model is a collective, so every rank must run the same number of "
           "batches; leave even_batches=True"),
    _Limit("parallelism_config", lambda a: getattr(a, "parallelism_config", None) is not None,
           "bmtwrap shards a Hugging Face model's parameters over all ranks (ZeRO); its tensor parallelism "
           "(bmtwrap.wrap(model, tp_size=...)) needs the same batch on every rank of a group, which Trainer does not "
           "give, and it has no context or sequence parallelism; remove parallelism_config"),
)


def _value(args: TrainingArguments, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), args)


def refuse_unsupported_args(args: TrainingArguments, who: str) -> None:
    """Raise for every TrainingArguments setting that cannot work on a sharded model (before any collective)."""
    for limit in _LIMITS:
        if limit.applies(args):
            shown = limit.shown(args) if limit.shown is not None else repr(_value(args, limit.argument))
            raise NotImplementedError(f"{who} does not support {limit.argument}={shown}: {limit.instead}")


def refuse_unsupported_model(model: Optional[nn.Module], model_init: Any, who: str) -> nn.Module:
    """The model, if bmtwrap can shard it; raise otherwise."""
    if model_init is not None:
        raise NotImplementedError(f"{who} does not support model_init= (nor hyperparameter_search): "
                                  "it shards the model once, when the Trainer is built; pass model= instead")
    if model is None:
        raise ValueError(f"{who} needs model=, the model to shard and train")
    placed = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values() if d not in ("cpu", "disk")}
    if len(placed) > 1:
        raise NotImplementedError(f"the model was loaded with a device_map spreading it over {sorted(placed)}; "
                                  "bmtwrap shards it over the ranks itself: load it without device_map (on the CPU)")
    if getattr(model, "hf_quantizer", None) is not None or getattr(model, "is_quantized", False):
        raise NotImplementedError(f"{who} does not support quantized models (bitsandbytes and the like): "
                                  "their packed weights cannot be cut into flat shards; load the model in bf16 or fp32")
    if getattr(model, "is_distributed_loading_by_transformers", False) or (getattr(model, "tp_size", None) or 1) > 1:
        raise NotImplementedError("this model was already distributed by transformers (distributed_config or "
                                  "tp_plan); bmtwrap shards it itself: load it without them")
    return model


def refuse_trl_options(given: Iterable[Any], who: str) -> None:
    """Raise for the TRL settings that cannot work on a sharded model, before TRL acts on them; ``given``: a
    trainer's arguments, the TrainingArguments among them (a TRL config) are read."""
    for args in given:
        if not isinstance(args, TrainingArguments):
            continue
        if getattr(args, "activation_offloading", False):
            raise NotImplementedError(f"{who} does not support activation_offloading=True: its saved-tensor hooks "
                                      "were not made for bmtwrap's blocks, which gather, release and recompute their "
                                      "parameters; bmtwrap recomputes activations instead: leave "
                                      "gradient_checkpointing=True (TRL's default), and pass "
                                      "wrap_options={'offload_params': True} to move the parameters off the GPU")
        # transformers 5.23 renamed gradient_checkpointing_kwargs to activation_checkpointing_kwargs, keeping both.
        kwargs = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs
        if (kwargs or {}).get("selective"):
            raise NotImplementedError(f"{who} does not support gradient_checkpointing_kwargs={{'selective': True}}: "
                                      "bmtwrap checkpoints whole blocks itself (Hugging Face's checkpointing, which "
                                      "TRL's selective variant rides on, stays off); drop 'selective'")
