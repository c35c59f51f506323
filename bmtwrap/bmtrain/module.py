"""DistributedModule (BMTrain's base class of hand-written models) and init_parameters.

The root group is the engine's :class:`~bmtwrap.engine.runners.RootRunner` (see [Note: the root group] in
runners.py); this file decides what the root of a hand-written model holds: its lone
:class:`~bmtwrap.DistributedParameter` objects (not those a block owns), and its plain parameters
outside blocks, replicated.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..engine.full_state import register_full_state_dict, shard_full_tensors
from ..engine.group import ROOT_LABEL
from ..engine.shard import find_owners, lone_group
from ..engine.param import DistributedParameter
from ..engine.runners import BlockModule, RootRunner
from ..engine.schedule import Engine, TrainingState, engine
from .pipeline import RemoteParameter

__all__ = ["DistributedModule", "grouped_parameters", "init_parameters"]


def _block_owned(module: nn.Module) -> set:
    """ids of parameters that blocks under ``module`` own."""
    owned = set()
    for sub in module.modules():
        if isinstance(sub, BlockModule):
            owned.update(id(slot.param) for slot in sub.runner.group.slots)
    return owned


def _hand_written_root(module: nn.Module, eng: Engine) -> RootRunner:
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
    return RootRunner(eng, group, replicated)


def _root_pre_forward(module: "DistributedModule", args: Any) -> None:
    eng = engine()
    if module._root is None:
        if eng.state is TrainingState.FORWARD:  # a root or block is running: the outermost call gathers
            return
        module._root = _hand_written_root(module, eng)
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

    ``state_dict()`` gives every parameter at its full shape, as a CPU tensor, on every rank (a
    collective, gathered one flat buffer at a time); ``load_state_dict`` takes full-shaped tensors.

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
        register_full_state_dict(self)
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
            if isinstance(param, RemoteParameter) and param.init_method is not None and id(param) not in seen:
                seen.add(id(param))  # another pipeline stage keeps these numbers: draw them, as it does
                param.init_method(torch.empty(param.full_shape, dtype=param.dtype, device=ctx.device))
            if not isinstance(param, DistributedParameter) or id(param) in seen or param._init_method is None:
                continue
            seen.add(id(param))
            full = torch.empty(param.tp_full_shape(ctx.tp_size), dtype=param.dtype, device=ctx.device)
            param._init_method(full)
            if param.tp_split_dim is not None:  # this rank's slice of the tensor-parallel parameter
                full = full.chunk(ctx.tp_size, dim=param.tp_split_dim)[ctx.tp_rank]
            buffer, index = eng.registry.buffer_of(ctx, param)
            piece = buffer.layout.piece(index, ctx.shard_rank)
            param.copy_(full.reshape(-1)[piece.param_start : piece.param_end])


def grouped_parameters(model: nn.Module) -> Iterator[Tuple[Optional[str], List[nn.Parameter]]]:
    """The model's parameters by the ``group`` name their :class:`~bmtwrap.DistributedParameter` was given
    (``None`` for the others), each group in registration order (BMTrain's name).

    Meant for optimizer parameter groups; the parameters are the sharded ones an optimizer takes.

    Example::

        groups = [{"params": params, "weight_decay": 0.0 if name == "norm" else 0.1}
                  for name, params in bmt.grouped_parameters(model)]
        optimizer = bmt.optim.AdamOptimizer(groups, lr=1e-4)
    """
    groups: Dict[Optional[str], List[nn.Parameter]] = {}
    for param in model.parameters():
        name = param.group if isinstance(param, DistributedParameter) else None
        groups.setdefault(name, []).append(param)
    yield from groups.items()
