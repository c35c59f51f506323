"""WrapPlan: what :func:`bmtwrap.wrap` would do to a model, and what it would cost per rank.

A plan is computed from the module tree alone (parameter shapes and dtypes), so it works on a
model built on the meta device, without allocating weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple, Union

import torch
from torch import nn

from .detect import LayerPolicy, find_blocks

__all__ = ["GroupPlan", "MemoryEstimate", "WrapPlan", "make_plan"]

Checkpoint = Union[bool, str]


@dataclass(frozen=True)
class GroupPlan:
    """One communication group: a block, or the root (everything outside blocks).

    Attributes:
        name: qualified module name ("" for the root).
        cls: module class name.
        params: parameter count.
        trainable: parameters with ``requires_grad``.
        bytes: parameter bytes, unsharded.
        checkpoint: activation checkpointing (``None`` for the root, which is never checkpointed).
    """

    name: str
    cls: str
    params: int
    trainable: int
    bytes: int
    checkpoint: Optional[bool]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank at the peak of a training step (estimates; ``activations`` needs a batch shape).

    Attributes:
        params: this rank's shards of every parameter.
        grads: this rank's shards of the gradients (trainable parameters only).
        optimizer: Adam(W) state for this rank's trainable shards: two moments, plus an fp32 master
            copy when the parameters are not fp32.
        gathered: full copies alive at once: the root, the two largest blocks (the running one and
            the prefetched one), and the gradient buffer of the largest block.
        activations: saved activations, or ``None`` when no batch shape was given. Uses 34 bytes per
            token and hidden unit for a layer kept whole (16-bit, fused attention) and the hidden
            state alone for a checkpointed layer.
    """

    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: Optional[int]

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.gathered + (self.activations or 0)


@dataclass(frozen=True)
class WrapPlan:
    """The groups :func:`bmtwrap.wrap` makes, in module order, and a per-rank memory estimate."""

    model: str
    world_size: int
    rule: str  # how blocks were found: "repeated layers", "classes", "policy", "size"
    blocks: Tuple[GroupPlan, ...]
    root: GroupPlan
    shared: Tuple[str, ...]  # parameters used by several blocks or outside their block: kept in the root
    checkpoint: Checkpoint
    memory: MemoryEstimate

    @property
    def block_names(self) -> List[str]:
        return [b.name for b in self.blocks]

    def __str__(self) -> str:
        def gib(n: int) -> str:
            return f"{n / 2**30:8.2f} GiB"

        lines = [f"WrapPlan for {self.model} over {self.world_size} rank(s): {len(self.blocks)} blocks "
                 f"({self.rule}), checkpoint={self.checkpoint!r}",
                 f"  {'group':<44} {'class':<28} {'params':>14} {'size':>12}  ckpt"]
        for g in (self.root, *self.blocks):
            label = g.name or "(root)"
            ckpt = "-" if g.checkpoint is None else ("yes" if g.checkpoint else "no")
            lines.append(f"  {label:<44} {g.cls:<28} {g.params:>14,} {g.bytes / 2**20:>9.1f} MiB  {ckpt}")
        if self.shared:
            lines.append(f"  kept in the root because shared: {', '.join(self.shared)}")
        m = self.memory
        lines.append("  memory per rank (estimate):")
        lines.append(f"    parameters {gib(m.params)}   gradients {gib(m.grads)}   optimizer {gib(m.optimizer)}")
        act = gib(m.activations) if m.activations is not None else "   (give batch_size and seq_len)"
        lines.append(f"    gathered   {gib(m.gathered)}   activations {act}")
        lines.append(f"    total      {gib(m.total)}")
        return "\n".join(lines)


def _group_plan(name: str, module: nn.Module, params: List[nn.Parameter], checkpoint: Optional[bool]) -> GroupPlan:
    return GroupPlan(
        name=name,
        cls=type(module).__name__,
        params=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        bytes=sum(p.numel() * p.element_size() for p in params),
        checkpoint=checkpoint,
    )


def shared_parameters(model: nn.Module, blocks: List[Tuple[str, nn.Module]]) -> Tuple[Set[int], List[str]]:
    """ids (and names) of parameters that a block does not own alone: used by another block or outside."""
    where: Dict[int, Set[int]] = {}
    for index, (_, block) in enumerate(blocks):
        for p in block.parameters():
            where.setdefault(id(p), set()).add(index)
    inside = {id(m) for _, b in blocks for m in b.modules()}
    outside = {id(p) for m in model.modules() if id(m) not in inside for p in m.parameters(recurse=False)}
    shared_ids = {pid for pid, owners in where.items() if len(owners) > 1 or pid in outside}
    names = [n for n, p in model.named_parameters() if id(p) in shared_ids]
    return shared_ids, names


def _hidden_size(model: nn.Module) -> Optional[int]:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for attr in ("hidden_size", "d_model", "n_embd", "dim"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    return None


def make_plan(model: nn.Module, world_size: int, *, layers: Optional[LayerPolicy] = None,
              checkpoint: Checkpoint = True, batch_size: Optional[int] = None,
              seq_len: Optional[int] = None) -> Tuple[WrapPlan, List[Tuple[str, nn.Module]], Set[int]]:
    """The plan, the block modules it names, and the ids of the parameters kept in the root."""
    blocks, rule = find_blocks(model, layers)
    shared_ids, shared_names = shared_parameters(model, blocks)
    per_block_ckpt = checkpoint if isinstance(checkpoint, bool) else True
    block_plans = []
    owned: Set[int] = set()
    for name, module in blocks:
        params = [p for p in module.parameters() if id(p) not in shared_ids]
        owned.update(id(p) for p in params)
        block_plans.append(_group_plan(name, module, params, per_block_ckpt))
    root_params = [p for p in model.parameters() if id(p) not in owned]
    root = _group_plan("", model, root_params, None)

    every = list(model.parameters())
    total_bytes = sum(p.numel() * p.element_size() for p in every)
    trainable = [p for p in every if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    state_bytes = sum(p.numel() * (8 if p.dtype == torch.float32 else 12) for p in trainable)
    largest = sorted((b.bytes for b in block_plans), reverse=True)
    gathered = root.bytes + sum(largest[:2]) + (largest[0] if largest else 0)
    activations = None
    hidden = _hidden_size(model)
    if batch_size is not None and seq_len is not None and hidden is not None and block_plans:
        tokens = batch_size * seq_len
        whole = 34 * tokens * hidden
        kept = sum(whole if not b.checkpoint else 2 * tokens * hidden for b in block_plans)
        activations = kept + (whole if per_block_ckpt else 0)
    memory = MemoryEstimate(
        params=-(-total_bytes // world_size),
        grads=-(-grad_bytes // world_size),
        optimizer=-(-state_bytes // world_size),
        gathered=gathered,
        activations=activations,
    )
    plan = WrapPlan(type(model).__name__, world_size, rule, tuple(block_plans), root, tuple(shared_names),
                    checkpoint, memory)
    return plan, blocks, shared_ids
