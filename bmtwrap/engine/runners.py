"""The engine's runners: a module run as a ZeRO block, and a model's root group around its forward.

Both work on any module and leave the module tree untouched, so the converter uses them in place
(:func:`bmtwrap.wrap`) and BMTrain's classes wrap them (:class:`bmtwrap.Block`,
:class:`bmtwrap.DistributedModule`). What to gather when is the schedule's to say
(:class:`bmtwrap.engine.schedule.Schedule`); the runners issue it.

[Note: block lifetime in a step]
forward:  record order → prefetch what the schedule names (own group, next block) → gather own
          group → run the module (under activation checkpointing, or with saved-tensor hooks when
          ZeRO-3 frees parameters that backward still needs) → ZeRO-3: release; ZeRO-2: keep
          until backward.
backward: pre-backward (hook on the outputs) → gather what the schedule names (own group, the
          block before) → recompute / backward of the module → the parameters' full gradients
          arrive in ``_Unshard.backward`` → reduce-scatter, asynchronously → once the inputs'
          gradients are also done, release the group. The end-of-backward callback releases any
          stragglers.

[Note: the root group]
Parameters outside blocks (embeddings, a final norm, an LM head) are used in ways blocks cannot
predict: a tied embedding is read by the input lookup and again by the output projection, often
from another module's code. So they are gathered once, when the model's outermost forward starts
(the outermost :class:`~bmtwrap.DistributedModule`, or an entry point of a wrapped model), stay
visible in full to every module for the whole forward, and are released after backward (or at the
end of the forward when nothing records gradients). Plain ``nn.Parameter`` objects outside blocks
of a hand-written model are not sharded: they are replicated, and their gradients are averaged
over ranks as they arrive, as DDP does.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn
from torch.profiler import record_function
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

try:
    from torch.utils.checkpoint import _StopRecomputationError as _StopRecomputation
except ImportError:  # a torch without early stopping never raises it
    class _StopRecomputation(Exception):  # type: ignore[no-redef]
        pass

from . import dist as _dist
from .collectives import all_reduce_mean
from .group import ParamGroup, PendingReduction
from .offload import OffloadPolicy
from .shard import build_group
from .schedule import Engine, TrainingState, engine, in_backward

__all__ = ["BlockModule", "BlockRunner", "RootRunner"]


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
        recompute: recompute activations in backward instead of keeping them (activation checkpointing).
        zero_level: 3 releases gathered parameters after forward, 2 keeps them until backward;
            ``None`` takes :func:`bmtwrap.init_distributed`'s default.
        reduce_dtype: dtype gradients are reduced in; default: the parameters' dtype.
        exclude: ids of parameters under ``module`` that another group owns.
        allow_meta: accept parameters on the meta device (their shards start uninitialised).
        offload: what the group keeps on the host (see [Note: what is offloaded, and who reads it]
            in ``offload.py``).
    """

    def __init__(self, module: nn.Module, name: str, *, recompute: bool = True,
                 zero_level: Optional[int] = None, reduce_dtype: Optional[torch.dtype] = None,
                 exclude: Iterable[int] = (), allow_meta: bool = False,
                 offload: OffloadPolicy = OffloadPolicy()) -> None:
        ctx = _dist.current()
        if zero_level is None:
            zero_level = ctx.zero_level
        if zero_level not in (2, 3):
            raise ValueError(f"zero_level must be 2 or 3, got {zero_level!r}")
        self.name = name
        self.recompute = recompute
        self.zero_level = zero_level
        self._engine: Engine = engine(ctx)
        exclude = set(exclude)
        self.group: ParamGroup = build_group(ctx, self._engine.registry, module, name, self._reduced, reduce_dtype,
                                             exclude=exclude, allow_meta=allow_meta, offload=offload)
        # Told the bytes a recomputation kept alive (checkpoint="auto" measures with it), read with _allocated.
        self._activation_probe: Optional[Callable[["BlockRunner", int], None]] = None
        self._allocated: Optional[Callable[[], int]] = None
        # Asked when this block, not recomputing, runs out of memory in its forward: True if it should recompute
        # and run again (checkpoint="auto" in its first steps; see wrap/auto.py).
        self.on_out_of_memory: Optional[Callable[["BlockRunner"], bool]] = None
        self.next_block: Optional[BlockRunner] = None  # execution-order links (schedule.ExecutionOrder)
        self.prev_block: Optional[BlockRunner] = None
        # Backward events still expected from the forwards since the last backward (see _maybe_release).
        self._awaiting_inputs = 0
        self._awaiting_params = 0
        self._engine.register_block(module, self)

    def measure_activations(self, probe: Optional[Callable[["BlockRunner", int], None]],
                            allocated: Optional[Callable[[], int]]) -> None:
        """Tell ``probe`` the bytes each recomputation of this block keeps alive, as ``allocated()`` (the bytes in
        live tensors) counts them; ``None`` stops it."""
        self._activation_probe = probe
        self._allocated = allocated

    def keep_activations(self) -> None:
        """Stop recomputing: from the next forward on, this block keeps its activations for backward."""
        self.recompute = False

    def __repr__(self) -> str:
        return f"BlockRunner({self.name})"

    # --- forward -----------------------------------------------------------------------------------
    def run(self, call: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """Run ``call(*args, **kwargs)`` (the module's own forward) as this block."""
        with self._engine.engine_work():
            return self._run(call, args, kwargs)

    def _run(self, call: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        eng = self._engine
        eng.recover_if_stale()
        eng.schedule.order.record(self)
        for group in eng.schedule.forward_gathers(self):
            group.prefetch()

        recording = torch.is_grad_enabled()
        if recording:
            (args, kwargs), inputs_need_grad = _route_through(self.inputs_done, (args, kwargs))
            self._awaiting_inputs += int(inputs_need_grad)
            self._awaiting_params += int(self.group.trainable)
            eng.forward_with_grad(self)

        eng.enter_block()
        try:
            out = self._forward(call, args, kwargs, recording)
        except BaseException as error:
            eng.step_failed(error, f"the forward of block {self.name!r}")
            raise
        finally:
            eng.leave_block()

        if recording:
            out, _ = _route_through(self.pre_backward, out)
        # ZeRO-3 frees the parameters until backward, except those of the block the schedule runs
        # last (see [Note: the prefetch policy]).
        if not recording or (self.zero_level == 3 and not eng.schedule.runs_last(self)):
            self.group.release()
        return out

    def _forward(self, call: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any], recording: bool) -> Any:
        if recording and self.recompute:
            return checkpoint(self._body, call, args, kwargs, use_reentrant=False)
        if not recording or self.on_out_of_memory is None:
            return self._keeping(call, args, kwargs, recording)
        # A kept block in checkpoint="auto"'s first steps: out of memory makes it recompute instead (wrap/auto.py).
        rng = _rng_state(self._engine.ctx.device)
        try:
            return self._keeping(call, args, kwargs, recording)
        except torch.OutOfMemoryError:
            if not self.on_out_of_memory(self):
                raise
        # Out of the handler: the failed attempt's partial graph, held by its traceback, is freed by now.
        _set_rng_state(self._engine.ctx.device, rng)
        return checkpoint(self._body, call, args, kwargs, use_reentrant=False)

    def _keeping(self, call: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any], recording: bool) -> Any:
        if recording and self.zero_level == 3:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return self._body(call, args, kwargs)
        return self._body(call, args, kwargs)

    def _body(self, call: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if not in_backward():
            return self._run_module(call, args, kwargs)
        try:
            # Recomputing in backward: the root swapped its full views out when its forward ended. Shown again, a block
            # that reads the root's parameters (tied weights, or a module of the root it calls) runs what it ran in
            # forward: a compiled block the same graph, which must save the same tensors.
            with self._engine.roots_shown():
                return self._run_module(call, args, kwargs)
        except _StopRecomputation:  # checkpointing ends a recomputation early by raising this
            raise
        except BaseException as error:
            self._engine.step_failed(error, f"the recomputation of block {self.name!r} in backward")
            raise

    def _run_module(self, call: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        views = self.group.unshard()
        self.group.swap_in(views)
        try:
            with record_function(f"bmtwrap.forward:{self.name}"), self._engine.user_code():
                if self._activation_probe is not None and in_backward():
                    return self._measured(call, args, kwargs)
                return call(*args, **kwargs)
        finally:
            self.group.swap_out()

    def _measured(self, call: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        # Inside backward this is the recomputation: what it allocates and keeps is the block's activations.
        # Checkpointing stops the recomputation by raising once the last saved tensor is rebuilt, so
        # report from `finally`: by then every activation backward needs is allocated.
        allocated = self._allocated
        before = allocated()
        try:
            return call(*args, **kwargs)
        finally:
            self._activation_probe(self, allocated() - before)

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
        for group in eng.schedule.backward_gathers(self):
            group.prefetch()

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
        self.group.unpin()
        self.group.release()

    # --- used outside its run (see [Note: parameters used outside their block] in on_demand.py) -----
    def lend(self) -> None:
        """The group is gathered for code outside this block in the running forward: keep it gathered until
        the backward ends (:meth:`backward_done`), or the forward does without autograd (:meth:`take_back`)."""
        self.group.pin()
        if torch.is_grad_enabled():
            self._awaiting_params += int(self.group.trainable)  # its gradients arrive as another forward's
            self._engine.forward_with_grad(self)

    def take_back(self) -> None:
        """The forward that lent the group without autograd has ended: unpinned, and released unless a run of
        the block with autograd in that forward still needs it for its backward."""
        self.group.unpin()
        self._maybe_release()


def _rng_state(device: torch.device) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(device: torch.device, state: Tuple[torch.Tensor, Optional[torch.Tensor]]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class _SavedParameterView:
    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class BlockModule(nn.Module):
    """A module that runs itself as one block through its own :class:`BlockRunner` (:class:`bmtwrap.Block`).

    The engine's mark of such modules, so that code that must not import the BMTrain classes can
    recognise them: :func:`bmtwrap.wrap` refuses a model that contains one (its parameters are
    sharded already), and a root leaves their parameters to them.
    """

    @property
    def runner(self) -> BlockRunner:
        """The engine's side of this block: its parameter group, checkpointing and prefetch links."""
        raise NotImplementedError(f"{type(self).__name__} must define its runner")


class RootRunner:
    """Gathers a model's root group around its outermost forward (see [Note: the root group]).

    ``replicated`` parameters are not sharded; their gradients are averaged over ranks as they
    arrive.
    """

    def __init__(self, eng: Engine, group: ParamGroup, replicated: List[nn.Parameter]) -> None:
        self._engine = eng
        self.group = group
        self._awaiting_backward = False  # a forward with autograd ran; its backward has not ended
        self._recompute_views: Optional[List[torch.Tensor]] = None  # show_for_recompute's, until the next forward
        group.on_reduce = self._reduced
        if eng.ctx.world_size > 1:
            for param in replicated:
                if param.requires_grad:
                    param.register_hook(self._average_replicated)

    def _average_replicated(self, grad: torch.Tensor) -> torch.Tensor:
        averaged = grad.clone()
        all_reduce_mean(self._engine.ctx, averaged).wait()
        # Under tensor parallelism the true gradient is the sum over the group (see [Note: tensor parallelism]).
        return averaged.mul_(self._engine.ctx.tp_size) if self._engine.ctx.tp_size > 1 else averaged

    def enter(self) -> bool:
        """Start of a forward: gather and show full parameters. Not inside a block, nor when a running root
        holds this group already (see :meth:`Engine.may_enter_root`); returns whether it entered."""
        eng = self._engine
        if not eng.may_enter_root(self):
            return False
        if eng.state is not TrainingState.FORWARD:
            eng.recover_if_stale()
        self._recompute_views = None
        outermost = eng.enter_root(self)
        try:
            with eng.engine_work():
                # The outermost root's first block is gathered together with the root; a root entered inside
                # another's forward (a separately wrapped model being called) gathers its own group only.
                for group in eng.schedule.root_gathers(self) if outermost else [self.group]:
                    group.prefetch()
                self.group.ensure_gathered()
                self.group.swap_in(self.group.unshard())
        except BaseException:
            # A gather refused (a model cast after sharding, one never loaded): no forward ran, so none
            # is left half-entered for the next call to trip over.
            eng.leave_root(self)
            self.group.swap_out()
            raise
        if torch.is_grad_enabled():
            # Even a frozen root stays gathered until backward ends: backward reads its weights to
            # pass gradients down (a frozen LM head above trainable adapters).
            self._awaiting_backward = True
            eng.forward_with_grad(self)
        return True

    def exit(self) -> None:
        """End of the forward this root entered."""
        eng = self._engine
        if not eng.root_running(self):
            return
        with eng.engine_work():
            eng.leave_root(self)
            self.group.swap_out()
            # A forward without autograd frees the gathered root, unless a forward with autograd before it
            # awaits its backward, which reads the full weights (DPO's reference pass: the same peft model with its
            # adapters disabled, between the policy's forward and its backward).
            if not torch.is_grad_enabled() and not self._awaiting_backward:
                self.group.release()

    def _reduced(self, group: ParamGroup, pending: List[PendingReduction]) -> None:
        self._engine.add_reductions(pending)

    def show_for_recompute(self) -> bool:
        """Show full views again while a block that reads root parameters recomputes in backward.

        Detached: the recomputation only rebuilds saved values; gradients flow through the graph
        recorded in forward. ``requires_grad`` matches so the same tensors are saved. Made once per
        backward, shown for every block's recomputation (each block of a checkpointed model asks).
        """
        if not self.group.gathered:
            return False
        if self._recompute_views is None:
            views = [view for buffer in self.group.buffers for view in buffer.views()]
            self._recompute_views = [v.detach().requires_grad_(s.param.requires_grad)
                                     for v, s in zip(views, self.group.slots)]
        self.group.swap_in(self._recompute_views)
        return True

    def hide(self) -> None:
        self.group.swap_out()

    def backward_done(self) -> None:
        self._awaiting_backward = False
        self._recompute_views = None
        self.group.release()
