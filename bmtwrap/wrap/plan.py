"""WrapPlan: what :func:`bmtwrap.wrap` would do to a model, and what it would cost per rank.

A plan is computed from the module tree alone (parameter shapes and dtypes), so it works on a
model built on the meta device, without allocating weights.

[Note: memory estimate]
Three parts are exact, computed with the engine's own layout (``param.build_layout``): the
parameter shards (each group's flat buffers, one per (dtype, requires_grad), padded), the gradient
shards (trainable buffers, in the reduction dtype), and Adam's state (fp32 moments, plus an fp32
master for 16-bit parameters, of which a bf16 parameter on the GPU holds half, over the elements a rank
really owns). Ranks own slightly different
element counts (alignment gaps, the tail padding): the plan reports the largest.

The rest is a model of the peak of a training step of a transformer, the larger of two moments:
- the loss, before backward has made any gradient (``zero_grad()`` freed the last step's): the parameters and
  optimizer state, the root group and one block gathered, the saved activations, and the cross-entropy of a causal LM
  head: transformers computes it in fp32 (``logits.float()``) through log-softmax, whose backward holds the saved
  log-probabilities, their gradient and the logits' gradient at once, 12 bytes per token and vocabulary entry (the
  16-bit logits are freed after forward when only the loss is kept). A wrapped model whose loss is computed without
  the logits (``head_loss.py``) holds one chunk of 16-bit logits (``loss.CHUNK_SIZE`` tokens), the fp32 gradient of the
  projection and the 16-bit gradient of its input instead;
- backward, at its peak: the blocks run last to first, so at block i the gradient shards of blocks i and after (and
  the root's) are there beside the activations saved by blocks i and before; the peak is the largest of these sums (at
  the first block when every block is checkpointed, unless the activations outweigh the gradients). Beside them: the
  parameters and optimizer state, what is gathered (the root group in full plus its full gradient, the two largest
  blocks, the running one and the prefetched one, and one block's full gradient before its reduce-scatter; in a shard
  group of one only the gradients, as a gather there aliases the shard), and one block's recomputation and backward,
  ``LAYER_SAVED`` values plus ``LAYER_FP32`` fp32 values per token, twice (its activations and their gradients). A
  compiled block (``wrap(compile=...)``, on by default on a GPU) fuses its norms and elementwise work and saves
  less: ``COMPILED_SAVED`` values per token (counted tensor by tensor), kept or recomputed, once; in float8
  (``wrap(fp8=...)``) less again, ``FLOAT8_SAVED``. Against 13 peaks measured on H100s and H200s (1B, 3B and 8B on
  one, two and four GPUs; eager and compiled blocks; checkpointed and under a budget, with the optimizer and the
  parameters offloaded) this read from -7.6 % to +5.2 %; against 15 more on one H200 with compiled blocks kept or
  checkpointed, in bf16 and float8 (1B, 3B and slices of the 8B), from -1.1 % to +5.2 %.
Saved activations: each checkpointed block keeps its input, ``tokens x hidden`` values; an un-checkpointed
block keeps what its layer saves (``LAYER_SAVED``, ``COMPILED_SAVED`` or ``FLOAT8_SAVED`` per token). Gradients
that accumulate over micro-batches are alive at the later losses too: the first moment then reads low.
Offload moves state to the host: ``AdamOffloadOptimizer`` keeps the moments and master of the
offloaded share there (pageable, exact) plus a pinned staging ring; ``offload_params`` keeps the
blocks' shards and their gradients in pinned memory of their exact size (``offload.PinnedPool``).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Set, Tuple, Union

import torch
from torch import nn

from ..engine.memory import MIN_MARGIN, margin_bytes, outside_allocator_estimate
from ..engine.offload import DEFAULT_CHUNK_NUMEL, DEFAULT_SLOTS, adam_state_bytes
from ..engine.param import build_layout
from ..engine.placement import AUTO_HEADROOM, Candidate, GradsOnGpu, Measured, kept_on_gpu
from .detect import LayerPolicy, find_blocks
from .fp8 import Float8Choice, float8_blocks
from .plan_activations import layer_bytes, loss_bytes

__all__ = ["GroupPlan", "MemoryEstimate", "OffloadOptions", "WrapPlan", "make_plan"]

Checkpoint = Union[bool, str]

# offload_params="auto": the most of the usable GPU memory this rank's parameter shards and gradients may take.
PARAMS_SHARE = 0.75


@dataclass(frozen=True)
class OffloadOptions:
    """What is offloaded to the host, for the estimate.

    Attributes:
        optimizer: the optimizer is :class:`~bmtwrap.optim.AdamOffloadOptimizer`; ``"auto"``: what
            :func:`bmtwrap.optim.auto_adam` builds (decided for a card, see ``make_plan``).
        fraction: its ``offload_fraction``: the share of the parameters whose state is on the host; ``"auto"``:
            decided for a card.
        params: ``wrap(offload_params=True)``: the blocks' shards and gradients in pinned memory.
        in_backward: the optimizer's ``step_in_backward``: a gradient shard whose parameters' state is on the
            host leaves the GPU as soon as it is final, so at most one such shard is there at a time.
        decided: ``fraction`` is what ``"auto"`` chose for the card planned for.
        chunk_numel: elements per staging chunk of the offload optimizer.
        staging_slots: staging chunks in flight.
    """

    optimizer: Union[bool, str] = False
    fraction: Union[float, str] = 1.0
    params: bool = False
    in_backward: bool = False
    decided: bool = False
    chunk_numel: int = DEFAULT_CHUNK_NUMEL
    staging_slots: int = DEFAULT_SLOTS


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
        padded_bytes: bytes of its flat buffers gathered in full (padding included).
        shard_bytes: bytes of this rank's shards of its flat buffers.
    """

    name: str
    cls: str
    params: int
    trainable: int
    bytes: int
    checkpoint: Optional[bool]
    padded_bytes: int = 0
    shard_bytes: int = 0


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank at the peak of a training step (see [Note: memory estimate] in this module).

    Attributes:
        params: this rank's parameter shards kept on the GPU (exact).
        grads: this rank's gradient shards on the GPU (exact).
        optimizer: Adam(W) state on the GPU: fp32 moments, plus an fp32 master for 16-bit
            parameters (its low half for bf16 ones), for the shards whose state is not offloaded (exact).
        gathered: full copies alive in backward: the root and its gradient, the two largest
            blocks, one block's gradient before its reduction.
        activations: saved activations plus one block's recomputation and backward, or ``None``
            when no batch shape was given.
        loss_peak: GPU bytes while the loss is computed, before any gradient exists: parameters,
            optimizer state, the root and one block gathered, saved activations and the LM head's
            fp32 cross-entropy; ``None`` without a batch shape.
        backward: GPU bytes at backward's peak: as the blocks run last to first, the gradient shards made so
            far beside the activations not yet used; ``None`` without a batch shape.
        host: CPU memory of this rank: offloaded optimizer state (exact), pinned staging,
            offloaded shards and gradients.
        host_detail: ``host`` by part, for the printout.
    """

    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: Optional[int]
    host: int = 0
    host_detail: Tuple[Tuple[str, int], ...] = ()
    loss_peak: Optional[int] = None
    backward: Optional[int] = None

    @property
    def total(self) -> int:
        """GPU bytes at the peak: the larger of :attr:`backward_peak` and :attr:`loss_peak`."""
        return max(self.backward_peak, self.loss_peak or 0)

    @property
    def backward_peak(self) -> int:
        """GPU bytes at backward's peak: :attr:`backward` given a batch shape, else every part above but ``host``
        and ``loss_peak`` (all the gradients and all the activations at once)."""
        if self.backward is not None:
            return self.backward
        return self.params + self.grads + self.optimizer + self.gathered + (self.activations or 0)


@dataclass(frozen=True)
class WrapPlan:
    """The groups :func:`bmtwrap.wrap` makes, in module order, and a per-rank memory estimate.

    Attributes:
        model: the model's class name.
        world_size: ranks planned for.
        rule: how blocks were found: "repeated layers", "classes", "policy", "size".
        blocks: the blocks, in module order.
        root: the root group (everything outside blocks).
        shared: parameters used by several blocks or outside their block: kept in the root.
        checkpoint: the activation checkpointing option.
        memory: the per-rank estimate.
        offload: what the estimate assumes is offloaded.
        ranks_per_host: ranks sharing one host's memory, for the per-host figure.
        max_gpu_memory: the budget planned for, if any.
        shard_size: ranks each parameter is sharded over (``init_distributed(shard_size=...)``); 0 for the world.
        tp_size: ranks of a tensor-parallel group (``wrap(tp_size=...)``): the groups count one rank's slices.
        fp8: the float8 compute of the blocks' linear layers (``wrap(fp8=...)``): "off", or the recipe and the count.
    """

    model: str
    world_size: int
    rule: str
    blocks: Tuple[GroupPlan, ...]
    root: GroupPlan
    shared: Tuple[str, ...]
    checkpoint: Checkpoint
    memory: MemoryEstimate
    offload: OffloadOptions = OffloadOptions()
    ranks_per_host: int = 1
    max_gpu_memory: Optional[int] = None  # the budget planned for (checkpoint="auto" keeps what fits under it)
    shard_size: int = 0  # ranks each parameter is sharded over (hybrid sharding); 0: world_size
    tp_size: int = 1
    fp8: str = "off"  # wrap(fp8=...): the recipe and how many of the blocks' linear layers compute in float8

    @property
    def shards(self) -> int:
        """Ranks each parameter is sharded over: ``shard_size``, or the world."""
        return self.shard_size or self.world_size

    @property
    def fits(self) -> Optional[bool]:
        """Whether the estimate stays under ``max_gpu_memory`` less the margin ``checkpoint="auto"`` keeps free;
        ``None`` without a budget or a batch shape."""
        if self.max_gpu_memory is None or self.memory.activations is None:
            return None
        return self.memory.total <= _usable(self.max_gpu_memory, self.world_size)

    @property
    def block_names(self) -> List[str]:
        """Qualified names of the blocks, in module order."""
        return [b.name for b in self.blocks]

    def __str__(self) -> str:
        def gib(n: int) -> str:
            return f"{n / 2**30:8.2f} GiB"

        sharding = (f", sharded in groups of {self.shards} ({self.world_size // self.shards} replicas)"
                    if self.shards != self.world_size else "")
        if self.tp_size > 1:  # the shard groups hold different slices: none replicates another
            sharding = f", tensor-parallel groups of {self.tp_size} (one rank's slices), sharded over {self.shards}"
        lines = [f"WrapPlan for {self.model} over {self.world_size} rank(s){sharding}: {len(self.blocks)} blocks "
                 f"({self.rule}), checkpoint={self.checkpoint!r}",
                 f"  {'group':<44} {'class':<28} {'params':>14} {'size':>12}  ckpt"]
        for g in (self.root, *self.blocks):
            label = g.name or "(root)"
            ckpt = "-" if g.checkpoint is None else ("yes" if g.checkpoint else "no")
            lines.append(f"  {label:<44} {g.cls:<28} {g.params:>14,} {g.bytes / 2**20:>9.1f} MiB  {ckpt}")
        if self.shared:
            lines.append(f"  kept in the root because shared: {', '.join(self.shared)}")
        if self.fp8 != "off":
            lines.append(f"  float8 compute: {self.fp8}")
        m, o = self.memory, self.offload
        offloaded = [f"optimizer state ({o.fraction:.0%})" if o.optimizer and o.fraction else "",
                     "block parameters" if o.params else ""]
        lines.append(f"  offloaded to the host: {', '.join(x for x in offloaded if x) or 'nothing'}")
        if o.decided:
            lines.append(f"  optimizer: auto_adam's choice for {self.max_gpu_memory / 2**30:.2f} GiB: the state of "
                         f"{1 - o.fraction:.0%} of the parameters on the GPU, the rest updated by the CPU "
                         "from backward on")
        lines.append("  GPU memory per rank (estimate):")
        lines.append(f"    parameters {gib(m.params)}   gradients {gib(m.grads)}   optimizer {gib(m.optimizer)}")
        act = gib(m.activations) if m.activations is not None else "   (give batch_size and seq_len)"
        lines.append(f"    gathered   {gib(m.gathered)}   activations {act}")
        if m.loss_peak is not None:
            lines.append(f"    at the loss {gib(m.loss_peak)} (no gradients yet)   in backward {gib(m.backward_peak)}")
        lines.append(f"    total      {gib(m.total)}")
        if self.fits is not None:
            usable = _usable(self.max_gpu_memory, self.world_size)
            lines.append(f"  max_gpu_memory {self.max_gpu_memory / 2**30:.2f} GiB, less a margin and the memory outside "
                         f"torch's allocator: {usable / 2**30:.2f} GiB; "
                         + ("fits" if self.fits else f"over by {(m.total - usable) / 2**30:.2f} GiB: offload the optimizer "
                            "(--offload), the block parameters (--offload-params), or a smaller batch"))
        detail = ", ".join(f"{name} {size / 2**30:.2f} GiB" for name, size in m.host_detail if size)
        lines.append(f"  host memory per rank: {gib(m.host)}" + (f"   ({detail})" if detail else ""))
        lines.append(f"  host memory per host ({self.ranks_per_host} rank(s)): {gib(m.host * self.ranks_per_host)}")
        return "\n".join(lines)


# --- the layout arithmetic, as the engine does it ----------------------------------------------


class _Buffer(NamedTuple):
    """One flat buffer a group would get: its parameters (in order), dtype and layout."""

    params: List[nn.Parameter]
    dtype: torch.dtype
    requires_grad: bool
    shard_size: int
    padded_total: int
    owned: Tuple[Tuple[int, ...], ...]  # per rank: the element count of each parameter's piece


def _buffers(params: List[nn.Parameter], world_size: int) -> List[_Buffer]:
    """The flat buffers ``shard.build_group`` makes of ``params``: one per (dtype, requires_grad)."""
    by_kind: Dict[Tuple[torch.dtype, bool], List[nn.Parameter]] = {}
    for p in params:
        by_kind.setdefault((p.dtype, p.requires_grad), []).append(p)
    out = []
    for (dtype, requires_grad), members in by_kind.items():
        layout = build_layout([p.numel() for p in members], world_size, _itemsize(dtype))
        owned = tuple(tuple(layout.piece(i, r).numel for i in range(len(members))) for r in range(world_size))
        out.append(_Buffer(members, dtype, requires_grad, layout.shard_size, layout.padded_total, owned))
    return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _group_plan(name: str, module: nn.Module, params: List[nn.Parameter], checkpoint: Optional[bool],
                buffers: List[_Buffer]) -> GroupPlan:
    return GroupPlan(
        name=name,
        cls=type(module).__name__,
        params=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        bytes=sum(p.numel() * p.element_size() for p in params),
        checkpoint=checkpoint,
        padded_bytes=sum(b.padded_total * _itemsize(b.dtype) for b in buffers),
        shard_bytes=sum(b.shard_size * _itemsize(b.dtype) for b in buffers),
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


# --- the estimate ------------------------------------------------------------------------------


class _Groups(NamedTuple):
    root: List[_Buffer]
    blocks: List[List[_Buffer]]

    def in_forward_order(self) -> Iterator[Tuple[Optional[int], _Buffer]]:
        """(the block's index, ``None`` for the root; buffer), the root first: the order the offload optimizer
        keeps state on the GPU."""
        yield from ((None, b) for b in self.root)
        yield from ((index, b) for index, group in enumerate(self.blocks) for b in group)


def _state_on_gpu(groups: _Groups, offload: OffloadOptions, rank: int) -> Set[Tuple[int, int]]:
    """(buffer id, parameter index) whose optimizer state stays on the GPU, as AdamOffloadOptimizer picks them."""
    if not offload.optimizer:
        return {(id(b), i) for _, b in groups.in_forward_order() if b.requires_grad for i in range(len(b.params))}
    if offload.fraction == 1.0:
        return set()
    pieces = [(block is not None, b, i, b.owned[rank][i]) for block, b in groups.in_forward_order()
              if b.requires_grad for i in range(len(b.params))]
    budget = (1.0 - offload.fraction) * sum(n for *_, n in pieces)
    kept = set()
    for in_block, buffer, index, numel in pieces:
        if budget < numel / 2:
            break
        if not (in_block and offload.params):  # offloaded shards are always updated on the host
            kept.add((id(buffer), index))
            budget -= numel
    return kept


def _rank_bytes(groups: _Groups, offload: OffloadOptions, rank: int) -> Dict[str, int]:
    """The exact parts of one rank's memory; ``("block grads", i)``: block ``i``'s gradient shards kept on the GPU."""
    on_gpu = _state_on_gpu(groups, offload, rank)
    out = {"params": 0, "grads": 0, "optimizer": 0, "host_state": 0, "host_params": 0}
    out.update({("block grads", i): 0 for i in range(len(groups.blocks))})
    handed_over = 0  # with step_in_backward: the largest gradient shard that leaves for the host once final
    for block, buffer in groups.in_forward_order():
        shard = buffer.shard_size * _itemsize(buffer.dtype)
        if block is not None and offload.params:
            # The shard, and (trainable) the gradient shard copied to the host, both pinned.
            out["host_params"] += shard * (2 if buffer.requires_grad else 1)
        else:
            out["params"] += shard
            leaves = (offload.optimizer and offload.in_backward
                      and not any((id(buffer), index) in on_gpu for index in range(len(buffer.params))))
            if buffer.requires_grad and leaves:
                handed_over = max(handed_over, shard)
            elif buffer.requires_grad:
                out["grads"] += shard
                if block is not None:
                    out[("block grads", block)] += shard
        if not buffer.requires_grad:
            continue
        for index, numel in enumerate(buffer.owned[rank]):
            where = "optimizer" if (id(buffer), index) in on_gpu else "host_state"
            out[where] += numel * adam_state_bytes(buffer.dtype, offloaded=where == "host_state")
    out["grads"] += handed_over
    return out


def _activations(model: nn.Module, blocks: List[GroupPlan], block_dtype: torch.dtype, batch_size: Optional[int],
                 seq_len: Optional[int], fused_loss: bool, compiled: bool,
                 float8: Set[str]) -> Optional[Tuple[List[int], int, int]]:
    """(the activations each block saves, one block's recomputation and backward, the LM head's loss) in bytes,
    or ``None`` without a batch shape (see [Note: memory estimate]); ``float8``: the blocks computing in float8."""
    if batch_size is None or seq_len is None or not blocks:
        return None
    tokens, size = batch_size * seq_len, _itemsize(block_dtype)
    layer = layer_bytes(model, tokens, size, compiled)
    if layer is None:
        return None
    saved = [tokens * layer.hidden * size if b.checkpoint else layer.kept_float8 if b.name in float8 else layer.kept
             for b in blocks]
    return saved, layer.running, loss_bytes(model, tokens, layer.hidden, size, fused_loss)


def _usable(budget: int, world_size: int) -> int:
    """The bytes of ``budget`` left for the estimate: less ``checkpoint="auto"``'s margin (taken from the budget,
    the card unknown) and the memory a process takes outside torch's allocator (``memory.outside_allocator_estimate``)."""
    return budget - margin_bytes(budget) - outside_allocator_estimate(world_size)


