"""The converter: apply a :class:`WrapPlan` to a model, in place.

[Note: what wrap changes]
- Each block module keeps its class, name and place in the tree; its ``forward`` attribute is set
  on the instance to a function that runs the original forward through a
  :class:`~bmtwrap.engine.runners.BlockRunner` (gather, checkpoint, reduce). ``state_dict()`` keys,
  ``isinstance`` and every other method are unchanged.
- Every parameter object stays the same Python object; its ``.data`` becomes a 1-D view of this
  rank's piece. So an optimizer built after ``wrap`` sees the shards, and one built before but not
  yet stepped sees them too.
- The model gets a forward pre-hook and post-hook that gather the root group (everything outside
  blocks) for the duration of its forward; so does a model inside it whose forward a wrapper's
  methods call directly (the adapter's ``entry_points``).
- Buffers move to this process's device.
- ``load_state_dict`` accepts the unwrapped model's full tensors as well as pieces, and
  ``state_dict()`` gives full-shaped CPU tensors (see [Note: state_dict of a sharded model] in
  ``full_state.py``).
- Wrapping is undone (:meth:`Wrapped.dissolve`) when the model, or a model containing it, is then
  put inside a :class:`~bmtwrap.Block` or wrapped as a whole: the enclosing group shards the
  parameters of the blocks that run them.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..engine import dist as _dist
from ..engine.full_state import register_full_state_dict, shard_full_tensors
from ..engine.group import ROOT_LABEL
from ..engine.memory import cap_allocator, parse_bytes
from ..engine.offload import OffloadPolicy, expandable_segments
from ..engine.runners import BlockModule, BlockRunner, RootRunner
from ..engine.shard import build_group, unshard_group
from ..engine.schedule import engine
from .adapters import ModelAdapter, adapter_for
from .auto import AutoRecompute, auto_recompute
from .attention import with_attention_order
from .compiled import CompileOption, compile_options, compiled_forward, compiled_outside_blocks
from .detect import LayerPolicy
from .fp8 import FP8Option, check_device, convert_blocks, describe, float8_choice
from .instance_forward import replace_forward
from .tensor_parallel import Sizes, TensorParallelSplit, check_tp_size, mark_split, sliced_shapes, split_by_plan
from .plan import (PARAMS_SHARE, Checkpoint, OffloadOptions, WrapPlan, make_plan, offload_params_auto,
                   params_and_grads_bytes)

__all__ = ["StaleBuffer", "plan", "wrap", "wrapped_record"]


@dataclass(frozen=True)
class WrapOptions:
    """The options of one :func:`wrap` call (compared when a model is wrapped again)."""

    layers: Any
    checkpoint: Checkpoint
    zero_level: int
    reduce_dtype: Optional[torch.dtype]
    max_gpu_memory: Optional[int]
    offload_params: Union[bool, str]  # as given; the plan's offload options hold what "auto" chose
    keep_logits: bool
    tp_size: int
    compile: Any  # as given: True, False, "auto", or torch.compile's options as sorted (name, value) pairs
    fp8: Any = None  # the float8 recipe's name, a torchao config, or None when off


class StaleBuffer(NamedTuple):
    """A buffer that was on the meta device when :func:`wrap` moved it: storage, but no value yet.

    Loading a checkpoint that holds it, or initialising its module, writes it; ``written`` tells
    which happened (the tensor's version counter moves on every in-place write). Until then it
    holds NaN (integers: 0), never leftover memory.
    """

    module: nn.Module
    name: str
    tensor: torch.Tensor  # the storage wrap made; a module that assigns a new tensor has written it
    version: int  # ``tensor._version`` when wrap made it

    @property
    def written(self) -> bool:
        return self.module._buffers.get(self.name) is not self.tensor or self.tensor._version != self.version


@dataclass(eq=False)
class Wrapped:
    """What wrap made of one model: the engine keeps it (a ``schedule.WrapRecord``) to detect wrapping again."""

    model: "weakref.ref[nn.Module]"
    options: WrapOptions
    plan: WrapPlan
    runners: List[Tuple[nn.Module, BlockRunner]]
    root: RootRunner
    adapter: ModelAdapter
    # Buffers that were on the meta device and are not written yet: a checkpoint may hold them
    # (persistent ones); the rest (rotary inv_freq, Gemma's embed_scale, ...) are computed by the
    # model's own initialiser after loading (``materialize.restore_buffers``).
    stale_buffers: List[StaleBuffer]
    handles: List[RemovableHandle]  # every hook wrap registered, for dissolve()
    restore_forwards: List[Callable[[], None]]  # each block's forward as it was before wrap
    auto: Optional[AutoRecompute] = None  # checkpoint="auto"'s decision (its report says what it chose)
    tp_split: Optional[TensorParallelSplit] = None  # what wrap(tp_size > 1) split

    def dissolve(self) -> None:
        """Undo the wrapping (a collective): every parameter holds its full value again, on this
        process's device; the blocks' forwards and every hook are removed.

        Raises:
            NotImplementedError: the model was split by tensor parallelism (its parameters hold slices).
        """
        if self.tp_split is not None:
            model = self.model()
            raise NotImplementedError(
                f"this {type(model).__name__} was wrapped with tp_size={self.options.tp_size}, and its parameters hold "
                "this rank's slices: it cannot be sharded again as part of another model or Block; wrap the "
                "outermost model once, with tp_size")
        for handle in self.handles:
            handle.remove()
        for restore in self.restore_forwards:
            restore()
        registry = engine().registry
        for _, runner in self.runners:
            unshard_group(registry, runner.group)
        unshard_group(registry, self.root.group)


def _check_options(checkpoint: Checkpoint, zero_level: Optional[int]) -> None:
    if checkpoint not in (True, False, "auto"):
        raise ValueError(f"checkpoint must be True, False or 'auto', got {checkpoint!r}")
    if zero_level not in (None, 2, 3):
        raise ValueError(f"zero_level must be 2 or 3, got {zero_level!r}")


def plan(model: nn.Module, *, world_size: Optional[int] = None, layers: Optional[LayerPolicy] = None,
         checkpoint: Checkpoint = "auto", batch_size: Optional[int] = None, seq_len: Optional[int] = None,
         offload_optimizer: Union[bool, str] = "auto", offload_fraction: Union[float, str] = 1.0,
         step_in_backward: Union[bool, str] = "auto",
         offload_params: Union[bool, str] = "auto",
         ranks_per_host: Optional[int] = None, max_gpu_memory: Union[int, str, None] = None,
         keep_logits: bool = False, compile: CompileOption = "auto", shard_size: Optional[int] = None,
         tp_size: Optional[int] = None, fp8: FP8Option = False) -> WrapPlan:
    """What :func:`wrap` would do to ``model``, without doing it (no collectives, no allocation).

    The memory estimate is per rank, on the GPU and on the host; its parameter, gradient and
    optimizer bytes are exact for Adam(W) (bmtwrap's or torch's), the rest is a model of a
    transformer's peak (see [Note: memory estimate] in ``bmtwrap/wrap/plan.py``).

    Args:
        model: the model :func:`wrap` would get; it may be on the meta device.
        world_size: ranks to plan for; default: the current world size, or 1 before
            :func:`bmtwrap.init_distributed`.
        layers: as for :func:`wrap`.
        checkpoint: as for :func:`wrap`; ``"auto"`` is planned as every block checkpointed,
            since ``wrap`` decides only in the first training step, unless ``max_gpu_memory`` and
            a batch shape are given: then as many blocks, first to last, keep their activations
            as the estimate fits under the budget less ``checkpoint="auto"``'s margin and the memory
            outside torch's allocator (``memory.outside_allocator_estimate``).
        batch_size: the batch size each rank runs, for the activation estimate (with ``seq_len``).
        seq_len: the sequence length, for the activation estimate (with ``batch_size``).
        offload_optimizer: ``"auto"`` (default): the optimizer :func:`bmtwrap.optim.auto_adam` builds. Given
            ``max_gpu_memory`` (a size, or a card such as ``"H100"``) and a batch shape, the state that fits
            beside the first step stays on the GPU and the rest is planned on the host, as that optimizer
            decides at its first step (see [Note: automatic offload fraction] in
            ``bmtwrap/engine/placement.py``); without them, all of it on the GPU (where everything fits).
            ``True``: :class:`~bmtwrap.optim.AdamOffloadOptimizer` with ``offload_fraction``; ``False``:
            :class:`~bmtwrap.optim.AdamOptimizer`, all on the GPU.
        offload_fraction: the offload optimizer's ``offload_fraction``, or ``"auto"`` (decided for the card
            as above).
        step_in_backward: the offload optimizer's ``step_in_backward``: other than ``False``, the gradients
            of the state on the host leave the GPU as backward makes them (``"auto"``: as on a GPU).
        offload_params: as for :func:`wrap`; ``"auto"`` (default) decides from ``max_gpu_memory`` (without
            one: ``False``).
        ranks_per_host: ranks sharing one host, for the per-host memory; default:
            ``min(world_size, 8)``.
        max_gpu_memory: a GPU budget per rank, as for :func:`wrap`; the plan says whether it fits.
        keep_logits: as for :func:`wrap`: plan for transformers' loss over the whole logits.
        compile: as for :func:`wrap`; ``"auto"`` plans compiled blocks, as ``wrap`` runs them on a GPU
            (a compiled block's recomputation keeps less: see the Note). ``False``: eager blocks.
        shard_size: hybrid sharding, as ``init_distributed(shard_size=...)``: parameters, gradients and
            optimizer state sharded over this many ranks (it must divide ``world_size``); default: the
            current context's, or ``world_size``.
        tp_size: tensor parallelism, as for :func:`wrap`: the parameters the model's plan splits count at one
            rank's slice, and every parameter is sharded over ``world_size // tp_size`` ranks; default: the
            current context's (at its world size), or 1.
        fp8: as for :func:`wrap`; the plan names the recipe and how many of the blocks' linear layers it
            converts (the memory estimate is the same: float8 casts are transient, and the saved activations
            and the master weights keep the model's dtype).

    Returns:
        A :class:`~bmtwrap.wrap.plan.WrapPlan`; ``print(plan)`` shows it as a table.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``layers`` is neither classes nor a callable.
        ValueError: a bad ``checkpoint``; ``world_size < 1``; a ``shard_size`` or ``tp_size`` that does not
            divide ``world_size``; a class in ``layers`` that the model does not have; a ``tp_size`` the model's
            heads do not divide by, or a model with no tensor-parallel plan.

    Example::

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        print(bmt.plan(model, world_size=8, batch_size=2, seq_len=4096))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"plan expects an nn.Module, got {type(model).__name__}")
    _check_options(checkpoint, None)
    if world_size is None:
        world_size = _dist.current().world_size if _dist.is_initialized() else 1
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _dist.current() if _dist.is_initialized() and _dist.current().world_size == world_size else None
    tp_size = check_tp_size(tp_size, None) or (ctx.tp_size if ctx is not None else 1)
    if world_size % tp_size:
        raise ValueError(f"tp_size={tp_size} must divide world_size={world_size}")
    if shard_size is None:
        shard_size = ctx.shard_size if ctx is not None and ctx.tp_size == tp_size else world_size // tp_size
    if not 1 <= shard_size <= world_size or world_size % shard_size:
        raise ValueError(f"shard_size={shard_size} must divide world_size={world_size}")
    if offload_optimizer not in (True, False, "auto"):
        raise ValueError(f"offload_optimizer must be True, False or 'auto', got {offload_optimizer!r}")
    if offload_fraction != "auto" and not (isinstance(offload_fraction, (int, float))
                                           and 0.0 <= offload_fraction <= 1.0):
        raise ValueError(f"offload_fraction must be 'auto' or in [0, 1], got {offload_fraction!r}")
    if ranks_per_host is not None and ranks_per_host < 1:
        raise ValueError(f"ranks_per_host must be >= 1, got {ranks_per_host!r}")
    budget = None if max_gpu_memory is None else parse_bytes(max_gpu_memory)
    with sliced_shapes(model, Sizes(tp_size, world_size)) if tp_size > 1 else contextlib.nullcontext():
        if offload_params == "auto":
            offload_params = offload_params_auto(model, world_size, budget, shard_size)
        offload = OffloadOptions(optimizer=offload_optimizer, fraction=offload_fraction, params=offload_params,
                                 in_backward=step_in_backward is not False)
        choice = float8_choice(fp8)
        planned, blocks, _ = make_plan(model, world_size, layers=layers, checkpoint=checkpoint, batch_size=batch_size,
                                       seq_len=seq_len, offload=offload, ranks_per_host=ranks_per_host,
                                       max_gpu_memory=budget, fused_loss=not keep_logits,
                                       compiled=compile is not False, shard_size=shard_size, float8=choice)
        return replace(planned, tp_size=tp_size, fp8=describe(choice, blocks))


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """An optimizer that stepped before ``wrap`` holds state of the full, unsharded shapes."""
    if not _dist.is_initialized():
        return
    registry = engine().registry
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state or registry.lookup(param) is None:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                    raise ValueError(
                        f"{type(optimizer).__name__} holds state '{key}' of shape {tuple(value.shape)} for a "
                        f"parameter bmtwrap has since sharded to shape {tuple(param.shape)}: the optimizer stepped "
                        "before bmtwrap.wrap(model). Create the optimizer after wrapping the model."
                    )


def _install_forward(module: nn.Module, runner: BlockRunner, compile_with: Optional[Dict[str, Any]],
                     device: torch.device) -> Callable[[], None]:
    """Run ``module``'s forward through ``runner``, compiled with ``torch.compile(**compile_with)`` unless that is
    ``None``, under the attention kernel order for ``device`` (see [Note: the attention kernel]); returns what
    undoes it."""
    original = module.forward  # may be an instance forward set by another library (accelerate's hooks)
    compiled = None if compile_with is None else compiled_forward(original, f"block {runner.name!r}", compile_with)
    body = with_attention_order(compiled or original, device)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return runner.run(body, args, kwargs)

    forward.block_runner = runner  # a Block built over this module calls it instead of running it again
    forward.compiled_body = compiled  # is_eager() tells whether it fell back
    return replace_forward(module, forward)


def _attach_root(model: nn.Module, root: RootRunner, entry_points: List[nn.Module]) -> List[RemovableHandle]:
    """Gather the root group around the forward of each entry point, the outermost call only.

    A wrapper's own methods may call the model inside it directly (peft's ``generate`` calls the
    Hugging Face model's), so each entry point enters the root; a nested call finds it entered and
    leaves it to the call that did. Returns the hooks' handles.
    """
    handles = []
    for module in entry_points:
        entered: List[bool] = []  # per call on this module, innermost last: whether it entered the root

        def enter(module: nn.Module, args: Tuple[Any, ...], entered: List[bool] = entered) -> None:
            entered.append(True)  # stays True if enter() raises: leave() then cleans up what it began
            entered[-1] = root.enter()

        def leave(module: nn.Module, args: Any, output: Any, entered: List[bool] = entered) -> None:
            if entered.pop():
                error = sys.exc_info()[1] if output is None else None  # called from torch's handler on a raise
                if error is not None:
                    engine().step_failed(error, f"the forward of {type(module).__name__}")
                root.exit()

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    handles.append(model.register_load_state_dict_pre_hook(shard_full_tensors))
    handles.append(register_full_state_dict(model))
    return handles


def _move_buffers(model: nn.Module, device: torch.device) -> List[StaleBuffer]:
    """Buffers go where the computation is; those on the meta device get storage there, filled with
    NaN (integers: 0) until a checkpoint or the model's initialiser writes them. Returns those."""
    stale: List[StaleBuffer] = []
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is None or buf.device == device:
                continue
            if not buf.is_meta:
                module._buffers[name] = buf.to(device)
                continue
            # Outside inference mode, so that the new tensor has a version counter to watch.
            with torch.inference_mode(False):
                fill = float("nan") if buf.is_floating_point() or buf.is_complex() else 0
                module._buffers[name] = torch.full_like(buf, fill, device=device)
            stale.append(StaleBuffer(module, name, module._buffers[name], module._buffers[name]._version))
    return stale


def _offload_params_chosen(model: nn.Module, ctx: _dist.DistContext, budget: Optional[int]) -> bool:
    """``offload_params="auto"`` on this rank's GPU (``plan.offload_params_auto``), the same on every rank."""
    if ctx.device.type != "cuda":
        return False
    card = torch.cuda.get_device_properties(ctx.device).total_memory
    chosen = offload_params_auto(model, ctx.world_size, card if budget is None else min(budget, card), ctx.shard_size)
    # Budgets or cards may differ between ranks; offloading on any means on all.
    chosen = bool(_dist.agree_max([int(chosen)], "offload_params='auto'")[0])
    if chosen:
        where = f"max_gpu_memory={budget / 2**30:.1f} GiB" if budget is not None else "the card"
        warnings.warn(f"offload_params='auto': this {type(model).__name__}'s parameters and gradients take "
                      f"{params_and_grads_bytes(model, ctx.shard_size) / 2**30:.1f} GiB on each of {ctx.world_size} "
                      f"rank(s), more than {PARAMS_SHARE:.0%} of what {where} leaves usable, so the blocks' "
                      "parameters stay in host memory and are copied in at each gather (slower); pass "
                      "offload_params=False to keep them on the GPU, or shard over more GPUs",
                      UserWarning, stacklevel=3)
    return chosen


def _already_wrapped(model: nn.Module, options: WrapOptions) -> Optional[nn.Module]:
    record = wrapped_record(model)
    if record is None:
        return None
    if record.options != options:
        raise ValueError(
            f"this {type(model).__name__} is already wrapped with {record.options}; wrap it once, "
            f"with the options you want (got {options})"
        )
    return model


def wrap(model: nn.Module, *, layers: Optional[LayerPolicy] = None, checkpoint: Checkpoint = "auto",
         zero_level: Optional[int] = None, reduce_dtype: Optional[torch.dtype] = None,
         max_gpu_memory: Union[int, str, None] = None, offload_params: Union[bool, str] = "auto",
         keep_logits: bool = False, compile: CompileOption = "auto", tp_size: Optional[int] = None,
         fp8: FP8Option = False) -> nn.Module:
    """Shard ``model`` over all ranks, in place, and return it.

    The repeated layers (an ``nn.ModuleList``/``nn.Sequential`` of one class, or a class a Hugging
    Face model names in ``_no_split_modules`` that occurs more than once) each become a block: their
    parameters are gathered while the previous block computes, released after use (ZeRO-3),
    optionally recomputed in backward, and their gradients reduce-scattered (averaged over ranks)
    while the next block computes. Everything else (embeddings, final norm, heads, tied weights) forms the root group,
    gathered once per forward. A model with no repeated layers is cut into pieces by size.

    The model keeps its class, its ``state_dict()`` keys and every method; each parameter stays the
    same object and becomes a 1-D view of this rank's piece. Build optimizers after ``wrap``.
    Hugging Face models also get ``use_cache=False`` in training, HF's own gradient checkpointing
    switched off, and ``generate()`` kept in step across ranks.

    Args:
        model: any ``nn.Module``; may be on the CPU, this process's GPU, or the meta device (then
            call :func:`materialize` or load weights before running it).
        layers: which modules become blocks: a list of classes or class names, or a callable
            ``(qualified_name, module) -> bool``; default: detected.
        checkpoint: ``"auto"`` (default: keep the activations of as many blocks as the GPU memory
            the first training step leaves free allows, under ``max_gpu_memory``; that step runs
            every block checkpointed, and the next few steps give memory back if they come near the
            limit; see [Note: how checkpoint="auto" decides] in ``bmtwrap/wrap/auto.py``. On the CPU
            every block stays checkpointed), ``True`` (recompute every block in backward), or
            ``False``.
        zero_level: 3 frees gathered parameters after each block's forward, 2 keeps them until
            backward; default: :func:`bmtwrap.init_distributed`'s.
        reduce_dtype: dtype gradients are averaged in; default: each parameter's own.
        max_gpu_memory: the most GPU memory this process should take, as ``nvidia-smi`` counts it
            (tensors, the allocator's cache, NCCL's buffers): ``"24GiB"``, ``"80GB"`` or bytes;
            ``checkpoint="auto"``, ``offload_params="auto"`` and
            ``AdamOffloadOptimizer(offload_fraction="auto")`` plan for it instead of the whole card, and
            torch's caching allocator is capped to it, less the memory a process takes outside the
            allocator (``engine.memory.cap_allocator``): its cache is given back before it would
            go over. Default: the card.
        offload_params: ``True``: keep the blocks' parameter shards, and their gradients, in pinned
            CPU memory; each gather copies the shard to the GPU first, so the GPU holds a block's
            parameters only while it is gathered. The root group (gathered for the whole step
            anyway) stays on the GPU. The blocks' parameters, their ``.grad`` and a plain
            optimizer's state for them are then CPU tensors; pair it with
            :class:`~bmtwrap.optim.AdamOffloadOptimizer` (:func:`bmtwrap.optim.auto_adam` does),
            which updates them in place on the CPU. ``"auto"`` (default): ``True`` on a GPU where
            this rank's parameter shards and gradients would take more than three quarters of
            ``max_gpu_memory`` (or the card), less the margin (``wrap.plan.offload_params_auto``);
            ``False`` otherwise, and on the CPU. Choosing ``True`` warns once, with the sizes.
        keep_logits: ``False`` (default): a Hugging Face causal LM called with ``labels`` in
            training mode, with gradients, computes its loss from the last hidden state, a chunk of
            tokens at a time (:func:`bmtwrap.loss.linear_cross_entropy`), and returns
            ``logits=None``: the vocabulary-wide fp32 logits and their gradient (GiBs at a 128k
            vocabulary) never exist. ``True``: transformers' own loss, with the logits. Calls in
            evaluation mode, without gradients (``generate()``) or without labels return the
            logits. See [Note: the loss without the logits] in ``bmtwrap/wrap/head_loss.py`` for
            the models it covers.
        compile: compile each block's forward for training (in training mode, with gradients;
            evaluation and ``generate()`` run eagerly) with ``torch.compile``: ``"auto"`` (default: on
            CUDA when triton is available, not on the CPU), ``True``, ``False``, or a dict of
            ``torch.compile`` options (``{"mode": "max-autotune"}``, ``{"backend": "aot_eager"}``).
            Blocks of the same shapes share one compilation, which the first training step pays
            (a few seconds for an 8B-class layer on an H100); a block that fails to compile runs in
            eager mode with one warning. See [Note: compiled blocks] in ``bmtwrap/wrap/compiled.py``.
        tp_size: tensor parallelism for a Hugging Face model, from its own plan (``model.tp_plan``): in
            groups of this many consecutive ranks each rank keeps its slice of the layers the plan splits
            (its attention heads and its part of the MLP, its rows of the vocabulary), and every parameter
            is then sharded (ZeRO) over the ``world_size // tp_size`` ranks with the same place in their
            group; gradients are averaged over those. Every rank of a group must get the same batch. It
            must divide the world size and the model's attention and key/value heads. Default: the
            process group's (``init_distributed(tp_size=...)``), 1 unless set there; when ``wrap`` starts
            the process group, it sets it up with this ``tp_size``. See [Note: the Hugging Face
            tensor-parallel plan] in ``bmtwrap/wrap/tensor_parallel.py``.
        fp8: ``False`` (default): the blocks compute in the model's dtype. ``True`` (torchao's
            ``"tensorwise"`` recipe), ``"rowwise"``, ``"rowwise_with_gw_hp"``, or a torchao
            ``Float8LinearConfig``: the blocks' linear layers compute in float8 (torchao's float8
            training, dynamic scaling); weights, gradients, optimizer state and checkpoints keep the
            model's dtype, and everything outside the blocks (embeddings, output projection) too. The
            first and last 2 blocks stay in the model's dtype too (at most a quarter of the blocks; it
            keeps float8's loss near bf16's); ``bmtwrap.Float8(recipe, keep_ends=N)`` sets that number.
            Needs a GPU with float8 tensor cores (H100, H200, L4, ...) and torchao
            (``pip install 'bmtwrap[fp8]'``). See [Note: float8 blocks] in ``bmtwrap/wrap/fp8.py``.

    Returns:
        ``model`` itself. Calling ``wrap`` again on a wrapped model with the same options is a
        no-op that returns it; with other options it raises ``ValueError``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: bad options; a class in ``layers`` that the model does not have; the model
            already contains :class:`~bmtwrap.Block` modules; parameters on several devices; a
            ``tp_size`` that does not divide the world size or the heads, differs from the process
            group's, or is given for a model with no tensor-parallel plan.
        NotImplementedError: a style of the tensor-parallel plan that bmtwrap does not apply.

    :func:`bmtwrap.init_distributed` is called with its defaults if it has not been.

    Example::

        model = AutoModelForCausalLM.from_pretrained(path)
        model = bmtwrap.wrap(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap expects an nn.Module, got {type(model).__name__}")
    _check_options(checkpoint, zero_level)
    if max_gpu_memory is not None:
        max_gpu_memory = parse_bytes(max_gpu_memory)
    if not isinstance(offload_params, bool) and offload_params != "auto":
        raise ValueError(f"offload_params must be True, False or 'auto', got {offload_params!r}")
    if not isinstance(keep_logits, bool):
        raise ValueError(f"keep_logits must be True or False, got {keep_logits!r}")
    tp_size = check_tp_size(tp_size, None)
    ctx = _dist.current() if _dist.is_initialized() else _dist.init_distributed(tp_size=tp_size or 1)
    tp_size = check_tp_size(tp_size, ctx)
    compile_with = compile_options(compile, ctx.device)
    float8 = float8_choice(fp8)
    if float8 is not None:
        check_device(float8, ctx.device)
        if tp_size > 1:  # the tensor-parallel linears run their own forward, which would bypass float8's
            raise NotImplementedError(f"wrap(fp8=..., tp_size={tp_size}): float8 blocks with tensor parallelism are "
                                      "not supported yet; use fp8 with tp_size=1 (ZeRO alone), or tp_size without fp8")
    eng = engine(ctx)
    compared = compile if isinstance(compile, (bool, str)) else tuple(sorted(compile_with.items()))
    options = WrapOptions(layers, checkpoint, zero_level or ctx.zero_level, reduce_dtype, max_gpu_memory,
                          offload_params, keep_logits, tp_size, compared, None if float8 is None else float8.compared)
    if _already_wrapped(model, options) is not None:
        return model
    if any(isinstance(m, BlockModule) for m in model.modules()):
        raise ValueError("this model already contains bmtwrap Blocks; wrap a plain model, or use the Blocks as they are")
    eng.dissolve_wrapped_under(model)  # wrapped parts are sharded again as parts of this model
    # Before the plan and the sharding: they see each parameter at the shape of this rank's slice.
    split = split_by_plan(model, ctx) if tp_size > 1 else None

    params_offloaded = (_offload_params_chosen(model, ctx, max_gpu_memory) if offload_params == "auto"
                        else offload_params)
    the_plan, blocks, shared_ids = make_plan(model, ctx.world_size, layers=layers, checkpoint=checkpoint,
                                             offload=OffloadOptions(params=params_offloaded),
                                             fused_loss=not keep_logits, shard_size=ctx.shard_size)
    the_plan = replace(the_plan, tp_size=tp_size)
    if float8 is not None:
        the_plan = replace(the_plan, fp8=describe(float8, blocks))
        convert_blocks(blocks, float8)
    adapter = adapter_for(model)
    adapter.prepare(model)

    runners: List[Tuple[nn.Module, BlockRunner]] = []
    handles: List[RemovableHandle] = []
    restore_forwards: List[Callable[[], None]] = []
    for (name, module), block_plan in zip(blocks, the_plan.blocks):
        runner = BlockRunner(module, name, recompute=bool(block_plan.checkpoint), zero_level=options.zero_level,
                             reduce_dtype=reduce_dtype, exclude=shared_ids, allow_meta=True,
                             offload=OffloadPolicy(params=params_offloaded))
        restore_forwards.append(_install_forward(module, runner, compile_with, ctx.device))
        handles.append(register_full_state_dict(module))
        runners.append((module, runner))
    if compile_with is not None:
        for name, module in compiled_outside_blocks(model, [m for _, m in blocks]):
            restore_forwards.append(replace_forward(module, compiled_forward(module.forward, f"module {name!r}",
                                                                            compile_with)))
    owned = {id(slot.param) for _, runner in runners for slot in runner.group.slots}
    # The root group stays on the device even with offload_params: it is gathered for the whole step
    # anyway, so its shard costs 1/W of it, and Hugging Face's model.device (the first parameter's,
    # the embedding's) keeps naming the GPU, which generate() puts its tensors on.
    root_group = build_group(ctx, eng.registry, model, ROOT_LABEL, lambda g, p: None, reduce_dtype,
                             exclude=owned, allow_meta=True)
    root = RootRunner(eng, root_group, replicated=[])
    if split is not None:
        mark_split([runner.group for _, runner in runners] + [root_group], split)
        restore_forwards += split.restores
    if not keep_logits:
        loss_handles, restore_head = adapter.loss_without_logits(model)
        handles += loss_handles
        if restore_head is not None:
            restore_forwards.append(restore_head)
    handles += _attach_root(model, root, adapter.entry_points(model))
    stale = _move_buffers(model, ctx.device)
    if max_gpu_memory is not None:
        eng.max_gpu_memory = max_gpu_memory
        if ctx.device.type == "cuda":
            eng.allocator_cap = cap_allocator(ctx.device, max_gpu_memory, ctx.world_size)
    auto = None
    if checkpoint == "auto":
        if ctx.device.type == "cuda":
            # Fixed-size segments strand GiBs as reserved but unusable memory on a full card, which the decision
            # would have to leave free (see offload.expandable_segments); the user's allocator settings stand.
            expandable_segments()
        auto = auto_recompute(root, [r for _, r in runners], max_gpu_memory, ctx.device)
    eng.install_step_check(_check_optimizer)
    record = Wrapped(weakref.ref(model), options, the_plan, runners, root, adapter, stale, handles, restore_forwards,
                     auto, split)
    eng.register_wrapped(model, record)
    return model


def wrapped_record(model: nn.Module) -> Optional[Wrapped]:
    """What :func:`wrap` made of ``model`` (its plan, runners, adapter), or ``None`` if it did not wrap it."""
    eng = engine()
    record = eng.wrapped_record(model)
    assert record is None or isinstance(record, Wrapped), f"rank {eng.ctx.rank}: a {type(record).__name__} as wrap record"
    return record
