"""The communication unit: the parameters of one block (or of the root), sharded in flat buffers.

[Note: gathered views]
A :class:`FlatBuffer` holds parameters of one (dtype, requires_grad): ``local`` is this rank's
shard and every sharded parameter object is a 1-D view of its piece of it. ``full`` is the
gathered buffer; its storage is resized to zero bytes while sharded and back to
``world_size * shard_size`` elements for a gather, so one storage object serves every gather of
the buffer. Tensors saved for backward that view ``full`` therefore become valid again when the
buffer is gathered again; that is how a block that is not checkpointed can free its parameters
after forward (ZeRO-3). In a shard group of one the shard is the whole buffer: ``full`` *is*
``local`` (``FlatBuffer.aliased``), so a gather copies nothing and holds no second copy, and a
release frees nothing.

While a group's owner runs, each owning module's ``_parameters[name]`` entry is swapped from the
sharded parameter to a full-shaped view produced by :class:`_Unshard`, an autograd function whose
backward receives the full gradients and hands them to the owner for reduce-scattering.

[Note: offloaded shards]
With ``offload_params`` a buffer's ``local`` shard (and so every sharded parameter, and its
``.grad``) lives in pinned host memory while the model computes on the GPU: the GPU holds a
block's parameters only while it is gathered. A gather copies the shard into this rank's slice of
``full`` and all-gathers in place, both on the context's to-device copy stream (after the work
queued so far on the current stream), and the consumer's wait covers the copy. A reduced gradient
shard is copied to a new pinned host tensor on the to-host copy stream without blocking; the engine
waits for those copies (:meth:`FlatBuffer.wait_grads`) when backward ends, and an offloading
optimizer that takes a gradient during backward orders its read after the copy on that stream
(:attr:`FlatBuffer.grad_stream`). Host writes of a shard (an optimizer step) come after that wait
or that stream's event, and so after every copy of the shard that an earlier gather queued (the
computation that produced the gradient waited for it).
The choice is the buffer's ``OffloadPolicy`` (``FlatBuffer.offload``; see ``offload.py``).
"""

from __future__ import annotations

import enum
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.profiler import record_function

from .collectives import Pending, all_gather, reduce_scatter_mean, tp_sum
from .dist import DistContext
from .offload import OffloadPolicy, host_empty
from .param import DistributedParameter, FlatLayout, LocalPiece
from .tp import TpLayout

__all__ = ["FlatBuffer", "ParamGroup", "ParamRegistry", "ParamSlot", "PendingReduction", "ShardState"]


class ShardState(enum.Enum):
    SHARDED = "sharded"  # only the local shard exists; the full storage has zero bytes
    GATHERING = "gathering"  # an all-gather into the full storage is in flight
    GATHERED = "gathered"  # the full storage holds every rank's shard


Owner = Tuple[nn.Module, str]

# Label of the buffers outside every block (the root group's name starts with it).
ROOT_LABEL = "root"


