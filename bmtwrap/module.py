"""DistributedModule and the root group: the parameters outside every block.

[Note: the root group]
Parameters outside blocks (embeddings, a final norm, an LM head) are used in ways blocks cannot
predict: a tied embedding is read by the input lookup and again by the output projection, often
from another module's code. So they are gathered once, when the outermost
:class:`DistributedModule` starts its forward, stay visible in full to every module for the whole
forward, and are released after backward (or at the end of the forward when nothing records
gradients). Plain ``nn.Parameter`` objects outside blocks are not sharded: they are replicated,
and their gradients are averaged over ranks as they arrive, as DDP does.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .block import Block, shard_full_tensors
from .collectives import all_gather, all_reduce_mean
from .group import ROOT_LABEL, FlatBuffer, ParamGroup, PendingReduction, ShardState, find_owners, lone_group
from .param import DistributedParameter
from .schedule import Engine, engine

__all__ = ["DistributedModule", "full_grad_dict", "full_state_dict", "init_parameters"]


def _block_owned(module: nn.Module) -> set:
    """ids of parameters that blocks under ``module`` own."""
    owned = set()
    for sub in module.modules():
        if isinstance(sub, Block):
            owned.update(id(slot.param) for slot in sub.runner.group.slots)
    return owned


class RootRunner:
    """Gathers a model's root group around its outermost forward (see [Note: the root group]).

    ``replicated`` parameters are not sharded; their gradients are averaged over ranks as they
    arrive.
    """

    def __init__(self, eng: Engine, group: ParamGroup, replicated: List[nn.Parameter]) -> None:
        self._engine = eng
        self.group = group
        group.on_reduce = self._reduced
        if eng.ctx.world_size > 1:
            for param in replicated:
                if param.requires_grad:
                    param.register_hook(self._average_replicated)

    @classmethod
    def of_distributed_module(cls, module: nn.Module, eng: Engine) -> "RootRunner":
        """The root of a hand-written model: its lone DistributedParameters and plain parameters."""
        owned = _block_owned(module)
        lone: List[Tuple[str, DistributedParameter]] = []
        replicated: List[nn.Parameter] = []
        for name, param in module.named_parameters():
            if id(param) in owned:
                continue
            if isinstance(param, DistributedParameter):
                if param._standalone is not None:  # else a block elsewhere owns it
                    lone.append((name, param))
            elif eng.registry.lookup(param) is None:
                replicated.append(param)
        group = lone_group(eng.ctx, eng.registry, lone, find_owners(module), f"{ROOT_LABEL} of {type(module).__name__}",
                           lambda g, p: None)
        return cls(eng, group, replicated)

    def _average_replicated(self, grad: torch.Tensor) -> torch.Tensor:
        averaged = grad.clone()
        all_reduce_mean(self._engine.ctx, averaged).wait()
        return averaged

    def enter(self) -> bool:
        """Start of a forward: gather and show full parameters, unless a root or block is running."""
        eng = self._engine
        if eng.active_root is not None or eng.block_depth > 0:
            return False
        eng.recover_if_stale()
        eng.active_root = self
        eng.order.restart()
        self.group.prefetch()
        if eng.order.first is not None:
            eng.order.first.group.prefetch()  # in flight together with the root's gather
        self.group.ensure_gathered()
        self.group.swap_in(self.group.unshard())
        if torch.is_grad_enabled():
            # Even a frozen root stays gathered until backward ends: backward reads its weights to
            # pass gradients down (a frozen LM head above trainable adapters).
            eng.forward_with_grad(self)
        return True

    def exit(self) -> None:
        """End of the forward this root entered."""
        if self._engine.active_root is not self:
            return
        self._engine.active_root = None
        self.group.swap_out()
        if not torch.is_grad_enabled():
            self.group.release()

    def _reduced(self, group: ParamGroup, pending: List[PendingReduction]) -> None:
        self._engine.add_reductions(pending)

    def show_for_recompute(self) -> bool:
        """Show full views again while a block that reads root parameters recomputes in backward.

        Detached: the recomputation only rebuilds saved values; gradients flow through the graph
        recorded in forward. ``requires_grad`` matches so the same tensors are saved.
        """
        if not self.group.gathered:
            return False
        views = [view for buffer in self.group.buffers for view in buffer.views()]
        self.group.swap_in([v.detach().requires_grad_(s.param.requires_grad) for v, s in zip(views, self.group.slots)])
        return True

    def hide(self) -> None:
        self.group.swap_out()

    def backward_done(self) -> None:
        self.group.release()


def _root_pre_forward(module: "DistributedModule", args: Any) -> None:
    eng = engine()
    if module._root is None:
        if eng.active_root is not None or eng.block_depth > 0:
            return
        module._root = RootRunner.of_distributed_module(module, eng)
    module._root.enter()


def _root_post_forward(module: "DistributedModule", args: Any, output: Any) -> None:
    if module._root is not None:
        module._root.exit()


class DistributedModule(nn.Module):
    """Base class for hand-written models whose parameters are sharded (BMTrain's name).

    Holds :class:`~bmtwrap.DistributedParameter` objects and blocks like any ``nn.Module``.
    When the outermost ``DistributedModule`` runs forward, the parameters outside every block
    are gathered once and every module sees them in full until the forward returns; their
    gradients are reduce-scattered after backward. Plain ``nn.Parameter`` objects outside blocks
    stay replicated and get their gradients averaged over ranks.

    Example::

        class GPT(bmt.DistributedModule):
            def __init__(self):
                super().__init__()
                self.embed = bmt.DistributedParameter(torch.empty(vocab, dim), init_method=torch.nn.init.normal_)
                self.layers = bmt.TransformerBlockList([bmt.Block(Layer(dim)) for _ in range(n)])

            def forward(self, ids):
                h = self.layers(torch.nn.functional.embedding(ids, self.embed))
                return h @ self.embed.T  # the tied weight, in full
    """

    def __init__(self) -> None:
        super().__init__()
        self._root: Optional[RootRunner] = None
        self.register_load_state_dict_pre_hook(shard_full_tensors)
        self.register_forward_pre_hook(_root_pre_forward)
        self.register_forward_hook(_root_post_forward, always_call=True)


@torch.no_grad()
def init_parameters(model: nn.Module) -> None:
    """Fill every :class:`~bmtwrap.DistributedParameter` that has an ``init_method``.

    Each rank draws the full tensor with the same RNG sequence a single process would (module
    order, then parameter registration order) and keeps its own piece, so the result is
    bit-identical to initialising the unsharded model in one process with the same seed.
    """
    eng = engine()
    ctx = eng.ctx
    seen = set()
    for module in model.modules():
        for param in module._parameters.values():
            if not isinstance(param, DistributedParameter) or id(param) in seen or param._init_method is None:
                continue
            seen.add(id(param))
            full = torch.empty(param._original_shape, dtype=param.dtype, device=ctx.device)
            param._init_method(full)
            buffer, index = eng.registry.buffer_of(ctx, param)
            piece = buffer.layout.piece(index, ctx.rank)
            param.copy_(full.reshape(-1)[piece.param_start : piece.param_end])


@torch.no_grad()
def full_state_dict(model: nn.Module, *, with_buffers: bool = True,
                    select: Optional[Callable[[str], bool]] = None) -> Dict[str, torch.Tensor]:
    """The model's state dict with every sharded parameter gathered to its full shape.

    A collective: every rank must call it; every rank gets the whole result. Keys are the
    unwrapped model's (a :class:`Block` adds no ``_module.`` level).

    Args:
        model: a model sharded by bmtwrap (or any module: unsharded tensors are copied).
        with_buffers: include buffers as well as parameters.
        select: keep only the keys for which it returns ``True``; only the flat buffers holding
            such keys are gathered (e.g. the trainable adapters of a frozen model, without
            gathering the model). Every rank must pass the same selection.

    Example::

        adapters = bmt.full_state_dict(model, select=lambda key: "lora_" in key)
    """
    eng = engine()
    entries = model.state_dict(keep_vars=True)
    if select is not None:
        entries = {name: value for name, value in entries.items() if select(name)}
    # Each flat buffer is gathered once for all of its parameters (in the same order on every rank).
    by_buffer: Dict[int, Tuple[FlatBuffer, List[Tuple[str, int]]]] = {}
    for name, value in entries.items():
        if isinstance(value, nn.Parameter) and eng.registry.is_sharded(value):
            buffer, index = eng.registry.buffer_of(eng.ctx, value)
            by_buffer.setdefault(id(buffer), (buffer, []))[1].append((name, index))
    gathered: Dict[str, torch.Tensor] = {}
    for buffer, names in by_buffer.values():
        was = buffer.state
        buffer.ensure_gathered()
        for name, index in names:
            slot = buffer.slots[index]
            gathered[name] = buffer.full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
        if was is ShardState.SHARDED:
            buffer.release()
    out: Dict[str, torch.Tensor] = {}
    for name, value in entries.items():
        if name in gathered:
            out[name] = gathered[name]
        elif isinstance(value, nn.Parameter) or with_buffers:
            out[name] = value.detach().clone()
    return out


@torch.no_grad()
def full_grad_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter's gradient at its full shape (zeros where no rank holds one).

    A collective: every rank must call it; every rank gets the whole result. Keys are parameter
    names as the unwrapped model has them.
    """
    eng = engine()
    ctx = eng.ctx
    gathered: Dict[int, torch.Tensor] = {}
    out: Dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        key = ".".join(part for part in name.split(".") if part != "_module")
        if not eng.registry.is_sharded(param):
            out[key] = param.grad.detach().clone() if param.grad is not None else torch.zeros_like(param)
            continue
        buffer, index = eng.registry.buffer_of(ctx, param)
        if id(buffer) not in gathered:
            shard = torch.zeros(buffer.layout.shard_size, dtype=buffer.dtype, device=ctx.device)
            for slot in buffer.slots:
                if slot.param.grad is not None:
                    shard[slot.piece.shard_start : slot.piece.shard_end] = slot.param.grad
            full = torch.empty(buffer.layout.padded_total, dtype=buffer.dtype, device=shard.device)
            all_gather(ctx, full, shard).wait()
            gathered[id(buffer)] = full
        slot = buffer.slots[index]
        out[key] = gathered[id(buffer)][slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
    return out