def offload_params_auto(model: nn.Module, world_size: int, limit: Optional[int],
                        shard_size: Optional[int] = None) -> bool:
    """What ``offload_params="auto"`` chooses: the blocks' parameters on the host when this rank's parameter
    shards and their gradients would take more than ``PARAMS_SHARE`` of ``limit`` (the process's GPU budget, or
    the card) less the margin and the memory outside torch's allocator; never without a limit (the CPU).

    What is left must hold a gathered block, the saved activations, the loss and some optimizer state: a model
    whose parameters and gradients alone fill most of the card does not train with them there, and with them on
    the host it does (at the cost of a copy per gather).
    """
    share = params_and_grads_bytes(model, shard_size or world_size)
    return limit is not None and share > PARAMS_SHARE * _usable(limit, world_size)


def params_and_grads_bytes(model: nn.Module, shard_size: int) -> int:
    """One rank's share of the model's parameters and of the gradients of the trainable ones, in bytes, sharded over
    ``shard_size`` ranks."""
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1) for p in unique) // shard_size


def _keep_what_fits(blocks: List[GroupPlan], estimate: Callable[[List[GroupPlan]], MemoryEstimate], budget: int,
                    world_size: int) -> List[GroupPlan]:
    """``checkpoint="auto"`` under ``budget``: blocks, first to last, stop checkpointing while the estimate fits."""
    planned = list(blocks)
    for index, block in enumerate(blocks):
        trial = planned[:index] + [dataclasses.replace(block, checkpoint=False)] + planned[index + 1:]
        if estimate(trial).total > _usable(budget, world_size):
            break
        planned = trial
    return planned