@dataclass(eq=False)
class ParamSlot:
    """One parameter inside a flat buffer."""

    param: nn.Parameter  # the sharded parameter: a 1-D view of its local piece
    name: str  # its name inside the group's module, for messages and state dicts
    shape: torch.Size  # the full (unsharded) shape
    offset: int  # start in the full buffer
    piece: LocalPiece  # the part this rank owns
    owners: Tuple[Owner, ...]  # every (module, attribute) it is registered under
    # The dimension tensor parallelism splits the parameter along (``shape`` is this rank's slice); None: whole.
    tp_split_dim: Optional[int] = None

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def view_in(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter, full-shaped, inside a gathered flat buffer (``FlatBuffer.gathered()``'s)."""
        return flat[self.offset : self.offset + self.numel].view(self.shape)


class PendingReduction:
    """A reduce-scatter in flight; :meth:`finish` adds its result to the parameters' ``.grad``."""

    def __init__(self, buffer: "FlatBuffer", pending: Pending, full_grad: torch.Tensor) -> None:
        self.buffer = buffer
        self._pending = pending
        self._full_grad = full_grad  # kept alive until the collective has read it

    def finish(self) -> None:
        shard = self._pending.wait()
        self._full_grad = None
        self.buffer.accumulate_grad(shard)

    def discard(self) -> None:
        """Wait for the collective (its buffers must outlive it) and drop the result."""
        self._pending.wait()
        self._full_grad = None


class FlatBuffer:
    """Parameters of one dtype and one ``requires_grad``, laid out flat (see [Note: flat layout])."""

    def __init__(self, ctx: DistContext, layout: FlatLayout, local: torch.Tensor, slots: List[ParamSlot],
                 requires_grad: bool, reduce_dtype: Optional[torch.dtype] = None, label: str = "",
                 offload: OffloadPolicy = OffloadPolicy()) -> None:
        self.ctx = ctx
        self.label = label  # names this buffer's collectives in profiler traces
        self.layout = layout
        self.local = local
        self.slots = slots
        # Whether the parameters required gradients when they were sharded (the grouping key). A
        # parameter's requires_grad may change since: the gradients that arrive are reduced anyway.
        self.requires_grad = requires_grad
        self.reduce_dtype = reduce_dtype or local.dtype
        # What this buffer keeps on the host (see [Note: offloaded shards]); ``local`` was allocated by it.
        self.offload = offload
        self._grad_copied: Optional[torch.cuda.Event] = None  # the last gradient copy to the host in flight
        self._copied: Optional[torch.cuda.Event] = None  # the gather's copy from the host in flight
        # A shard group of one: the shard is the gathered buffer (see [Note: gathered views]).
        self.aliased = ctx.shard_size == 1 and not offload.params and local.numel() == layout.padded_total
        if self.aliased:
            self.full = local
        else:
            self.full = torch.empty(layout.padded_total, dtype=local.dtype, device=ctx.device)
            self.full.untyped_storage().resize_(0)
        self.state = ShardState.SHARDED
        self._gather: Optional[Pending] = None
        self._gathered_version = -1
        # The tensor our assigned .grad views share, and those views: weak, so that a gradient set to
        # None (zero_grad, an optimizer that took it) frees its memory; each view holds the flat tensor.
        self._grad_flat: Optional["weakref.ref[torch.Tensor]"] = None
        self._grad_views: List["weakref.ref[torch.Tensor]"] = []
        self._gaps = _padding_ranges(layout)
        # False while the shard holds no values yet (a model built on the meta device); set by
        # materialisation or loading. Gathering garbage would train on it silently.
        self.initialized = True
        # Writes of the shard still in flight (an offloading optimizer's updates): a gather waits
        # for each (see await_write).
        self._writes: List[Any] = []
        self.group: Optional["ParamGroup"] = None  # the group that gathers it (set by ParamGroup)
        # A layer of one pipeline stage: no other stage holds it (see [Note: pipeline layout] in stages.py).
        self.one_stage = False
        # How activations lie between its parameters' layers under tensor parallelism, which decides whether
        # gradients are summed over the tensor-parallel group before the reduce-scatter (see tp.TpLayout).
        self.tp_layout = TpLayout.ROWS

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def offloaded(self) -> bool:
        """Whether the shard lives on the host while the computation runs on ``ctx.device``."""
        return self.offload.params

    def _version(self) -> int:
        # In-place updates of the parameters (optimizer steps, loads) bump these counters; a
        # gathered copy older than them is stale.
        return self.local._version + sum(slot.param._version for slot in self.slots)

    # --- state transitions -------------------------------------------------------------------
    def issue_gather(self) -> None:
        """SHARDED → GATHERING (or a stale GATHERED → GATHERING): start the all-gather."""
        assert self.state is not ShardState.GATHERING, f"rank {self.ctx.rank}: gather issued twice"
        if not self.initialized:
            raise RuntimeError(
                f"the parameters of {self.label} were built on the meta device and hold no values yet: "
                "call bmtwrap.materialize(model) or load a checkpoint before running the model"
            )
        self.check_parameters()
        self.wait_writes()
        storage = self.full.untyped_storage()
        nbytes = self.layout.padded_total * self.full.element_size()
        if not self.aliased and storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        self._gathered_version = self._version()
        with record_function(f"bmtwrap.all_gather:{self.label}"):
            if self.offloaded:
                self._gather_from_host()
            else:
                self._gather = all_gather(self.ctx, self.full, self.local, label=self.label)
        self.state = ShardState.GATHERING

    def _gather_from_host(self) -> None:
        """Copy the host shard into this rank's slice of ``full`` and all-gather in place; on CUDA both on
        the to-device copy stream, so that the copy overlaps the computation (see [Note: offloaded shards])."""
        size = self.layout.shard_size
        source = self.full[self.ctx.shard_rank * size : (self.ctx.shard_rank + 1) * size]
        if self.ctx.device.type != "cuda":
            source.copy_(self.local)
            self._gather = all_gather(self.ctx, self.full, source, label=self.label)
            return
        stream = self.ctx.copy_stream("to_device")
        stream.wait_stream(torch.cuda.current_stream(self.ctx.device))  # full's storage was just allocated there
        with torch.cuda.stream(stream):
            source.copy_(self.local, non_blocking=True)
            # NCCL waits for this stream: after the copy
            self._gather = all_gather(self.ctx, self.full, source, label=self.label)
            self._copied = torch.cuda.Event()
            self._copied.record(stream)

    def await_write(self, write: Any) -> None:
        """The next gather must first call ``write.wait()``, which returns once the write is complete for
        the host and ordered before the current stream's later work (an ``ops.OffloadTicket``)."""
        self._writes.append(write)

    def wait_writes(self) -> None:
        """Wait for the shard's writes in flight (the host, and the current stream for what follows).

        Whoever reads the local shard directly (a checkpoint) calls this first; gathers do it themselves.
        """
        writes, self._writes = self._writes, []
        for write in writes:
            write.wait()

    def check_parameters(self) -> None:
        """Every parameter must still be a view of this buffer's shard."""
        base = self.local.untyped_storage().data_ptr()
        for slot in self.slots:
            if slot.param.numel() and slot.param.untyped_storage().data_ptr() != base:
                raise RuntimeError(
                    f"parameter '{slot.name}' of {self.label} was replaced after sharding (by model.to(dtype), "
                    "model.half() or an assignment to .data?); cast or move the model before sharding it"
                )

    def wait_gather(self) -> None:
        """GATHERING → GATHERED."""
        assert self.state is ShardState.GATHERING, f"rank {self.ctx.rank}: wait on a {self.state.value} buffer"
        self._gather.wait()
        self._gather = None
        if self._copied is not None:  # a copy from the host, which a world of one does not gather after
            torch.cuda.current_stream(self.ctx.device).wait_event(self._copied)
            self._copied = None
        self.state = ShardState.GATHERED

    def release(self) -> None:
        """Any state → SHARDED: free the full storage (after an in-flight gather completes)."""
        if self.state is ShardState.GATHERING:
            self.wait_gather()
        if self.state is ShardState.GATHERED:
            if not self.aliased:
                self.full.untyped_storage().resize_(0)
            self.state = ShardState.SHARDED

    def prefetch(self) -> None:
        """Start a gather unless one is in flight or a fresh copy is already there."""
        if self.state is ShardState.SHARDED or (
            self.state is ShardState.GATHERED and (self._writes or self._gathered_version != self._version())
        ):
            self.issue_gather()

    def ensure_gathered(self) -> None:
        self.prefetch()
        if self.state is ShardState.GATHERING:
            self.wait_gather()

    @property
    def gathered_nbytes(self) -> int:
        """Bytes of the whole flat buffer once gathered (padding included)."""
        return self.layout.padded_total * self.local.element_size()

    def keep_own_piece(self) -> None:
        """Copy this rank's slice of the gathered buffer into its shard (values set at full shape)."""
        assert self.state is ShardState.GATHERED, f"rank {self.ctx.rank}: keep_own_piece of a {self.state.value} buffer"
        if not self.aliased:
            size = self.layout.shard_size
            self.local.copy_(self.full[self.ctx.shard_rank * size : (self.ctx.shard_rank + 1) * size])

    @contextmanager
    def gathered(self) -> Iterator[torch.Tensor]:
        """The whole flat buffer, gathered, for the body (read its parameters with ``ParamSlot.view_in``).

        A collective: every rank enters it. Released after, unless it was gathered before (a
        running block's stays as the engine left it).
        """
        was = self.state
        self.ensure_gathered()
        try:
            yield self.full
        finally:
            if was is ShardState.SHARDED:
                self.release()

    # --- views and gradients -------------------------------------------------------------------
    def views(self) -> List[torch.Tensor]:
        assert self.state is ShardState.GATHERED, f"rank {self.ctx.rank}: views of a {self.state.value} buffer"
        return [self.full[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots]

    def owns_storage(self, tensor: torch.Tensor) -> bool:
        # Whether ``tensor`` lies in the gathered storage (``full`` spans all of it): while it is allocated, no other
        # tensor's data can start inside it. By address, not by ``untyped_storage()``, which makes a Python object:
        # this runs for every tensor a kept block saves for backward.
        if self.state is not ShardState.GATHERED:
            return False
        start = self.full.data_ptr()
        return start <= tensor.data_ptr() < start + self.full.nbytes

    def reduce_grads(self, grads: Sequence[Optional[torch.Tensor]]) -> PendingReduction:
        """Copy the full gradients into one flat buffer and start its reduce-scatter."""
        full_grad = torch.empty(self.layout.padded_total, dtype=self.reduce_dtype, device=self.ctx.device)
        for slot, grad in zip(self.slots, grads):
            target = full_grad[slot.offset : slot.offset + slot.numel]
            if grad is None:
                target.zero_()
            else:
                target.copy_(grad.reshape(-1))
        for start, end in self._gaps:
            full_grad[start:end].zero_()
        if self.ctx.tp_size > 1 and self.tp_layout is TpLayout.ROWS:
            tp_sum(self.ctx, full_grad, [(s.offset, s.offset + s.numel) for s in self.slots
                                         if isinstance(s.param, DistributedParameter) and s.param.tp_mode])
        # A shard group of one: the flat gradient is this rank's shard already (no second buffer, no copy).
        shard = (full_grad if self.ctx.shard_size == 1 else
                 torch.empty(self.layout.shard_size, dtype=self.reduce_dtype, device=self.ctx.device))
        with record_function(f"bmtwrap.reduce_scatter:{self.label}"):
            pending = reduce_scatter_mean(self.ctx, shard, full_grad, label=self.label, one_stage=self.one_stage)
        return PendingReduction(self, pending, full_grad)

    def accumulate_grad(self, shard: torch.Tensor) -> None:
        """Add a reduced gradient shard to the parameters' ``.grad`` (micro-batches accumulate).

        When every ``.grad`` is still the view we assigned last time, one flat add does it all;
        when all are ``None`` (after ``zero_grad()``), views of ``shard`` are assigned without a
        copy; otherwise (the user replaced some) each parameter is updated on its own.
        An offloaded buffer first copies ``shard`` to the host: without waiting when it becomes
        the gradient, synchronously when it is added to one.
        """
        if shard.dtype != self.dtype:
            shard = shard.to(self.dtype)
        # Only trainable parameters get a .grad, as autograd would give them (one frozen after
        # sharding keeps None); the flat shard may hold values of the others, which nobody reads.
        slots = [s for s in self.slots if s.param.requires_grad]
        params = [s.param for s in slots]
        if self.offloaded:
            shard = self._to_host(shard, wait=not all(p.grad is None for p in params))
        flat = self._grad_flat() if self._grad_flat is not None else None
        if (flat is not None and len(params) == len(self._grad_views)
                and all(p.grad is not None and p.grad is v() for p, v in zip(params, self._grad_views))):
            flat.add_(shard)
            return
        if all(p.grad is None for p in params):
            views = [shard[s.piece.shard_start : s.piece.shard_end] for s in slots]
            for p, view in zip(params, views):
                view._bmtwrap_flat_grad = shard  # the flat tensor lives as long as a view does
                p.grad = view
            if len(slots) == len(self.slots):
                # Every parameter's gradient is a view and the rest of the shard is padding, zeroed by
                # reduce_grads: a check of the views may check the shard (optim.nonfinite._to_check).
                shard._bmtwrap_whole_views = sum(1 for v in views if v.numel() > 0)
            self._grad_flat = weakref.ref(shard)
            self._grad_views = [weakref.ref(v) for v in views]
            return
        self._grad_flat = None
        for slot in slots:
            piece = shard[slot.piece.shard_start : slot.piece.shard_end]
            if slot.param.grad is None:
                slot.param.grad = piece.clone()
            else:
                slot.param.grad.add_(piece)

    @property
    def grad_stream(self) -> Optional["torch.cuda.Stream"]:
        """The stream a reader of the host gradient must follow (offloaded buffers on CUDA), else ``None``."""
        return self.ctx.copy_stream("to_host") if self.offloaded and self.ctx.device.type == "cuda" else None

    def _to_host(self, shard: torch.Tensor, wait: bool) -> torch.Tensor:
        host = host_empty(shard.numel(), shard.dtype, pinned=shard.is_cuda)
        stream = self.grad_stream
        if stream is None or wait:
            self.wait_grads()  # the gradient this one is added to may still be arriving
            host.copy_(shard)
            return host
        stream.wait_stream(torch.cuda.current_stream(self.ctx.device))
        with torch.cuda.stream(stream):
            host.copy_(shard, non_blocking=True)
            self._grad_copied = torch.cuda.Event()
            self._grad_copied.record(stream)
        shard.record_stream(stream)  # its memory returns to the allocator only after the copy
        return host

    def wait_grads(self) -> None:
        """Wait until the gradient shards copied to the host so far have arrived (offloaded buffers)."""
        if self._grad_copied is not None:
            self._grad_copied.synchronize()
            self._grad_copied = None


def _padding_ranges(layout: FlatLayout) -> List[Tuple[int, int]]:
    ranges = []
    cursor = 0
    for offset, numel in zip(layout.offsets, layout.numels):
        if offset > cursor:
            ranges.append((cursor, offset))
        cursor = offset + numel
    if layout.padded_total > cursor:
        ranges.append((cursor, layout.padded_total))
    return ranges


class ParamRegistry:
    """Which flat buffer each sharded parameter lives in (one registry per process).

    It holds parameters and buffers weakly: a model nobody uses any more is freed, its GPU memory with it.
    Its groups hold the buffers; a lone ``DistributedParameter``'s buffer is held by the parameter.
    """

    def __init__(self) -> None:
        self._entries: Dict[int, Tuple["weakref.ref[nn.Parameter]", "weakref.ref[FlatBuffer]", int]] = {}

    def any_sharded(self) -> bool:
        return any(buffer() is not None for _, buffer, _ in list(self._entries.values()))

    def add(self, buffer: FlatBuffer) -> None:
        for index, slot in enumerate(buffer.slots):
            key = id(slot.param)
            self._entries[key] = (weakref.ref(slot.param, lambda _, k=key: self._entries.pop(k, None)),
                                  weakref.ref(buffer), index)

    def remove(self, buffer: FlatBuffer) -> None:
        """Forget the buffer's parameters (they hold their full values again: an unwrapped group)."""
        for slot in buffer.slots:
            if self.lookup(slot.param) is not None:
                del self._entries[id(slot.param)]

    def lookup(self, param: torch.Tensor) -> Optional[Tuple[FlatBuffer, int]]:
        entry = self._entries.get(id(param))
        if entry is None or entry[0]() is not param:
            return None
        buffer = entry[1]()
        return None if buffer is None else (buffer, entry[2])

    def slot_of(self, ctx: DistContext, param: torch.Tensor) -> Tuple[FlatBuffer, ParamSlot]:
        """The buffer and slot of a sharded parameter (see :meth:`buffer_of`)."""
        buffer, index = self.buffer_of(ctx, param)
        return buffer, buffer.slots[index]

    def is_sharded(self, param: torch.Tensor) -> bool:
        lone = isinstance(param, DistributedParameter) and param._standalone is not None
        return lone or self.lookup(param) is not None

    def buffer_of(self, ctx: DistContext, param: torch.Tensor) -> Tuple[FlatBuffer, int]:
        """The buffer of a sharded parameter; a lone DistributedParameter gets one of its own."""
        found = self.lookup(param)
        if found is not None:
            return found
        if not isinstance(param, DistributedParameter) or param._standalone is None:
            raise ValueError("this parameter is not sharded by bmtwrap")
        layout, local = param._standalone
        slot = ParamSlot(param, "", param._original_shape, 0, layout.piece(0, ctx.shard_rank), (), param.tp_split_dim)
        buffer = FlatBuffer(ctx, layout, local, [slot], param.requires_grad, label=ROOT_LABEL)
        param._lone_buffer = buffer  # the registry holds it weakly
        self.add(buffer)
        return buffer, 0


def full_value(ctx: DistContext, registry: ParamRegistry, param: torch.Tensor) -> torch.Tensor:
    """The whole value of a sharded parameter, gathered (a collective: every rank must call it)."""
    buffer, slot = registry.slot_of(ctx, param)
    with buffer.gathered() as flat:
        return slot.view_in(flat).clone()


class _Unshard(torch.autograd.Function):
    """Full-shaped views of a gathered group; backward hands the full gradients to the group."""

    @staticmethod
    def forward(ctx, group: "ParamGroup", *params: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.set_materialize_grads(False)
        group.ensure_gathered()
        views = []
        for buffer in group.buffers:
            views.extend(buffer.views())
        frozen = [v for v, p in zip(views, params) if not p.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]) -> Tuple[None, ...]:
        ctx.group.grads_ready(grads)
        return (None,) * (1 + len(grads))


GradSink = Callable[["ParamGroup", List["PendingReduction"]], None]


class ParamGroup:
    """The flat buffers of one block or of the root, with their swap-in/swap-out of views.

    ``on_reduce`` is called from backward with the reduce-scatters just issued; the owner decides
    when to wait for them.
    """

    def __init__(self, name: str, buffers: List[FlatBuffer], on_reduce: GradSink) -> None:
        self.name = name
        self.buffers = buffers
        self.on_reduce = on_reduce
        self.slots: List[ParamSlot] = [slot for buffer in buffers for slot in buffer.slots]
        self.dissolved = False
        # Pinned: gathered on demand outside its owner's run (see on_demand.py); release() waits for unpin().
        self.pinned = False
        for buffer in buffers:
            buffer.group = self

    def dissolve(self) -> None:
        """The parameters left this group (see ``shard.unshard_group``): it holds nothing from now on, so a
        schedule link that still names it gathers nothing."""
        self.buffers = []
        self.slots = []
        self.dissolved = True

    @property
    def gathered(self) -> bool:
        return any(b.state is not ShardState.SHARDED for b in self.buffers)

    @property
    def trainable(self) -> bool:
        # Read now, not at sharding: a parameter frozen when its group was built may be trained since.
        return any(slot.param.requires_grad for slot in self.slots)

    def prefetch(self) -> None:
        for buffer in self.buffers:
            buffer.prefetch()

    def ensure_gathered(self) -> None:
        self.prefetch()
        for buffer in self.buffers:
            if buffer.state is ShardState.GATHERING:
                buffer.wait_gather()

    def release(self) -> None:
        """Free every gathered buffer, unless the group is pinned."""
        if self.pinned:
            return
        for buffer in self.buffers:
            buffer.release()

    def pin(self) -> None:
        """Keep the group gathered through every release() until :meth:`unpin`."""
        self.pinned = True

    def unpin(self) -> None:
        self.pinned = False

    def owns_storage(self, tensor: torch.Tensor) -> bool:
        return any(buffer.owns_storage(tensor) for buffer in self.buffers)

    def unshard(self) -> List[torch.Tensor]:
        """Gather (if needed) and return full views, linked to autograd through :class:`_Unshard`."""
        return list(_Unshard.apply(self, *[slot.param for slot in self.slots]))

    def swap_in(self, views: Sequence[torch.Tensor]) -> None:
        for slot, view in zip(self.slots, views):
            for module, name in slot.owners:
                module._parameters[name] = view

    def swap_out(self) -> None:
        for slot in self.slots:
            for module, name in slot.owners:
                module._parameters[name] = slot.param

    def grads_ready(self, grads: Sequence[Optional[torch.Tensor]]) -> None:
        pending = []
        cursor = 0
        for buffer in self.buffers:
            count = len(buffer.slots)
            chunk = grads[cursor : cursor + count]
            cursor += count
            if any(g is not None for g in chunk):
                pending.append(buffer.reduce_grads(chunk))
        self.on_reduce(self, pending)


# --- building groups ---------------------------------------------------------------------------
