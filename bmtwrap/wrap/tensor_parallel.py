"""Tensor parallelism for Hugging Face models: ``wrap(model, tp_size=T)`` splits the layers its plan names.

[Note: the Hugging Face tensor-parallel plan]
A transformers 5 model carries its plan as ``model.tp_plan``: module names (layer numbers written
``*``) mapped to styles, merged by transformers from the config's ``base_model_tp_plan`` and the
head's ``_tp_plan`` (Llama: ``model.layers.*.self_attn.q_proj: colwise``, ``o_proj: rowwise``,
``model.embed_tokens: embedding_rowwise``, ``lm_head: colwise_gather_output``). In a group of ``T``
consecutive ranks, rank ``r`` of the group applies each style as follows:

    colwise                nn.Linear: keeps rows ``r*O/T .. (r+1)*O/T`` of the weight (its output features:
                           its attention heads, its slice of the MLP) and of the bias. The input is whole
                           (``tp.copy_whole``: its gradient is summed over the group, once for the layers
                           that share it); the output is this rank's columns, which the attention reshapes
                           into its heads (``-1`` heads).
    rowwise                nn.Linear: keeps the matching columns of the weight; the bias stays whole.
                           Output ``all_reduce(x_r W_r^T) + b`` (``tp.all_reduce_whole``): whole, the bias
                           added once.
    embedding_rowwise      nn.Embedding: keeps rows ``r*V/T .. (r+1)*V/T`` of the vocabulary; ids outside
                           them look up zeros and the group's lookups are summed. Kept whole when the
                           vocabulary does not divide by ``T`` or the weight is tied to another module.
    replicated_with_grad_allreduce
                           a module whose whole parameters act on this rank's heads only (Qwen3's per-head
                           ``q_norm``, ``k_norm``): its parameters pass through ``tp.copy_whole`` in its
                           forward, so each rank's partial gradient is summed over the group.
    colwise_gather_output, colwise_rep, rowwise_rep, rowwise_split_input, replicate
                           kept whole: whole input, whole output, exact. For the LM head
                           (``colwise_gather_output``) that also keeps the logits whole on every rank with
                           no gather, and lets bmtwrap's loss without the logits read its weight whole,
                           each rank of the group taking a share of the rows (see head_loss.py).
                           ZeRO still shards them over the data-parallel ranks.

Any other style (packed or expert weights, sequence parallelism) raises ``NotImplementedError``
naming it. Activations between layers are therefore whole on every rank of the group: norms,
rowwise biases and the head get their true gradient on every rank, and each split weight its
slice's true one, so no buffer is summed over the group (``TpLayout.WHOLE``; BMTrain's layout sums,
see [Note: tensor parallelism] in ``engine/tp.py``).
The split parameters are recorded on their slots (``ParamSlot.tp_split_dim``): ``state_dict()``
and bmtwrap's checkpoints join them whole, and ``load_state_dict`` of whole tensors cuts them.

Why not transformers' own ``apply_tensor_parallelism``: its styles turn each parameter into a DTensor
and move activations through DTensor redistributions, while bmtwrap's flat buffers hold plain tensors
(every parameter becomes a 1-D view of its shard), so the DTensors would not survive sharding. The
two collectives it needs are ``tp.copy_whole`` and ``tp.all_reduce_whole``, which match transformers'
private ``_AllReduceBackward`` and ``_AllReduceForward``.

Every rank of a tensor-parallel group computes on the same batch: the data-parallel ranks are the
groups, ``rank // T`` of ``world_size // T``.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..engine import dist as _dist
from ..engine.group import ParamGroup
from ..engine.tp import TpLayout, all_reduce_whole, copy_whole
from .instance_forward import replace_forward

__all__ = ["Sizes", "Split", "TensorParallelSplit", "check_tp_size", "mark_split", "planned_splits", "sliced_shapes",
           "split_by_plan", "split_dims"]

# Styles of the plan that leave the module whole (see the Note).
_KEPT_WHOLE = ("colwise_gather_output", "colwise_rep", "rowwise_rep", "rowwise_split_input", "replicate")
# A module whose whole parameters see this rank's heads only: their gradients are summed over the group.
_GRAD_SUMMED = "replicated_with_grad_allreduce"
# The projections whose output features are attention heads (transformers' get_kv_heads_per_rank names them).
_HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value")


@dataclass
class TensorParallelSplit:
    """What :func:`split_by_plan` did to a model.

    Attributes:
        dims: ``id(parameter)`` -> the dimension it was split along, for every split parameter.
        restores: each puts back a module's forward.
    """

    dims: Dict[int, int] = field(default_factory=dict)
    restores: List[Callable[[], None]] = field(default_factory=list)


def check_tp_size(tp_size: Optional[int], ctx: Optional[_dist.DistContext]) -> Optional[int]:
    """``wrap``'s ``tp_size`` checked against the job: the context's when ``None`` (``ctx`` ``None``: before the
    process group exists, only the value is checked).

    Raises:
        ValueError: not a whole number >= 1; not dividing the world size; another size than the process group's.
    """
    if tp_size is not None and (isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1):
        raise ValueError(f"tp_size must be a whole number of ranks >= 1, got {tp_size!r}")
    if ctx is None or tp_size is None:
        return tp_size if ctx is None else ctx.tp_size
    if ctx.world_size % tp_size:
        raise ValueError(f"wrap(tp_size={tp_size}): tp_size must divide the world size {ctx.world_size}; give one of "
                         f"{_divisors(ctx.world_size)}, or start a multiple of {tp_size} processes")
    if tp_size != ctx.tp_size:
        raise ValueError(f"wrap(tp_size={tp_size}), but the process group was set up with tensor-parallel groups of "
                         f"{ctx.tp_size}: call bmtwrap.init_distributed(tp_size={tp_size}) before wrap, or leave "
                         "init_distributed out and let wrap set it up")
    return tp_size


class Sizes(NamedTuple):
    """The tensor-parallel size planned for, and the world size it is one of (for the valid sizes errors list)."""

    tp: int
    world: int


class Split(NamedTuple):
    """One module the plan splits: its name, the module, its style ("colwise", "rowwise", "embedding_rowwise")."""

    name: str
    module: nn.Module
    style: str


def planned_splits(model: nn.Module, sizes: Sizes) -> List[Split]:
    """The modules ``model.tp_plan`` splits at ``sizes.tp`` (see [Note: the Hugging Face tensor-parallel plan]),
    checked; changes nothing.

    Raises:
        ValueError: the model has no plan, or one that names none of its modules; its attention heads or a split
            layer's features do not divide by ``sizes.tp`` (the message lists the sizes that do).
        NotImplementedError: a style of the plan other than the Note's, or a module of the wrong kind for its style.
    """
    from transformers.integrations.tensor_parallel import replace_layer_number_by_wildcard

    # The merged plan: transformers 5.23's tp_plan property; releases before it keep the same dict in _tp_plan.
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if not plan:
        raise ValueError(
            f"wrap(tp_size={sizes.tp}) splits a model by its Hugging Face tensor-parallel plan (model.tp_plan), "
            f"and this {type(model).__name__} has none: give a transformers model whose config has a "
            "base_model_tp_plan, set model.tp_plan = {'module.name': 'colwise' | 'rowwise', ...}, or leave tp_size "
            "out (ZeRO over every rank)")
    _check_heads(model, plan, sizes)
    for name, _ in model.named_parameters():
        style = plan.get(replace_layer_number_by_wildcard(name))
        if style is not None and style not in _KEPT_WHOLE + (_GRAD_SUMMED,):
            raise NotImplementedError(f"wrap(tp_size={sizes.tp}): the plan splits the parameter '{name}' "
                                      f"('{style}'); bmtwrap splits whole linear and embedding modules only")
    uses = _parameter_uses(model)
    splits = []
    for name, module in model.named_modules():
        style = plan.get(replace_layer_number_by_wildcard(name))
        if style is None or style in _KEPT_WHOLE:
            continue
        if style in ("colwise", "rowwise"):
            _check_linear(name, module, style, sizes)
        elif style == _GRAD_SUMMED:
            pass
        elif style == "embedding_rowwise":
            if not isinstance(module, nn.Embedding):
                raise NotImplementedError(f"wrap(tp_size={sizes.tp}): the plan makes '{name}' embedding_rowwise, "
                                          f"but it is a {type(module).__name__}, not an nn.Embedding")
            if uses[id(module.weight)] > 1 or module.num_embeddings % sizes.tp:
                continue  # whole (see the Note): exact, and the head it is tied to is whole too
        else:
            raise NotImplementedError(
                f"wrap(tp_size={sizes.tp}): the plan gives '{name}' the style '{style}', which bmtwrap does not "
                f"apply (it applies colwise, rowwise, embedding_rowwise, {_GRAD_SUMMED}; {', '.join(_KEPT_WHOLE)} stay "
                "whole); set model.tp_plan without it, or leave tp_size out")
        splits.append(Split(name, module, style))
    if not splits and any(style not in _KEPT_WHOLE for style in plan.values()):
        rules = ", ".join(sorted(key for key, style in plan.items() if style not in _KEPT_WHOLE)[:3])
        raise ValueError(
            f"wrap(tp_size={sizes.tp}): no rule of model.tp_plan ({rules}, ...) names a module of this "
            f"{type(model).__name__}, so nothing would be split and every rank of a group would compute the whole "
            "model: a wrapper (peft's PeftModel, for one) renames the modules; wrap the transformers model itself, "
            "or leave tp_size out")
    return splits


def split_dims(split: Split) -> List[Tuple[nn.Parameter, int]]:
    """The parameters ``split`` cuts, with the dimension each is cut along (a rowwise bias stays whole)."""
    if split.style == _GRAD_SUMMED:
        return []
    if split.style == "rowwise":
        return [(split.module.weight, 1)]
    return [(p, 0) for p in (split.module.weight, getattr(split.module, "bias", None)) if p is not None]


def split_by_plan(model: nn.Module, ctx: _dist.DistContext) -> TensorParallelSplit:
    """Keep this rank's slices of the layers ``model.tp_plan`` names and make their forwards tensor-parallel, in
    place (see [Note: the Hugging Face tensor-parallel plan]). Before sharding: the parameters' shapes become
    this rank's slices. Raises as :func:`planned_splits`, before changing anything.
    """
    done = TensorParallelSplit()
    whole_inputs = _WholeInputs()
    for split in planned_splits(model, Sizes(ctx.tp_size, ctx.world_size)):
        for param, dim in split_dims(split):
            _keep_slice(param, dim, ctx, done)
        if split.style == "embedding_rowwise":
            _embedding_forward(split.module, ctx, done)
        elif split.style == _GRAD_SUMMED:
            _grad_summed_forward(split.module, done)
        else:
            _linear_forward(split.module, split.style, whole_inputs, done)
    return done


@contextlib.contextmanager
def sliced_shapes(model: nn.Module, sizes: Sizes) -> Iterator[None]:
    """Inside, each parameter the plan splits is a meta tensor of one rank's slice: what ``plan`` measures."""
    swapped = []
    try:
        for split in planned_splits(model, sizes):
            for param, dim in split_dims(split):
                shape = list(param.shape)
                shape[dim] //= sizes.tp
                stand_in = nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"),
                                        requires_grad=param.requires_grad)
                torch.utils.swap_tensors(param, stand_in)
                swapped.append((param, stand_in))
        yield
    finally:
        for param, stand_in in reversed(swapped):
            torch.utils.swap_tensors(param, stand_in)


