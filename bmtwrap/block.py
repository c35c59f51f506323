"""Block: one module whose parameters form one group, run with gather/prefetch/checkpointing.

:class:`BlockRunner` is the engine side (it works on any module and leaves the module tree
untouched, so the converter can use it in place); :class:`Block` is BMTrain's module wrapper
around it.

[Note: block lifetime in a step]
forward:  record order → prefetch next block → gather own group → run the module (under
          activation checkpointing, or with saved-tensor hooks when ZeRO-3 frees parameters that
          backward still needs) → ZeRO-3: release; ZeRO-2: keep until backward.
backward: pre-backward (hook on the outputs) → gather own group, prefetch the block before →
          recompute / backward of the module → the parameters' full gradients arrive in
          ``_Unshard.backward`` → reduce-scatter, asynchronously → once the inputs' gradients are
          also done, release the group. The end-of-backward callback releases any stragglers.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn
from torch.profiler import record_function
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from . import dist as _dist
from .group import ParamGroup, PendingReduction, build_group
from .schedule import Engine, engine

__all__ = ["Block", "BlockRunner", "CheckpointBlock"]


def _grad_tensors(tree: Any) -> Tuple[List[Any], Any, List[int]]:
    leaves, spec = pytree.tree_flatten(tree)
    wanted = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    return leaves, spec, wanted


def _route_through(callback: Callable[[], None], tree: Any) -> Tuple[Any, bool]:
    """Pass every grad-requiring tensor of ``tree`` through one identity node whose backward calls ``callback``.

    Returns the new tree and whether any tensor needed it (the hook then exists and will fire).
    """
    leaves, spec, wanted = _grad_tensors(tree)
    if not wanted:
        return tree, False
    routed = _BackwardHook.apply(callback, *[leaves[i] for i in wanted])
    for i, tensor in zip(wanted, routed):
        leaves[i] = tensor
    return pytree.tree_unflatten(leaves, spec), True


class _BackwardHook(torch.autograd.Function):
    """Identity on some tensors; its backward calls a callback once their gradients are all in.

    On a block's outputs it runs before the block's own backward (pre-backward); on its inputs,
    once the inputs' gradients are done (post-backward).
    """

    @staticmethod
    def forward(ctx, callback: Callable[[], None], *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        ctx.callback()
        return (None,) + grads


class BlockRunner:
    """Runs one module as a ZeRO block (see [Note: block lifetime in a step]).

    Args:
        module: the module whose parameters become this block's group; its tree is unchanged.
        name: for messages and plans.
        use_checkpoint: recompute activations in backward instead of keeping them.
        zero_level: 3 releases gathered parameters after forward, 2 keeps them until backward;
            ``None`` takes :func:`bmtwrap.init_distributed`'s default.
        reduce_dtype: dtype gradients are reduced in; default: the parameters' dtype.
        exclude: ids of parameters under ``module`` that another group owns.
        allow_meta: accept parameters on the meta device (their shards start uninitialised).
        offload_params: keep the shards in pinned host memory (see [Note: offloaded shards]).
    """

    def __init__(self, module: nn.Module, name: str, *, use_checkpoint: bool = True,
                 zero_level: Optional[int] = None, reduce_dtype: Optional[torch.dtype] = None,
                 exclude: Iterable[int] = (), allow_meta: bool = False, offload_params: bool = False) -> None:
        ctx = _dist.current()
        if zero_level is None:
            zero_level = ctx.zero_level
        if zero_level not in (2, 3):
            raise ValueError(f"zero_level must be 2 or 3, got {zero_level!r}")
        self.name = name
        self.use_checkpoint = use_checkpoint
        self.zero_level = zero_level
        self._engine: Engine = engine(ctx)
        exclude = set(exclude)
        self.group: ParamGroup = build_group(ctx, self._engine.registry, module, name, self._reduced, reduce_dtype,
                                             exclude=exclude, allow_meta=allow_meta, offload=offload_params)
        # Parameters under this module that another group (the root) owns: shared or tied weights.
        self.reads_foreign = any(id(p) in exclude for p in module.parameters())
        # Told the bytes a recomputation kept alive (checkpoint="auto" measures with it); CUDA only.
        self.activation_probe: Optional[Callable[["BlockRunner", int], None]] = None
        self.next_block: Optional[BlockRunner] = None  # execution-order links (schedule.ExecutionOrder)
        self.prev_block: Optional[BlockRunner] = None
        # Backward events still expected from the forwards since the last backward (see _maybe_release).
        self._awaiting_inputs = 0
        self._awaiting_params = 0

    def __repr__(self) -> str:
        return f"BlockRunner({self.name})"

    # --- forward -----------------------------------------------------------------------------------
    def run(self, call: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """Run ``call(*args, **kwargs)`` (the module's own forward) as this block."""
        eng = self._engine
        eng.recover_if_stale()
        eng.order.record(self)
        self.group.prefetch()
        following = self.next_block
        if following is not None and following is not self:
            following.group.prefetch()

        recording = torch.is_grad_enabled()
        if recording:
            (args, kwargs), inputs_need_grad = _route_through(self.inputs_done, (args, kwargs))
            self._awaiting_inputs += int(inputs_need_grad)
            self._awaiting_params += int(self.group.trainable)
            eng.forward_with_grad(self)

        eng.block_depth += 1
        try:
            if recording and self.use_checkpoint:
                out = checkpoint(self._body, call, args, kwargs, use_reentrant=False)
            elif recording and self.zero_level == 3:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    out = self._body(call, args, kwargs)
            else:
                out = self._body(call, args, kwargs)
        finally:
            eng.block_depth -= 1

        if recording:
            out, _ = _route_through(self.pre_backward, out)
        # ZeRO-3 frees the parameters until backward, except those of the last block, which backward
        # needs first: releasing and gathering them again would only expose a gather.
        last = eng.order.known and self.next_block is None
        if not recording or (self.zero_level == 3 and not last):
            self.group.release()
        return out

    def _body(self, call: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if self.reads_foreign and torch._C._current_graph_task_id() != -1:
            # Recomputing in backward: the root has swapped its full views out since forward.
            with self._engine.roots_shown():
                return self._run_module(call, args, kwargs)
        return self._run_module(call, args, kwargs)

    def _run_module(self, call: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        views = self.group.unshard()
        self.group.swap_in(views)
        try:
            with record_function(f"bmtwrap.forward:{self.name}"):
                if self.activation_probe is not None and torch._C._current_graph_task_id() != -1:
                    return self._measured(call, args, kwargs)
                return call(*args, **kwargs)
        finally:
            self.group.swap_out()

    def _measured(self, call: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        # Inside backward this is the recomputation: what it allocates and keeps is the block's activations.
        # Checkpointing stops the recomputation by raising once the last saved tensor is rebuilt, so
        # report from `finally`: by then every activation backward needs is allocated.
        device = self._engine.ctx.device
        before = torch.cuda.memory_allocated(device)
        try:
            return call(*args, **kwargs)
        finally:
            self.activation_probe(self, torch.cuda.memory_allocated(device) - before)

    # Saved-tensor hooks for blocks that are not checkpointed under ZeRO-3: a saved view of the
    # gathered parameters is remembered with its group, and the group is gathered again into the
    # same storage before backward reads it (see [Note: gathered views] in group.py).
    def _pack(self, tensor: torch.Tensor) -> Any:
        if self.group.owns_storage(tensor):
            return _SavedParameterView(tensor)
        return tensor

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _SavedParameterView):
            self.group.ensure_gathered()
            return saved.tensor
        return saved

    # --- backward ----------------------------------------------------------------------------------
    def pre_backward(self) -> None:
        eng = self._engine
        eng.backward_started()
        self.group.prefetch()
        before = self.prev_block
        if before is not None and before is not self:
            before.group.prefetch()

    def _reduced(self, group: ParamGroup, pending: List[PendingReduction]) -> None:
        self._awaiting_params = max(0, self._awaiting_params - 1)
        self._engine.add_reductions(pending, final=self._awaiting_params == 0)
        self._maybe_release()

    def inputs_done(self) -> None:
        self._engine.backward_started()
        self._awaiting_inputs = max(0, self._awaiting_inputs - 1)
        self._maybe_release()

    def _maybe_release(self) -> None:
        # Parameters are needed until both the inputs' and the parameters' gradients of every
        # outstanding forward are computed; only then can no backward node of this block read them.
        if self._awaiting_inputs == 0 and self._awaiting_params == 0:
            self.group.release()

    def backward_done(self) -> None:
        self._awaiting_inputs = 0
        self._awaiting_params = 0
        self.group.release()


def _unique_name(module: nn.Module) -> str:
    eng = engine()
    eng.blocks_built += 1
    return f"{type(module).__name__}#{eng.blocks_built - 1}"


class _SavedParameterView:
    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def shard_full_tensors(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any,
                       strict: bool, missing_keys: List[str], unexpected_keys: List[str], error_msgs: List[str]) -> None:
    """Load-state-dict pre-hook: a full-shaped tensor for a sharded parameter becomes this rank's piece.

    So ``model.load_state_dict(unwrapped_state_dict)`` works on a sharded model, as it does in
    BMTrain. Pieces (what ``state_dict()`` of a sharded model holds) pass through unchanged.
    """
    eng = engine()
    named = module.named_parameters(prefix=prefix[:-1], remove_duplicate=False)
    for key, param in named:
        if key not in state_dict or not eng.registry.is_sharded(param):
            continue
        buffer, index = eng.registry.buffer_of(eng.ctx, param)
        slot = buffer.slots[index]
        value = state_dict[key]
        if tuple(value.shape) == tuple(slot.shape):
            state_dict[key] = value.reshape(-1)[slot.piece.param_start : slot.piece.param_end]
            buffer.initialized = True
        elif tuple(value.shape) != tuple(param.shape):
            error_msgs.append(f"size mismatch for {key.replace('_module.', '')}: the checkpoint has shape "
                              f"{tuple(value.shape)}, the model {tuple(slot.shape)}")
            state_dict[key] = param.detach()  # reported above; keep torch from reporting the local shape too


def _strip_module_prefix(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    inner = prefix + "_module."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _add_module_prefix(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    inner = prefix + "_module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


class Block(nn.Module):
    """A module whose parameters are sharded together and gathered as one (BMTrain's ``Block``).

    Wrapping a module shards its parameters at once: each becomes a 1-D view of this rank's
    piece. Calling the block gathers them (prefetched while the previous block computes), runs
    the module with every positional and keyword argument, and returns whatever it returns;
    backward reduce-scatters the gradients (averaged over ranks) into the pieces' ``.grad``.

    Args:
        inner_module: the module to run as a block.
        use_checkpoint: recompute activations in backward (default) instead of storing them.
        zero_level: 3 frees gathered parameters after forward, 2 keeps them for backward;
            default: the value given to :func:`bmtwrap.init_distributed`.
        reduce_dtype: dtype gradients are averaged in; default: the parameters' own.
        offload_params: keep this block's parameter shards (and their gradients) in pinned CPU
            memory; the GPU holds them only while the block is gathered (see :func:`bmtwrap.wrap`).

    State dict keys are the inner module's, without a ``_module.`` level, as in BMTrain; its
    values are this rank's pieces. ``load_state_dict`` accepts pieces or full-shaped tensors.

    Raises:
        TypeError: ``inner_module`` is not an ``nn.Module``.
        ValueError: parameters on several devices or on another GPU than this process's; a
            parameter another block already owns; ``zero_level`` not 2 or 3.
        RuntimeError: :func:`bmtwrap.init_distributed` was not called.

    Example::

        layers = bmt.TransformerBlockList([bmt.Block(Layer(dim)) for _ in range(12)])
        h = layers(h, mask)
    """

    def __init__(self, inner_module: nn.Module, use_checkpoint: bool = True, zero_level: Optional[int] = None,
                 *, reduce_dtype: Optional[torch.dtype] = None, offload_params: bool = False) -> None:
        if not isinstance(inner_module, nn.Module):
            raise TypeError(
                f"Block expects an nn.Module, got {type(inner_module).__name__}; wrap the layer module itself"
            )
        if isinstance(inner_module, Block):
            raise TypeError("Block got a Block; a module is wrapped once")
        super().__init__()
        self._module = inner_module
        self._runner = BlockRunner(inner_module, _unique_name(inner_module), use_checkpoint=use_checkpoint,
                                   zero_level=zero_level, reduce_dtype=reduce_dtype, offload_params=offload_params)
        self._owner_list: Optional["weakref.ref[nn.Module]"] = None  # the TransformerBlockList holding it
        self.register_state_dict_post_hook(_strip_module_prefix)
        self.register_load_state_dict_pre_hook(_add_module_prefix)  # must run before the next one
        self.register_load_state_dict_pre_hook(shard_full_tensors)

    @property
    def runner(self) -> BlockRunner:
        """The engine's side of this block: its parameter group, checkpointing and prefetch links."""
        return self._runner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Gather the parameters, run the inner module with every argument, return what it returns."""
        return self._runner.run(self._module, args, kwargs)


CheckpointBlock = Block
"""BMTrain's other name of :class:`Block` (the same class)."""