def _auto_offload(offload: OffloadOptions, groups: _Groups,
                  estimator: Callable[[OffloadOptions], Callable[[List[GroupPlan]], MemoryEstimate]],
                  blocks: List[GroupPlan], world_size: int, budget: Optional[int], shaped: bool) -> OffloadOptions:
    """What ``offload.optimizer="auto"`` (:func:`bmtwrap.optim.auto_adam`) or ``offload.fraction="auto"`` would
    choose on a card of ``budget`` bytes: the state that fits beside the first step, planned with every block
    checkpointed and no state on the GPU, goes there, in forward order, as the optimizer decides at its first step
    (see [Note: automatic offload fraction] in ``bmtwrap/engine/placement.py``). Without a card or a batch shape
    there is nothing to decide from: ``auto_adam``'s optimizer is planned with all its state on the GPU (what it
    keeps where everything fits), the offload optimizer's with all of it on the host."""
    if budget is None or not shaped:
        explicit = offload.optimizer is True
        return dataclasses.replace(offload, optimizer=explicit, fraction=1.0,
                                   in_backward=offload.in_backward and explicit)
    first = estimator(dataclasses.replace(offload, optimizer=True, fraction=1.0, in_backward=False))(blocks)
    candidates = [Candidate(on_gpu=block is None or not offload.params, state=numel * adam_state_bytes(buffer.dtype),
                            grad=numel * _itemsize(buffer.dtype), in_block=block is not None)
                  for block, buffer in groups.in_forward_order() if buffer.requires_grad for numel in buffer.owned[0]]
    measured = Measured(ceiling=budget, outside=outside_allocator_estimate(world_size),
                        margin=max(int(AUTO_HEADROOM * budget), MIN_MARGIN), peak=first.total,
                        loss_peak=first.loss_peak or first.total)
    kept = kept_on_gpu(candidates, measured, GradsOnGpu.LEAVE)
    numels = [numel for _, buffer in groups.in_forward_order() if buffer.requires_grad for numel in buffer.owned[0]]
    on_gpu = sum(n for n, keep in zip(numels, kept) if keep)
    fraction = 1.0 - on_gpu / max(1, sum(numels))
    return dataclasses.replace(offload, optimizer=True, fraction=fraction, in_backward=True, decided=True)