def mark_split(groups: List[ParamGroup], split: TensorParallelSplit) -> None:
    """Record on the groups' slots which parameters are split, and mark every buffer ``TpLayout.WHOLE``."""
    for group in groups:
        for buffer in group.buffers:
            buffer.tp_layout = TpLayout.WHOLE
            for slot in buffer.slots:
                slot.tp_split_dim = split.dims.get(id(slot.param))


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_heads(model: nn.Module, plan: Dict[str, str], sizes: Sizes) -> None:
    """The attention heads and key/value heads must divide among the group (GQA's k/v heads too)."""
    if not any(key.rsplit(".", 1)[-1] in _HEAD_PROJECTIONS and style == "colwise" for key, style in plan.items()):
        return
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(heads, int):
        return
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % sizes.tp or kv_heads % sizes.tp:
        raise ValueError(
            f"wrap(tp_size={sizes.tp}): this {type(model).__name__} has {heads} attention heads and {kv_heads} "
            f"key/value heads, which tensor parallelism deals out among the ranks of a group, so tp_size must divide "
            f"both; valid tp sizes here (world size {sizes.world}): "
            f"{_divisors(math.gcd(heads, kv_heads, sizes.world))}")


def _check_linear(name: str, module: nn.Module, style: str, sizes: Sizes) -> None:
    if not isinstance(module, nn.Linear):
        raise NotImplementedError(f"wrap(tp_size={sizes.tp}): the plan makes '{name}' {style}, but it is a "
                                  f"{type(module).__name__}, not an nn.Linear; bmtwrap splits plain linear layers")
    features = module.out_features if style == "colwise" else module.in_features
    if features % sizes.tp:
        which = "output" if style == "colwise" else "input"
        raise ValueError(f"wrap(tp_size={sizes.tp}): '{name}' ({style}) has {features} {which} features, which do "
                         f"not divide among {sizes.tp} ranks; valid tp sizes for it (world size {sizes.world}): "
                         f"{_divisors(math.gcd(features, sizes.world))}")