def make_plan(model: nn.Module, world_size: int, *, layers: Optional[LayerPolicy] = None,
              checkpoint: Checkpoint = "auto", batch_size: Optional[int] = None, seq_len: Optional[int] = None,
              offload: OffloadOptions = OffloadOptions(), ranks_per_host: Optional[int] = None,
              max_gpu_memory: Optional[int] = None, fused_loss: bool = True, compiled: bool = True,
              shard_size: Optional[int] = None,
              float8: Optional[Float8Choice] = None) -> Tuple[WrapPlan, List[Tuple[str, nn.Module]], Set[int]]:
    """The plan, the block modules it names, and the ids of the parameters kept in the root; the layouts are over
    ``shard_size`` ranks (default: ``world_size``); ``float8``: the blocks' float8 compute (``wrap(fp8=...)``)."""
    shards = shard_size or world_size
    blocks, rule = find_blocks(model, layers)
    in_float8 = {name for name, _ in float8_blocks(blocks, float8)} if float8 is not None else set()
    shared_ids, shared_names = shared_parameters(model, blocks)
    per_block_ckpt = checkpoint if isinstance(checkpoint, bool) else True
    block_plans, block_buffers = [], []
    owned: Set[int] = set()
    for name, module in blocks:
        params = [p for p in module.parameters() if id(p) not in shared_ids]
        owned.update(id(p) for p in params)
        buffers = _buffers(params, shards)
        block_buffers.append(buffers)
        block_plans.append(_group_plan(name, module, params, per_block_ckpt, buffers))
    root_params = [p for p in model.parameters() if id(p) not in owned]
    root_buffers = _buffers(root_params, shards)
    root = _group_plan("", model, root_params, None, root_buffers)
    groups = _Groups(root_buffers, block_buffers)

    def estimator(offload: OffloadOptions) -> Callable[[List[GroupPlan]], MemoryEstimate]:
        """The estimate of a plan of the blocks, with ``offload``'s choices (see [Note: memory estimate])."""
        ranks = [_rank_bytes(groups, offload, r) for r in range(shards)]  # replicas hold the same
        exact = {key: max(r[key] for r in ranks) for key in ranks[0]}
        root_grad = sum(b.padded_total * _itemsize(b.dtype) for b in root_buffers if b.requires_grad)
        largest = sorted((b.padded_bytes for b in block_plans), reverse=True)
        largest_grad = max((sum(b.padded_total * _itemsize(b.dtype) for b in bufs if b.requires_grad)
                            for bufs in block_buffers), default=0)
        # A gather in a shard group of one aliases its shard (engine/group.py): no copy unless the shard is on the host.
        root_copy = 0 if shards == 1 else root.padded_bytes
        block_copies = largest if shards > 1 or offload.params else []
        gathered = root_copy + root_grad + sum(block_copies[:2]) + largest_grad
        block_dtype = next((b.dtype for bufs in block_buffers for b in bufs), torch.float32)
        staging = 0
        if offload.optimizer:
            grad_size = max((_itemsize(b.dtype) for _, b in groups.in_forward_order()), default=4)
            # A gradient and a parameter per slot (cudaHostAlloc).
            staging = offload.chunk_numel * 2 * grad_size * offload.staging_slots
        host_detail = (("optimizer state", exact["host_state"]), ("pinned staging", staging),
                       ("parameters and gradients", exact["host_params"]))

        block_grads = [exact[("block grads", i)] for i in range(len(block_buffers))]
        other_grads = max(r["grads"] - sum(r[("block grads", i)] for i in range(len(block_buffers))) for r in ranks)

        def estimate(planned: List[GroupPlan]) -> MemoryEstimate:
            parts = _activations(model, planned, block_dtype, batch_size, seq_len, fused_loss, compiled, in_float8)
            loss_peak = backward = None
            if parts is not None:
                saved, recompute, loss = parts
                # At the loss: the root and the next block gathered, the saved activations, the loss.
                loss_peak = (exact["params"] + exact["optimizer"] + root_copy + sum(block_copies[:1]) + sum(saved)
                             + loss)
                # Backward runs the blocks last to first: at block i the gradient shards of blocks i and after (and
                # the root's) are there, and of the activations those saved by blocks i and before.
                grads_after = list(itertools.accumulate(reversed(block_grads)))[::-1]  # blocks i and after
                saved_up_to = itertools.accumulate(saved)  # blocks i and before
                walk = max((other_grads + after + before for after, before in zip(grads_after, saved_up_to)),
                           default=exact["grads"])
                backward = exact["params"] + exact["optimizer"] + gathered + walk + recompute
            return MemoryEstimate(
                params=exact["params"],
                grads=exact["grads"],
                optimizer=exact["optimizer"],
                gathered=gathered,
                activations=None if parts is None else sum(parts[0]) + parts[1],
                host=sum(size for _, size in host_detail),
                host_detail=host_detail,
                loss_peak=loss_peak,
                backward=backward,
            )

        return estimate

    if offload.optimizer == "auto" or offload.fraction == "auto":
        offload = _auto_offload(offload, groups, estimator, block_plans, world_size, max_gpu_memory,
                                batch_size is not None and seq_len is not None)
    estimate = estimator(offload)
    if checkpoint == "auto" and max_gpu_memory is not None and batch_size is not None and seq_len is not None:
        block_plans = _keep_what_fits(block_plans, estimate, max_gpu_memory, world_size)
    memory = estimate(block_plans)
    plan = WrapPlan(type(model).__name__, world_size, rule, tuple(block_plans), root, tuple(shared_names),
                    checkpoint, memory, offload, ranks_per_host or min(world_size, 8), max_gpu_memory, shards)
    return plan, blocks, shared_ids