def _parameter_uses(model: nn.Module) -> Dict[int, int]:
    """How many (module, attribute) places hold each parameter: above 1, it is tied."""
    uses: Dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    return uses


@torch.no_grad()
def _keep_slice(param: nn.Parameter, dim: int, ctx: _dist.DistContext, done: TensorParallelSplit) -> None:
    """Make ``param`` (the same object) hold only this rank's slice along ``dim``."""
    param.grad = None
    param.data = param.data.chunk(ctx.tp_size, dim=dim)[ctx.tp_rank].clone()
    done.dims[id(param)] = dim


class _WholeInputs:
    """The colwise layers that read one whole input (an attention's q, k and v; an MLP's gate and up) share one
    ``copy_whole`` of it: backward then sums their partial input gradients over the group with one all-reduce,
    not one each (Megatron's ``f`` before the attention and the MLP). The last input is remembered by a weak
    reference; the copy it holds keeps that one activation alive until the next colwise call.

    The input's identity is the whole test, not its version too: a compiled block traces this code, and
    ``torch.compile`` cannot guard on a tensor's version (the block then ran in eager mode). An input changed in
    place between two of its colwise layers fails anyway: the first layer saved it for backward."""

    def __init__(self) -> None:
        self._last: Optional[Tuple["weakref.ref[torch.Tensor]", torch.Tensor]] = None

    def copy(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            self._last = None
            return x  # no gradient flows back: copy_whole would be the identity
        last = self._last
        if last is not None and last[0]() is x:
            return last[1]
        copied = copy_whole(x)
        self._last = (weakref.ref(x), copied)
        return copied


def _linear_forward(module: nn.Linear, style: str, whole_inputs: _WholeInputs, done: TensorParallelSplit) -> None:
    if style == "colwise":
        def colwise(x: torch.Tensor) -> torch.Tensor:  # x (..., I) whole -> (..., O / T), this rank's features
            return F.linear(whole_inputs.copy(x), module.weight, module.bias)

        done.restores.append(replace_forward(module, colwise))
        return

    def rowwise(x: torch.Tensor) -> torch.Tensor:  # x (..., I / T), this rank's features -> (..., O) whole
        out = all_reduce_whole(F.linear(x, module.weight))
        return out if module.bias is None else out + module.bias

    done.restores.append(replace_forward(module, rowwise))


def _grad_summed_forward(module: nn.Module, done: TensorParallelSplit) -> None:
    original = module.forward

    def grad_summed(*args: Any, **kwargs: Any) -> Any:
        held = dict(module._parameters)  # inside a block: the engine's gathered views
        for name, value in held.items():
            if value is not None and value.requires_grad:
                module._parameters[name] = copy_whole(value)  # identity; the gradient summed over the group
        try:
            return original(*args, **kwargs)
        finally:
            module._parameters.update(held)

    done.restores.append(replace_forward(module, grad_summed))


def _embedding_forward(module: nn.Embedding, ctx: _dist.DistContext, done: TensorParallelSplit) -> None:
    part = module.num_embeddings // ctx.tp_size
    start, end = ctx.tp_rank * part, (ctx.tp_rank + 1) * part
    original = module.forward

    def embedding_rowwise(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        outside = (input < start) | (input >= end)  # ids of the other ranks' rows
        # padding_idx stays the whole vocabulary's at rest (an initialiser of the whole weight zeroes that row);
        # during the lookup it is the row of this rank's slice, or none.
        padding = module.padding_idx
        module.padding_idx = padding - start if padding is not None and start <= padding < end else None
        try:
            looked = original(torch.where(outside, torch.zeros_like(input), input - start), *args, **kwargs)
        finally:
            module.padding_idx = padding
        return all_reduce_whole(looked.masked_fill(outside.unsqueeze(-1), 0))

    done.restores.append(replace_forward(module, embedding_rowwise))
